"""The Q5_0 / Q5_1 kernels (csrc/quant_q5.c behind tokenloom/kernels/quant_gemm.py) against the `gguf`
package's dequantize and a float32 matmul: the types llama-quantize writes into a Q4_K_M / Q5_K_M file where a
tensor's rows are not whole 256-element super-blocks (most of SmolLM2-135M's Q4_K_M file).

Blocks come from gguf's own quantizer; the reference is gguf's dequantize of the file-layout bytes, taken before
`prepare` re-lays them out. Bounds as in test_quant_gemm.py (its `_expected_error`)."""

from __future__ import annotations

import ctypes

import gguf
import numpy as np
import pytest
import torch

from tests.act_pairs import check_one_row_pairs
from tests.expert_groups import expert_groups
from tests.thread_counts import at_thread_counts
from tests.unit.test_quant_gemm import _expected_error, _int8_path, check_linear_within_bound
from tokenloom.kernels import quant_gemm as qg

Q5 = ["Q5_0", "Q5_1"]

pytestmark = pytest.mark.skipif(not all(qg.native_supported(qg.TYPE_IDS[t]) for t in Q5),
                                reason="no AVX512-VNNI or no C compiler: Q5_0 / Q5_1 take the reference")


def _matrix(name: str, n: int, k: int, seed: int) -> tuple[qg.QuantMatrix, torch.Tensor]:
    """Valid blocks of `name` from random float32 data with a per-row offset (so Q5_1's mins vary), and the
    gguf package's dequantize of them (file layout)."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * 0.05 + rng.standard_normal((n, 1)) * 0.02).astype(np.float32)
    qtype = qg.TYPE_IDS[name]
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType(qtype))
    ref = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(qtype)).astype(np.float32))
    return qg.QuantMatrix.from_gguf(qtype, (n, k), raw, f"test.{name}"), ref.reshape(n, k)


# k: 3 blocks (a tail of one partial group), 576 (a span of 16 blocks and a tail of 2), 12 blocks (a tail of
# whole groups), 31 (a span and 15), 29 (a span and 13)
WIDTHS = [32 * 3, 576, 32 * 12, 32 * 31, 32 * 29]


@pytest.mark.parametrize("name", Q5)
@pytest.mark.parametrize("k", WIDTHS)
def test_dequantize_bit_exact(name, k):
    qm, ref = _matrix(name, 77, k, k)
    prepared = qg.prepare(qm)
    assert prepared.packed and prepared.nbytes == qm.nbytes and not torch.equal(prepared.data, qm.data)
    assert torch.equal(qg.dequantize(prepared), ref)
    ids = torch.tensor([[5, 0], [76, 5]])
    assert torch.equal(qg.embedding(ids, prepared, torch.float32), ref[ids])
    assert torch.equal(qg.embedding(ids, prepared, torch.bfloat16), ref[ids].bfloat16())


@pytest.mark.parametrize("name", Q5)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 64, 130])
@pytest.mark.parametrize("k", WIDTHS)
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
def test_linear_within_bound(name, m, k, x_dtype):
    qm, w_ref = _matrix(name, 77, k, m * 7 + k)
    check_linear_within_bound(qm, w_ref, m, x_dtype, m + k)


@pytest.mark.parametrize("name", Q5)
@pytest.mark.parametrize("m,k", [(1, 32 * 965), (4, 32 * 600), (5, 32 * 600)])
def test_long_rows_in_column_passes(name, m, k):
    """Rows whose prepared activations outgrow the kernel's stack buffer go through in passes of spans that add
    up, the tail in the last: a pair (one row) past 50 spans (k = 30880: 60 spans and 5 tail blocks), 4 rows past
    24 (k = 19200: 37 spans and 8 tail blocks) and 5 rows (4, then 1), within the int8 bound."""
    n = 21
    qm, w_ref = _matrix(name, n, k, 91)
    prepared = qg.prepare(qm)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(91)).bfloat16()
    assert _int8_path(prepared, m, torch.bfloat16)
    ref = x.float() @ w_ref.T
    got = qg.linear(x, prepared, out_dtype=torch.float32)
    assert bool(((got - ref).abs() <= _expected_error(x, w_ref, True, ref, torch.float32)).all())


@pytest.mark.parametrize("name", Q5)
@pytest.mark.parametrize("n,k", [(77, 576), (21, 32 * 965)])
def test_one_row_sums_its_two_terms_as_one(name, n, k):
    """At one activation row the two int8 terms go through as one pair (128 dot0 + dot1, Q5_0's -16 offsets in
    the integer sums, Q5_1's pair offset d0 s0 + d1 s1): only float32 rounding separates it from the terms kept
    apart, both within the two terms' bound (which check_one_row_pairs takes 128 times tighter than one term's);
    in one pass of spans and in two."""
    qm, _ = _matrix(name, n, k, 71)
    check_one_row_pairs(qg.prepare(qm), torch.randn(1, k, generator=torch.Generator().manual_seed(71)).bfloat16())


@pytest.mark.skipif(qg.native_isa() != 2, reason="the AVX-512 family's pairs (the AVX2 one keeps terms apart)")
@pytest.mark.parametrize("name", Q5)
@pytest.mark.parametrize("n,k", [(77, 576), (21, 32 * 226), (40, 320)])
def test_batched_rows_sum_their_two_terms_as_one(name, n, k):
    """At 2-11 activation rows each row's two terms go through as a pair too (q5_pairs_dot; quant_act_pairs(1)
    keeps them apart past one row): one chunk of spans or several (k = 7232), the tail pass pair by pair
    (k = 576's two blocks after its span) and no span at all (k = 320). Only float32 rounding separates the
    two, and both stay within the two terms' bound."""
    from tests.act_pairs import PAIRS_ONE_ROW, check_row_pairs

    qm, _ = _matrix(name, n, k, 73)
    prepared = qg.prepare(qm)
    gen = torch.Generator().manual_seed(73)
    for m in (2, 3, 5, 8, 9, 11):
        check_row_pairs(prepared, torch.randn(m, k, generator=gen).bfloat16(), PAIRS_ONE_ROW)


@pytest.mark.parametrize("name", Q5)
def test_many_row_int8_path(name):
    """Past the small stream, bf16 x takes the many-row int8 path on the type's unsigned quants (u8_row: q in
    0..31, scale d, minimum -16 d or m): within the int8 bound, and a row's result does not depend on the rows
    beside it."""
    n, k = 77, 576
    qm, w_ref = _matrix(name, n, k, 21)
    prepared = qg.prepare(qm)
    x = torch.randn(64, k, generator=torch.Generator().manual_seed(21)).bfloat16()
    lib = qg._native()
    batch, tile_from = lib.quant_batch_m(ctypes.c_int(-1)), lib.quant_tile_m(ctypes.c_int(-1))
    try:
        lib.quant_batch_m(ctypes.c_int(1))
        lib.quant_tile_m(ctypes.c_int(0))
        assert lib.quant_path(prepared.qtype, 64, k, 0) == 2
        got = qg.linear(x, prepared, out_dtype=torch.float32)
        assert torch.equal(qg.linear(x[20:33], prepared, out_dtype=torch.float32), got[20:33])
    finally:
        lib.quant_batch_m(ctypes.c_int(batch))
        lib.quant_tile_m(ctypes.c_int(tile_from))
    ref = x.float() @ w_ref.T
    assert bool(((got - ref).abs() <= _expected_error(x, w_ref, True, ref, torch.float32)).all())


@pytest.mark.parametrize("name", Q5)
def test_thread_counts_and_prefetch_change_no_result(name):
    """Over 1000 rows (several work items, a partial one) the results at 1, 2 and 3 threads, and with the
    software prefetch off, are bit-identical, for 1 and 3 activation rows."""
    n, k = 1000, 576
    qm, _ = _matrix(name, n, k, 51)
    prepared = qg.prepare(qm)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(51)).bfloat16()

    def run():
        return [qg.linear(x[:m], prepared, out_dtype=torch.float32) for m in (1, 3)]

    got = at_thread_counts(run, (1, 2, 3))
    lib = qg._native()
    default = lib.quant_prefetch(ctypes.c_int(-1))
    try:
        lib.quant_prefetch(ctypes.c_int(0))
        no_prefetch = run()
    finally:
        lib.quant_prefetch(ctypes.c_int(default))
    for other in (got[2], got[3], no_prefetch):
        for a, b in zip(got[1], other, strict=True):
            assert torch.equal(a, b)


def test_moe_experts_call_with_q5_experts():
    """The fused MoE call (csrc/quant_moe.c) over experts whose projections are Q5_0 / Q5_1 (a Q4_K_M file's
    experts where the expert width is not whole super-blocks, e.g. 1408), mixed with Q4_0 and Q8_0 ones, for 1,
    3 and 40 tokens: within 5e-4 of float64 over gguf's dequantized experts (measured ~1e-4: the int8 activation
    terms; rounding the SwiGLU output to bf16 between the projections would cost ~1e-3)."""
    if qg.native_isa() != 2:
        pytest.skip("the fused MoE call with these kernels is the AVX-512 family's")
    hidden, inter, experts = 576, 320, 4
    kinds = [("Q5_0", "Q5_1"), ("Q5_1", "Q5_0"), ("Q4_0", "Q5_0"), ("Q5_0", "Q8_0")]
    gu_raw = [_matrix(a, 2 * inter, hidden, 10 + e) for e, (a, _) in enumerate(kinds)]
    dn_raw = [_matrix(b, hidden, inter, 20 + e) for e, (_, b) in enumerate(kinds)]
    gu = [qg.prepare(m) for m, _ in gu_raw]
    dn = [qg.prepare(m) for m, _ in dn_raw]
    deq_gu = [w.double() for _, w in gu_raw]
    deq_dn = [w.double() for _, w in dn_raw]
    g = torch.Generator().manual_seed(5)
    for tokens in (1, 3, 40):
        x = torch.randn(tokens, hidden, generator=g).bfloat16()
        ids = torch.stack([torch.randperm(experts, generator=g)[:2] for _ in range(tokens)])
        weights = torch.rand(tokens, 2, generator=g)
        order, counts, active, group_start = expert_groups(ids, experts)

        used = active.tolist()
        tables = [(torch.tensor([ms[e].qtype for e in used], dtype=torch.int32),
                   torch.tensor([ms[e].data.data_ptr() for e in used], dtype=torch.int64)) for ms in (gu, dn)]
        got = qg.moe_experts(x.contiguous(), order // 2, weights.flatten().float().index_select(0, order).contiguous(),
                             group_start, tables[0], tables[1], inter).double()
        ref = torch.zeros(tokens, hidden, dtype=torch.float64)
        for t in range(tokens):
            for j in range(2):
                e = int(ids[t, j])
                h = deq_gu[e] @ x[t].double()
                ref[t] += float(weights[t, j]) * (deq_dn[e] @ (torch.nn.functional.silu(h[:inter]) * h[inter:]))
        err = float((got - ref).norm() / ref.norm())
        assert 0 < err < 5e-4, (tokens, err)
