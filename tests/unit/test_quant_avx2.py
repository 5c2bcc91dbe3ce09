"""The AVX2 family of the quantized-matmul kernels (csrc/quant_avx2.c), the one x86 CPUs without the AVX-512
families run (AMD Zen 2/3, Intel client cores), against the `gguf` package's dequantize and a float64 matmul.

Each check runs in a fresh process with TOKENLOOM_CPU_KERNELS_ISA=avx2, so a CPU with AVX-512 tests the same
build an AVX2-only CPU makes (on an AVX2-only CPU the two builds are the same code). Bounds per output
o = sum_i w_i x_i: bf16 x with two int8 terms |err| <= sum_i |w_i| d(i) / 256 (d = the activation block's
max|x| / 127), with one term d(i) / 2; the float32 tile (float32 x, and bf16 x from quant_tile_m rows on):
k * 2^-24 * sum_i |w_i x_i|; a bf16 output adds 2^-8 |o|.
"""

from __future__ import annotations

import pytest

from tests.avx2_subprocess import has_avx2, run_avx2

pytestmark = pytest.mark.skipif(not has_avx2(), reason="the CPU has no AVX2/FMA/F16C")

PRELUDE = """
import ctypes, sys
import gguf, numpy as np, torch
sys.path.insert(0, 'tests/unit')
from test_quant_kquants import make_blocks
from tokenloom.kernels import quant_gemm as qg

TYPES = ['Q4_0', 'Q4_1', 'Q5_0', 'Q5_1', 'Q8_0', 'Q4_K', 'Q5_K', 'Q6_K']


def matrix(name, n, k, seed):
    qtype = qg.TYPE_IDS[name]
    if qtype >= 12:  # gguf-py does not quantize the K types: valid random super-blocks
        raw = make_blocks(qtype, n, k, seed)
    else:
        rng = np.random.default_rng(seed)
        w = (rng.standard_normal((n, k)) * 0.05 + rng.standard_normal((n, 1)) * 0.02).astype(np.float32)
        raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType(qtype))
    return qg.QuantMatrix.from_gguf(qtype, (n, k), raw, 'test.' + name)


def f32_bound(x, w):
    return x.shape[1] * 2.0 ** -24 * (x.double().abs() @ w.abs().T) + 1e-6


def int8_bound(x, w, divisor):
    m, k = x.shape
    d = x.double().abs().view(m, k // 32, 32).amax(-1) / 127
    mag = x.double().abs() @ w.abs().T
    return (d.repeat_interleave(32, dim=1) / divisor) @ w.abs().T + 1e-5 * mag + 1e-6


lib = qg._native()
assert qg.native_isa() == 1 and lib.quant_isa() == 1 and qg.native_moe_supported()
assert lib.quant_tile_m(-1) == 16 and lib.quant_i8_tile_m(-1) == 0  # the one-term int8 tile: opt-in
I8_TYPES = ('Q4_0', 'Q4_1', 'Q4_K', 'Q5_K')  # the one-term int8 tile's (rows of whole 256-element spans)
"""


def _run(body: str) -> None:
    run_avx2(PRELUDE + body)


def test_every_type_within_the_two_term_bound():
    """All eight types at 1-70 rows, k one to several blocks: every type's rows are re-laid out (Q4_K / Q5_K 4
    bytes a super-block larger, their scales unpacked), dequantize and embedding rows are the gguf package's bit
    for bit, bf16 x is within the two int8 terms' bound below quant_tile_m rows (quant_path 1) and within float32
    summation's from there (the float32 tile, quant_path 0) and within one term's from quant_i8_tile_m rows on
    where the one-term int8 tile runs (quant_path 3), into float32 or bf16 and with a bias; float32 x (quant_path
    0 at any row count) within float32 summation's."""
    _run("""
for name in TYPES:
    qtype = qg.TYPE_IDS[name]
    for k in ((96, 576) if qtype < 12 else (256, 768)):
        qm = matrix(name, 37, k, k + qtype)
        ref_w = qg.dequantize(qm)
        p = qg.prepare(qm)
        relaid = p.data.shape != qm.data.shape or not torch.equal(p.data, qm.data)  # lane order
        grow = 4 * 37 * k // 256 if name in ('Q4_K', 'Q5_K') else 0  # their scales unpacked: 16 bytes, not 12
        assert p.packed and p.nbytes == qm.nbytes + grow and relaid, name
        assert torch.equal(qg.dequantize(p), ref_w), name
        ids = torch.tensor([[3, 0], [36, 3]])
        assert torch.equal(qg.embedding(ids, p, torch.float32), ref_w[ids])
        assert torch.equal(qg.embedding(ids, p, torch.bfloat16), ref_w[ids].bfloat16())
        w = ref_w.double()
        g = torch.Generator().manual_seed(k)
        bias = torch.randn(37, generator=g)
        for m in (1, 2, 3, 4, 5, 7, 8, 9, 17, 25, 70):
            tile = m >= lib.quant_tile_m(-1)
            i8 = 0 < lib.quant_i8_tile_m(-1) <= m and name in I8_TYPES and k % 256 == 0
            path = 3 if i8 else 0 if tile else 1
            assert lib.quant_path(qtype, m, k, 0) == path and lib.quant_path(qtype, m, k, 1) == 0
            x = torch.randn(m, k, generator=g).bfloat16()
            ref = x.double() @ w.T + bias.double()
            bound = int8_bound(x, w, 2) if i8 else f32_bound(x, w) if tile else int8_bound(x, w, 256)
            got = qg.linear(x, p, bias, out_dtype=torch.float32).double()
            assert bool(((got - ref).abs() <= bound).all()), (name, k, m)
            got16 = qg.linear(x, p, bias).double()
            assert bool(((got16 - ref).abs() <= bound + 2.0 ** -8 * ref.abs()).all()), (name, m)
            xf = torch.randn(m, k, generator=g)
            got_f = qg.linear(xf, p).double()
            assert bool(((got_f - xf.double() @ w.T).abs() <= f32_bound(xf, w)).all()), (name, k, m)
""")


def test_largest_quants_and_activations_stay_exact():
    """The K types with every quant at its largest (Q4_K 15, Q5_K 31, Q6_K 63: where Q5_K / Q6_K add the
    vpmaddubsw pair sums in int16, the sums come nearest 32767) against activation rows at the largest terms
    (every element the block's max, both signs, the first term 127 everywhere) and random rows: within the two
    int8 terms' bound at 1-4 rows, so no int16 sum wrapped."""
    _run("""
full = {'Q4_K': [(16, 144)], 'Q5_K': [(16, 176)], 'Q6_K': [(0, 192)]}  # quant bytes of a file super-block
for name, spans in full.items():
    qtype = qg.TYPE_IDS[name]
    k = 768
    raw = make_blocks(qtype, 8, k, 11).copy()
    blocks = raw.reshape(8 * k // 256, -1)  # a view: one super-block a row
    for lo, hi in spans:
        blocks[:, lo:hi] = 0xFF
    qm = qg.QuantMatrix.from_gguf(qtype, (8, k), raw, 'test.' + name)
    p = qg.prepare(qm)
    w = qg.dequantize(qm).double()
    g = torch.Generator().manual_seed(3)
    ones = torch.ones(k)
    rows = [ones, -ones, ones * torch.where(torch.arange(k) % 64 < 32, 1.0, -1.0), torch.randn(k, generator=g)]
    for m in (1, 2, 3, 4):
        x = torch.stack(rows[:m]).bfloat16()
        ref = x.double() @ w.T
        got = qg.linear(x, p, out_dtype=torch.float32).double()
        assert bool(((got - ref).abs() <= int8_bound(x, w, 256)).all()), (name, m, (got - ref).abs().max())
""")


def test_second_term_is_used_and_one_term_stays_within_its_bound():
    """quant_act_residual(0) leaves one int8 term (llama.cpp's Q8 activations): within d / 2, and the default
    two terms cut that error by more than 30x on every type (the second term is really read)."""
    _run("""
for name in TYPES:
    qtype = qg.TYPE_IDS[name]
    k = 576 if qtype < 12 else 768
    qm = qg.prepare(matrix(name, 64, k, 5))
    w = qg.dequantize(qm).double()
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(5)).bfloat16()
    ref = x.double() @ w.T
    two = qg.linear(x, qm, out_dtype=torch.float32).double()
    try:
        lib.quant_act_residual(0)
        one = qg.linear(x, qm, out_dtype=torch.float32).double()
    finally:
        lib.quant_act_residual(1)
    assert bool(((one - ref).abs() <= int8_bound(x, w, 2)).all()), name
    rel = lambda a: float((a - ref).norm() / ref.norm())
    assert 0 < rel(two) < rel(one) / 30, (name, rel(two), rel(one))
""")


def test_rows_and_threads_change_no_result():
    """Within each path a row's result does not depend on the rows beside it nor on the thread count (1, 2, 3),
    bit for bit: the int8 terms (the tile off) alone or in a batch of 70 that crosses the 64-row activation
    chunks; the float32 tile in batches of 16 to 70 rows (its 8-row groups and 24-row register tiles cut
    differently), weight rows past whole 32-row items."""
    _run("""
from tests.thread_counts import at_thread_counts
tile_m = lib.quant_tile_m(-1)
for name in TYPES:
    qtype = qg.TYPE_IDS[name]
    k = 576 if qtype < 12 else 768
    qm = qg.prepare(matrix(name, 301, k, 9))
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(9)).bfloat16()
    for tile, slices in ((0, (slice(0, 1), slice(5, 9), slice(62, 67), slice(69, 70))),
                         (tile_m, (slice(0, 16), slice(5, 22), slice(40, 65), slice(50, 70)))):
        lib.quant_tile_m(tile)
        try:
            runs = at_thread_counts(lambda: qg.linear(x, qm, out_dtype=torch.float32), (1, 2, 3))
            assert torch.equal(runs[1], runs[2]) and torch.equal(runs[1], runs[3]), (name, tile)
            for rows in slices:
                part = qg.linear(x[rows], qm, out_dtype=torch.float32)
                assert torch.equal(part, runs[1][rows]), (name, tile, rows)
        finally:
            lib.quant_tile_m(tile_m)
""")


def test_one_term_int8_tile():
    """Turned on (quant_i8_tile_m 32), bf16 x from 32 rows on against Q4_0 / Q4_1 / Q4_K / Q5_K rows of whole
    256-element spans takes the one-term int8 tile (quant_path 3; Q8_0, Q6_K, Q5_0, Q5_1, a legacy row with a
    tail of nb % 8 blocks, float32 x and fewer rows do not): within one int8 term's bound sum_i |w_i| d(i) / 2 at
    32-70 rows and
    several spans, into float32 and bf16 with a bias; a row's result does not depend on the rows beside it nor on
    the thread count, bit for bit; every quant at its largest (Q4 15, Q5_K 31: the int16 sums of eight / four
    vectors nearest 32767) against rows of +-1 stays within the bound (no int16 sum wrapped). It is off by default
    (quant_i8_tile_m 0: the float32 tile) and TOKENLOOM_QUANT_I8_TILE_M sets it."""
    _run("""
import os, subprocess
from tests.thread_counts import at_thread_counts
assert lib.quant_path(2, 64, 512, 0) == 0
lib.quant_i8_tile_m(32)
assert [lib.quant_path(qg.TYPE_IDS[t], 32, 512, 0) for t in TYPES] == [3, 3, 0, 0, 0, 3, 3, 0]
assert [lib.quant_path(2, m, k, x32) for m, k, x32 in ((31, 512, 0), (32, 576, 0), (32, 512, 1))] == [0, 0, 0]
for name in I8_TYPES:
    qtype = qg.TYPE_IDS[name]
    for k in (256, 1024):
        qm = matrix(name, 45, k, k + qtype)
        w = qg.dequantize(qm).double()
        p = qg.prepare(qm)
        g = torch.Generator().manual_seed(k)
        bias = torch.randn(45, generator=g)
        for m in (32, 33, 70):
            x = torch.randn(m, k, generator=g).bfloat16()
            assert lib.quant_path(qtype, m, k, 0) == 3
            ref = x.double() @ w.T + bias.double()
            bound = int8_bound(x, w, 2)
            got = qg.linear(x, p, bias, out_dtype=torch.float32).double()
            assert bool(((got - ref).abs() <= bound).all()), (name, k, m)
            got16 = qg.linear(x, p, bias).double()
            assert bool(((got16 - ref).abs() <= bound + 2.0 ** -8 * ref.abs()).all()), (name, k, m)
        x = torch.randn(70, k, generator=g).bfloat16()
        runs = at_thread_counts(lambda: qg.linear(x, p, out_dtype=torch.float32), (1, 2, 3))
        assert torch.equal(runs[1], runs[2]) and torch.equal(runs[1], runs[3]), name
        for rows in (slice(0, 32), slice(5, 40), slice(31, 70)):
            assert torch.equal(qg.linear(x[rows], p, out_dtype=torch.float32), runs[1][rows]), (name, rows)
full = {'Q4_K': (16, 144), 'Q5_K': (16, 176), 'Q4_0': (2, 18), 'Q4_1': (4, 20)}  # quant bytes of a file block
for name, (lo, hi) in full.items():
    qtype = qg.TYPE_IDS[name]
    if qtype >= 12:
        raw = make_blocks(qtype, 8, 512, 11).copy()
        raw.reshape(8 * 2, -1)[:, lo:hi] = 0xFF
    else:
        raw = matrix(name, 8, 512, 11).data.numpy().copy()
        raw.reshape(8 * 16, -1)[:, lo:hi] = 0xFF
    qm = qg.QuantMatrix.from_gguf(qtype, (8, 512), raw, 'test.' + name)
    w = qg.dequantize(qm).double()
    ones = torch.ones(512)
    x = torch.stack([ones, -ones] * 16).bfloat16()
    got = qg.linear(x, qg.prepare(qm), out_dtype=torch.float32).double()
    assert bool(((got - x.double() @ w.T).abs() <= int8_bound(x, w, 2)).all()), name
lib.quant_i8_tile_m(0)
assert lib.quant_path(2, 64, 512, 0) == 0
code = "from tokenloom.kernels import quant_gemm as qg; print(qg._native().quant_i8_tile_m(-1))"
env = {**os.environ, 'TOKENLOOM_QUANT_I8_TILE_M': '32'}
assert subprocess.run([sys.executable, '-c', code], env=env, capture_output=True, text=True).stdout.strip() == '32'
""")


def test_bad_shapes_and_types_are_refused():
    """The checks of what the entry points are given hold under this family too: test_quant_gemm's clear errors
    (k not whole blocks, a type that is not quantized, ...), and a row index past the matrix (-3)."""
    _run("""
from test_quant_gemm import test_bad_shapes_have_clear_errors
test_bad_shapes_have_clear_errors()
qm = qg.prepare(matrix('Q8_0', 8, 64, 6))
ids = torch.tensor([8], dtype=torch.int64)
rows = torch.empty(1, 64)
assert lib.quant_dequant_rows(8, qm.data.data_ptr(), 8, 64, ids.data_ptr(), 1, rows.data_ptr(), 0, 1) == -3
""")


def test_moe_experts_call_keeps_float32_between_projections():
    """The fused MoE call on this family (csrc/moe_avx2.c: the small experts in one region of the int8 terms, the
    large ones through quant_linear; float32 between gate_up and down), experts of mixed types, groups below
    quant_tile_m rows (the two int8 terms, down's made from the float32 SwiGLU rows), above it (the float32 tile)
    and both in one call, against float64 over the dequantized experts: within 2e-4 of the output's norm, where
    rounding the SwiGLU output to bf16 alone (the expert-by-expert layer's path) costs ~1e-3."""
    _run("""
from tests.expert_groups import expert_groups
hidden, inter, experts = 256, 512, 4
kinds = [('Q8_0', 'Q4_K'), ('Q4_K', 'Q6_K'), ('Q4_1', 'Q8_0'), ('Q5_K', 'Q4_0'), ('Q5_0', 'Q5_1')]
gu = [qg.prepare(matrix(a, 2 * inter, hidden, 10 + e)) for e, (a, _) in enumerate(kinds)]
dn = [qg.prepare(matrix(b, hidden, inter, 20 + e)) for e, (_, b) in enumerate(kinds)]
deq_gu = [qg.dequantize(m).double() for m in gu]
deq_dn = [qg.dequantize(m).double() for m in dn]
g = torch.Generator().manual_seed(5)
for tokens in (1, 3, 40, 24):
    x = torch.randn(tokens, hidden, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(experts, generator=g)[:2] for _ in range(tokens)])
    if tokens == 24:  # expert 0 in every token (past quant_tile_m), the others below it: both kinds in one call
        others = torch.randint(1, experts, (tokens,), generator=g)
        ids = torch.stack([torch.zeros(tokens, dtype=torch.int64), others], 1)
    weights = torch.rand(tokens, 2, generator=g)
    order, counts, active, group_start = expert_groups(ids, experts)
    table = lambda ms: (torch.tensor([ms[e].qtype for e in active.tolist()], dtype=torch.int32),
                        torch.tensor([ms[e].data.data_ptr() for e in active.tolist()], dtype=torch.int64))
    got = qg.moe_experts(x.contiguous(), order // 2, weights.flatten().float().index_select(0, order).contiguous(),
                         group_start, table(gu), table(dn), inter).double()
    ref = torch.zeros(tokens, hidden, dtype=torch.float64)
    rounded = torch.zeros_like(ref)
    for t in range(tokens):
        for j in range(2):
            e = int(ids[t, j])
            h = deq_gu[e] @ x[t].double()
            act = torch.nn.functional.silu(h[:inter]) * h[inter:]
            ref[t] += float(weights[t, j]) * (deq_dn[e] @ act)
            rounded[t] += float(weights[t, j]) * (deq_dn[e] @ act.bfloat16().double())
    err = float((got - ref).norm() / ref.norm())
    assert err < 2e-4, (tokens, err, float((rounded - ref).norm() / ref.norm()))
    assert int(counts.max()) >= 16 or tokens < 24, 'a group at or past quant_tile_m rows'
    assert tokens != 24 or int(counts[1:].min()) < 16, 'and groups below it'
""")
