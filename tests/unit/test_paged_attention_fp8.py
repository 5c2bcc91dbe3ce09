"""The native paged decode kernel over an fp8 KV pool (csrc/paged_attention_fp8.c) against float32 torch
attention over the same fp8 values widened by torch (tight: only float32 summation order differs), for e4m3
and e5m2, float32 and bf16 queries, GQA groups, head dims 64/128/other, chunked long requests, cascade
(shared prefixes) and the fused write of the new K/V rows, whose fp8 bytes must equal torch's cast (the bytes
`KVPool.set_kv` writes): checked over every bf16 value and random float32 values."""

from __future__ import annotations

import pytest
import torch

from tests.avx2_subprocess import has_avx2, run_avx2
from tokenloom.cache.kv_pool import to_kv_dtype
from tokenloom.kernels import paged_attention

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
pytestmark = pytest.mark.skipif(not paged_attention.available(torch.float8_e4m3fn, 4, 64),
                                reason="native kernels unavailable (no C compiler)")

# Against the reference over the same fp8 values: float32 queries differ only in summation order; bf16
# queries also round the output to bf16 (relative half-ulp 2^-9; the kernel's probabilities stay float32 here,
# as the reference's): |out - ref| <= REL * |ref| + ABS.
TOL = {torch.float32: (1e-5, 2e-5), torch.bfloat16: (2.0**-8, 1e-4)}


def _close(out, ref, act, scale=1.0):
    rel, abs_ = TOL[act]
    err = (out.float() - ref).abs() - rel * ref.abs()
    return err.max().item() <= abs_ * scale


def _reference(q, k, v, indptr, indices, scale):
    """float32 attention over the fp8 values; with bf16 queries at head_dim 64/128 the kernel's AVX512-BF16
    path (where the CPU has it) rounds the softmax numerators to bf16 before the weighted sum of V (as it does
    for a bf16 pool), and so does this reference."""
    batch, num_heads, dim = q.shape
    group = num_heads // k.shape[0]
    round_probs = q.dtype == torch.bfloat16 and dim in (64, 128) and paged_attention.rounds_probabilities(k.dtype)
    out = torch.zeros(batch, num_heads, dim)
    for b in range(batch):
        slots = indices[indptr[b]:indptr[b + 1]]
        for h in range(num_heads):
            keys, vals = k[h // group, slots].float(), v[h // group, slots].float()
            s = keys @ q[b, h].float() * scale
            e = torch.exp(s - s.max())
            weights = e.to(torch.bfloat16).float() if round_probs else e
            out[b, h] = weights @ vals / e.sum()
    return out.view(batch, -1)


def _case(act, kv, num_heads, num_kv, dim, lens, seed, rows=None):
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor(lens)
    rows = rows or int(lens.sum()) + 64
    # magnitudes spanning the formats' subnormals to e4m3's saturation
    k = to_kv_dtype(torch.randn(num_kv, rows, dim, generator=g) * 4, kv)
    v = to_kv_dtype(torch.randn(num_kv, rows, dim, generator=g) * 3, kv)
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int64)
    indptr[1:] = lens.cumsum(0)
    indices = torch.randperm(rows - 1, generator=g)[: int(indptr[-1])] + 1
    q = torch.randn(len(lens), num_heads, dim, generator=g).to(act) * 0.5
    return q, k, v, indptr, indices


def test_fp8_cast_matches_torch_on_every_bf16_value_and_saturates():
    every_bf16 = torch.arange(2**16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    every_bf16 = every_bf16[~torch.isnan(every_bf16)]
    rand = torch.randn(200_000) * torch.logspace(-12, 6, 200_000)
    for kv in FP8:
        for x in (every_bf16, rand):
            mine = paged_attention.fp8_encode(x, kv)
            assert torch.equal(mine.view(torch.uint8), to_kv_dtype(x, kv).view(torch.uint8)), kv
        limit = torch.finfo(kv).max
        big = paged_attention.fp8_encode(torch.tensor([1e9, -1e9, float("inf"), -float("inf")]), kv).float()
        assert big.tolist() == [limit, -limit, limit, -limit]


@pytest.mark.parametrize("kv", FP8)
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv,dim", [(9, 3, 64), (8, 2, 128), (4, 4, 48), (16, 1, 64)])
def test_matches_torch_over_the_same_fp8_values(kv, act, num_heads, num_kv, dim):
    q, k, v, indptr, indices = _case(act, kv, num_heads, num_kv, dim, [1, 7, 130, 33, 200, 2, 16],
                                     num_heads + dim)
    out = paged_attention.decode(q, k, v, indptr, indices, dim ** -0.5)
    ref = _reference(q, k, v, indptr, indices, dim ** -0.5)
    assert out.dtype == act and out.shape == (q.shape[0], num_heads * dim)
    assert _close(out, ref, act)


@pytest.mark.parametrize("kv", FP8)
def test_long_requests_chunks_and_shared_prefixes(kv):
    """Chunked work items and a cascade plan over fp8 rows give the per-request reference."""
    previous = torch.get_num_threads()
    torch.set_num_threads(max(2, previous))
    try:
        q, k, v, indptr, indices = _case(torch.bfloat16, kv, 9, 3, 64, [3000, 700], 5)
        out = paged_attention.decode(q, k, v, indptr, indices, 0.125)
        # (chunks and pieces round their probabilities against their own maximum: a looser absolute bound)
        assert _close(out, _reference(q, k, v, indptr, indices, 0.125), torch.bfloat16, scale=40)
        # three requests sharing their first 200 slots
        g = torch.Generator().manual_seed(3)
        prefix = torch.randperm(k.shape[1] - 1, generator=g)[:260] + 1
        lists = [prefix[:200], torch.cat([prefix[:200], prefix[200:230]]), prefix]
        indptr = torch.tensor([0, 200, 430, 690])
        indices = torch.cat(lists)
        q = torch.randn(3, 9, 64, generator=g).to(torch.bfloat16)
        plan = paged_attention.plan_shared_prefixes(indptr, indices, 3)
        assert plan is not None
        out = paged_attention.decode(q, k, v, indptr, indices, 0.125, shared=plan)
    finally:
        torch.set_num_threads(previous)
    assert _close(out, _reference(q, k, v, indptr, indices, 0.125), torch.bfloat16, scale=40)


@pytest.mark.parametrize("kv", FP8)
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
def test_fused_kv_write_stores_torchs_fp8_cast(kv, act):
    num_heads, num_kv, dim = 9, 3, 64
    q0, k, v, indptr, indices = _case(act, kv, num_heads, num_kv, dim, [5, 40, 1, 77], 11)
    batch = q0.shape[0]
    # K and V new rows scaled so that some pass e4m3's 448; the queries stay near 1 (at |q| ~ 100 the scores reach
    # ~1e4 and their float32 rounding, summed in another order than the reference's, moved the softmax past the
    # tolerance for about 1 draw in 100)
    g = torch.Generator().manual_seed(12)
    packed = torch.randn(batch, (num_heads + 2 * num_kv) * dim, generator=g) * 100
    packed[:, : num_heads * dim] /= 100
    packed = packed.to(act)
    q = packed[:, : num_heads * dim].view(batch, num_heads, dim)
    k_new = packed[:, num_heads * dim: (num_heads + num_kv) * dim].view(batch, num_kv, dim)
    v_new = packed[:, (num_heads + num_kv) * dim:].view(batch, num_kv, dim)
    out_loc = indices[indptr[1:] - 1]  # each request's last slot is its new token
    k_ref, v_ref = k.clone(), v.clone()
    k_ref.view(torch.uint8)[:, out_loc] = to_kv_dtype(k_new.transpose(0, 1), kv).view(torch.uint8)
    v_ref.view(torch.uint8)[:, out_loc] = to_kv_dtype(v_new.transpose(0, 1), kv).view(torch.uint8)
    out = paged_attention.decode(q, k, v, indptr, indices, 0.125, k_new=k_new, v_new=v_new, out_loc=out_loc)
    assert torch.equal(k.view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(v.view(torch.uint8), v_ref.view(torch.uint8))
    ref = _reference(q, k_ref, v_ref, indptr, indices, 0.125)
    assert _close(out, ref, act, scale=100)  # |V| up to 448 here


@pytest.mark.skipif(not has_avx2(), reason="the CPU has no AVX2/FMA/F16C")
def test_avx2_build_matches_reference():
    """The AVX2 path over fp8 rows (CPUs without AVX-512: rows widened 8 at a time through F16C, e4m3's 2^-8
    folded into the query scale and the sums), e4m3 and e5m2, against the same reference: this file's reference
    tests in a process whose kernels are built for AVX2 (on an AVX2-only CPU they are the tests above)."""
    run_avx2("import pytest\n"
             "assert pytest.main(['-q', '-p', 'no:cacheprovider', 'tests/unit/test_paged_attention_fp8.py', '-k', "
             "'matches_torch or chunks_and_shared or fused_kv_write']) == 0")
