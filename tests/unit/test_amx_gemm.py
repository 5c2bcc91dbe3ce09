"""The AMX tile matmul (csrc/amx_gemm.c) against a float32 reference, its independence of the row count, and
its place in `cpu_gemm.linear`."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_small_gemm import _data
from tokenloom.layers import cpu_gemm

pytestmark = pytest.mark.skipif(cpu_gemm._amx() is None, reason="no AMX on this CPU (or no C compiler)")


# row counts cover one 16-row group, a 32-row group with a partial second tile, 32 + a 16-row tail, and
# several groups; widths cover tails of N (not a multiple of 16 or 32) and of K (not a multiple of 32)
@pytest.mark.parametrize("m", [1, 3, 16, 17, 32, 45, 96])
@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (37, 64), (16, 32), (1, 96), (50, 70)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_float32_reference(m, n, k, bias):
    x, w, b = _data(m, n, k, m * 1000 + n + k, bias)
    got = cpu_gemm.amx_linear(x, w, cpu_gemm.pack_amx(w), b)
    ref = x.float() @ w.float().T + (0 if b is None else b.float())
    assert got is not None and got.dtype == torch.bfloat16 and got.shape == (m, n)
    # products exact, float32 sums: beyond summation order the only error is the final rounding to bf16
    assert torch.allclose(got.float(), ref, rtol=2 ** -8, atol=2e-3)


def test_row_result_independent_of_batch_and_threads():
    """A row's output is the same bits whichever rows share the call and however many threads run it (the
    native decode step and the modular path rely on it)."""
    x, w, b = _data(40, 300, 576, 3, True)
    packed = cpu_gemm.pack_amx(w)
    alone = torch.cat([cpu_gemm.amx_linear(x[i: i + 1], w, packed, b) for i in range(40)])
    together = cpu_gemm.amx_linear(x, w, packed, b)
    assert torch.equal(alone, together)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = cpu_gemm.amx_linear(x, w, packed, b)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(single, together)


def test_strided_rows():
    x, w, _ = _data(5, 48, 64, 1, False)
    wide = torch.cat([x, x], dim=1)[:, 64:]  # rows with stride 128
    packed = cpu_gemm.pack_amx(w)
    assert torch.equal(cpu_gemm.amx_linear(wide, w, packed), cpu_gemm.amx_linear(x.contiguous(), w, packed))


def test_pack_declines_other_dtypes():
    assert cpu_gemm.pack_amx(torch.zeros(16, 32)) is None  # float32: no AMX copy


def test_linear_uses_amx_up_to_its_row_limit():
    x, w, b = _data(cpu_gemm.AMX_M_MAX, 200, 576, 9, True)
    packed = cpu_gemm.pack_weight(w)
    assert packed is not None and packed.amx is not None
    assert torch.equal(cpu_gemm.linear(x, w, packed, b), cpu_gemm.amx_linear(x, w, packed.amx, b))
    assert torch.equal(cpu_gemm.linear(x[:1], w, packed, b), cpu_gemm.amx_linear(x[:1], w, packed.amx, b))
