"""One activation row's two int8 terms summed as one integer dot product (csrc/quant_common.h's
`tl_act_q8.paired`) against the same terms kept apart: the check both kernel families' tests share."""

from __future__ import annotations

import ctypes

import torch

from tokenloom.kernels import quant_gemm as qg


def check_one_row_pairs(qm: qg.QuantMatrix, x: torch.Tensor) -> None:
    """x [1, k] bf16 through the prepared `qm` with the pair (the default) and with the terms apart
    (`quant_act_pairs(0)`): only float32 rounding separates the two, and it does (the paired form is the one
    taken); both stay within the two terms' bound, sum_i |w_i| d(i) / 256 with d = the block's max|x| / 127."""
    lib = qg._native()
    assert lib.quant_act_pairs(ctypes.c_int(-1)) == 1
    paired = qg.linear(x, qm, out_dtype=torch.float32).double()
    try:
        assert lib.quant_act_pairs(ctypes.c_int(0)) == 0
        apart = qg.linear(x, qm, out_dtype=torch.float32).double()
    finally:
        lib.quant_act_pairs(ctypes.c_int(1))
    w = qg.dequantize(qm).double()
    xd = x.double()
    ref, mag = xd @ w.T, xd.abs() @ w.abs().T
    assert not torch.equal(paired, apart)
    assert bool(((paired - apart).abs() <= 1e-6 * mag + 1e-9).all())
    d = xd.abs().view(1, -1, 32).amax(-1) / 127
    tol = (d.repeat_interleave(32, dim=1) / 256) @ w.abs().T + 2e-5 * mag + 1e-7
    for got in (paired, apart):
        assert bool(((got - ref).abs() <= tol).all()), float(((got - ref).abs() / tol).max())
