"""Each activation row's two int8 terms summed as one integer dot product (csrc/quant_common.h's
`tl_act_q8.paired` at one row, `tl_act_q8.pairs` at more) against the same terms kept apart: the check the
kernel families' tests share."""

from __future__ import annotations

import ctypes

import torch

from tokenloom.kernels import quant_gemm as qg

PAIRS_EVERYWHERE = 2  # quant_act_pairs' default: pairs at every row count of the small path
PAIRS_ONE_ROW = 1  # pairs at one activation row only (the terms apart past it)


def check_row_pairs(qm: qg.QuantMatrix, x: torch.Tensor, apart_setting: int) -> None:
    """x [m, k] bf16 through the prepared `qm` with the pairs (the default) and with quant_act_pairs at
    `apart_setting`, one where x's rows keep their terms apart: only float32 rounding separates the two, and
    it does (the paired form is the one taken); both stay within the two terms' bound, sum_i |w_i| d(i) / 256
    with d = the block's max|x| / 127."""
    lib = qg._native()
    assert lib.quant_act_pairs(ctypes.c_int(-1)) == PAIRS_EVERYWHERE
    paired = qg.linear(x, qm, out_dtype=torch.float32).double()
    try:
        assert lib.quant_act_pairs(ctypes.c_int(apart_setting)) == apart_setting
        apart = qg.linear(x, qm, out_dtype=torch.float32).double()
    finally:
        lib.quant_act_pairs(ctypes.c_int(PAIRS_EVERYWHERE))
    w = qg.dequantize(qm).double()
    xd = x.double()
    ref, mag = xd @ w.T, xd.abs() @ w.abs().T
    assert not torch.equal(paired, apart)
    assert bool(((paired - apart).abs() <= 1e-6 * mag + 1e-9).all())
    d = xd.abs().view(x.shape[0], -1, 32).amax(-1) / 127
    tol = (d.repeat_interleave(32, dim=1) / 256) @ w.abs().T + 2e-5 * mag + 1e-7
    for got in (paired, apart):
        assert bool(((got - ref).abs() <= tol).all()), float(((got - ref).abs() / tol).max())


def check_one_row_pairs(qm: qg.QuantMatrix, x: torch.Tensor) -> None:
    """x [1, k]: the pair against the terms apart (`quant_act_pairs(0)`), as check_row_pairs."""
    check_row_pairs(qm, x, 0)
