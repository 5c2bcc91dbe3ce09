"""The AVX2 bf16 matmul of unquantized weights (csrc/tile_avx2.c through `cpu_gemm.avx2_linear`), which x86 CPUs
without AVX-512 run where oneDNN has no bf16 matmul, against a float64 matmul of the same bf16 values.

Each check runs in a fresh process with TOKENLOOM_CPU_KERNELS_ISA=avx2, so a CPU with AVX-512 tests the same
build an AVX2-only CPU makes. Bound per output o = sum_i w_i x_i (exact bf16 products, float32 sums):
k * 2^-24 * sum_i |w_i x_i|; a bf16 output adds its rounding, 2^-8 |o|.
"""

from __future__ import annotations

import pytest

from tests.avx2_subprocess import has_avx2, run_avx2

pytestmark = pytest.mark.skipif(not has_avx2(), reason="the CPU has no AVX2/FMA/F16C")

PRELUDE = """
import ctypes
import torch
from tokenloom.layers import cpu_gemm
from tokenloom.kernels import quant_gemm as qg

lib = qg._native()
assert lib.quant_isa() == 1 and cpu_gemm._avx2() is not None
TILE_M = lib.avx2_bf16_tile_m(-1)
assert TILE_M == 8


def bound(x, w):
    return x.shape[1] * 2.0 ** -24 * (x.double().abs() @ w.double().abs().T) + 1e-6
"""


def _run(body: str) -> None:
    run_avx2(PRELUDE + body)


def test_stream_and_tile_within_float32_summation():
    """Row counts on both sides of the tile's start (the weight stream below it, the float32 tile from it), k
    not a multiple of 16 or of the tile's column chunk, n past whole 32-row items, bf16 / float32 bias, bf16 /
    float32 out: every output within float32 summation's bound of the exact product."""
    _run("""
g = torch.Generator().manual_seed(0)
for k in (8, 24, 200, 576):
    for n in (1, 37, 70):
        w = torch.randn(n, k, generator=g).bfloat16()
        for m in (1, 2, 3, 4, 5, 7, 8, 9, 17, 25, 70):
            x = torch.randn(m, k, generator=g).bfloat16()
            bias = torch.randn(n, generator=g)
            ref = x.double() @ w.double().T
            got = cpu_gemm.avx2_linear(x, w, bias, torch.float32).double()
            assert bool(((got - ref - bias.double()).abs() <= bound(x, w)).all()), (k, n, m)
            b16 = bias.bfloat16()
            got16 = cpu_gemm.avx2_linear(x, w, b16).double()
            ref16 = ref + b16.double()
            assert bool(((got16 - ref16).abs() <= bound(x, w) + 2.0 ** -8 * ref16.abs()).all()), (k, n, m)
""")


def test_rows_and_threads_change_no_result():
    """Within the stream and within the tile, a row's result does not depend on the rows beside it nor on the
    thread count (1, 2, 3): bit for bit."""
    _run("""
from tests.thread_counts import at_thread_counts
g = torch.Generator().manual_seed(1)
w = torch.randn(301, 576, generator=g).bfloat16()
x = torch.randn(70, 576, generator=g).bfloat16()
for rows, parts in ((slice(0, 7), (slice(0, 1), slice(2, 5), slice(6, 7))),
                    (slice(0, 70), (slice(0, 8), slice(5, 22), slice(40, 65), slice(61, 70)))):
    xs = x[rows]
    runs = at_thread_counts(lambda: cpu_gemm.avx2_linear(xs, w, None, torch.float32), (1, 2, 3))
    assert torch.equal(runs[1], runs[2]) and torch.equal(runs[1], runs[3]), rows
    for part in parts:
        assert torch.equal(cpu_gemm.avx2_linear(xs[part], w, None, torch.float32), runs[1][part]), (rows, part)
""")


def test_where_onednn_has_no_bf16_the_layers_take_it():
    """Where oneDNN has no bf16 matmul (stood in for here), `pack_weight` marks a bf16 weight for the AVX2 kernel
    (no copy), `linear` and the LM head's `native_linear_f32` take it (no float32 copy of the head's weight),
    and what it does not take (k not a multiple of 8, float32 weights) stays with torch, correctly."""
    _run("""
cpu_gemm._onednn_bf16 = lambda: False
g = torch.Generator().manual_seed(2)
w = torch.randn(40, 96, generator=g).bfloat16()
x = torch.randn(5, 96, generator=g).bfloat16()
packed = cpu_gemm.pack_weight(w)
assert packed is not None and packed.avx2 and packed.onednn is None
assert torch.equal(cpu_gemm.linear(x, w, packed), cpu_gemm.avx2_linear(x, w))
head = cpu_gemm.pack_weight(w, onednn=False)
assert head is not None and head.avx2
logits = cpu_gemm.native_linear_f32(x, w, head)
assert logits.dtype == torch.float32 and bool(((logits.double() - x.double() @ w.double().T).abs()
                                                <= bound(x, w)).all())
odd = torch.randn(40, 20, generator=g).bfloat16()
assert cpu_gemm.pack_weight(odd) is None and cpu_gemm.avx2_linear(x[:, :20].contiguous(), odd) is None
assert cpu_gemm.pack_weight(w.float()) is None
x3 = torch.randn(2, 3, 96, generator=g).bfloat16()
assert torch.equal(cpu_gemm.linear(x3, w, packed), cpu_gemm.avx2_linear(x3.reshape(6, 96), w).view(2, 3, 40))
rc = lib.avx2_bf16_linear(ctypes.c_void_p(x.data_ptr()), ctypes.c_int64(96), ctypes.c_void_p(w.data_ptr()),
                          ctypes.c_int64(40), ctypes.c_int64(90), None, 0, ctypes.c_void_p(logits.data_ptr()),
                          ctypes.c_int64(40), 1, ctypes.c_int64(5), 1)
assert rc == -2  # k not a multiple of 8: refused, nothing written
""")
