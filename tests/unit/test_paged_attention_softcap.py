"""Soft-capped scores in the native paged decode kernel (Gemma 2's `attn_logit_softcapping`: every scaled score
s = q.k * scale becomes cap * tanh(s / cap) before the softmax) against a float64 torch reference in the order
transformers' Gemma2 eager attention uses (scale, cap, mask, softmax), with the cap binding (q/k scaled up so
the scores spread to several times the cap: tanh saturates for most, not all, of them). Covered: float32 and
bfloat16 over a bf16/f32 pool, GQA groups, head dims 64 (AMX for bf16 where present), 128 (AVX512-BF16 dot
products), 256 (Gemma 2's, scalar path) and 48 (scalar), long requests split into chunks, a cascade plan
(the shared prefix's scores are capped too), the fused K/V write, fp8 pools (long enough for the bf16 path's
512-row pieces), and a bad cap refused."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_cascade_attention import _shared_case
from tests.unit.test_paged_attention_kernel import TOL, _case
from tokenloom.cache.kv_pool import to_kv_dtype
from tokenloom.kernels import paged_attention

pytestmark = pytest.mark.skipif(not paged_attention.available(torch.float32, 4, 64),
                                reason="native kernels unavailable (no C compiler)")

CAP = 10.0  # scores below spread with a standard deviation of ~25: most saturate


def _reference(q, k, v, indptr, indices, scale, cap):
    """float64 attention per request and head: scale, soft-cap (0: none), softmax, weighted sum of V."""
    batch, num_heads, dim = q.shape
    group = num_heads // k.shape[0]
    out = torch.zeros(batch, num_heads, dim, dtype=torch.float64)
    for b in range(batch):
        slots = indices[indptr[b]:indptr[b + 1]]
        for h in range(num_heads):
            keys, vals = k[h // group, slots].double(), v[h // group, slots].double()
            s = keys @ q[b, h].double() * scale
            if cap:
                s = torch.tanh(s / cap) * cap
            out[b, h] = torch.softmax(s, dim=0) @ vals
    return out.view(batch, -1)


def _spread(q, k):
    """q and k scaled so that the scaled scores spread far past CAP (std ~ 25 at scale dim ** -0.5)."""
    return (q.float() * 5).to(q.dtype), (k.float() * 5).to(k.dtype)


def _check(out, q, k, v, indptr, indices, scale, dtype):
    ref = _reference(q, k, v, indptr, indices, scale, CAP)
    assert (out.double() - ref).abs().max().item() < TOL[dtype]
    # the cap binds: without it the answer is far
    assert (out.double() - _reference(q, k, v, indptr, indices, scale, 0.0)).abs().max().item() > 0.3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv", [(4, 4), (8, 2), (16, 1)])
@pytest.mark.parametrize("dim", [64, 128, 256, 48])
def test_capped_decode_matches_reference(dtype, num_heads, num_kv, dim):
    q, k, v, indptr, indices = _case(dtype, num_heads, num_kv, dim, [1, 7, 130, 33, 300, 2], num_heads + dim)
    q, k = _spread(q, k)
    out = paged_attention.decode(q, k, v, indptr, indices, dim ** -0.5, logit_cap=CAP)
    assert out.dtype == dtype
    _check(out, q, k, v, indptr, indices, dim ** -0.5, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_capped_chunks_cascade_and_fused_write(dtype):
    """Long suffixes split into chunks, a shared prefix attended once for its group, the new K/V rows written
    first: all capped."""
    spec = [(0, 300, 900), (0, 300, 5), (0, 300, 0), (None, 40, 0), (0, 250, 70)]
    num_heads, num_kv, dim = 9, 3, 64
    q, k, v, indptr, indices = _shared_case(dtype, num_heads, num_kv, dim, spec, 4)
    q, k = _spread(q, k)
    k_new = (torch.randn(len(spec), num_kv, dim) * 5).to(dtype)
    v_new = torch.randn(len(spec), num_kv, dim).to(dtype)
    out_loc = indices[indptr[1:] - 1]
    plan = paged_attention.plan_shared_prefixes(indptr, indices, num_heads // num_kv)
    assert plan is not None and plan.share_len.tolist() == [250, 250, 250, 0, 250]
    previous = torch.get_num_threads()
    torch.set_num_threads(max(2, previous))  # so the long suffix is also split into chunks
    try:
        shared = paged_attention.decode(q, k, v, indptr, indices, dim ** -0.5, k_new=k_new, v_new=v_new,
                                        out_loc=out_loc, shared=plan, logit_cap=CAP)
        alone = paged_attention.decode(q, k, v, indptr, indices, dim ** -0.5, logit_cap=CAP)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(k[:, out_loc], k_new.transpose(0, 1))
    _check(shared, q, k, v, indptr, indices, dim ** -0.5, dtype)
    assert (shared.double() - alone.double()).abs().max().item() < TOL[dtype]


@pytest.mark.parametrize("kv", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
def test_capped_fp8_pool(kv, act):
    """fp8 pools share the score code: capped against the reference over the same fp8 values (one request
    past 512 rows, the bf16 path's piece size, so capped pieces are merged)."""
    q, k, v, indptr, indices = _case(act, 8, 2, 128, [700, 9, 60], 7)
    q, k = _spread(q, k)
    k, v = to_kv_dtype(k, kv), to_kv_dtype(v, kv)
    out = paged_attention.decode(q, k, v, indptr, indices, 128 ** -0.5, logit_cap=CAP)
    assert out.dtype == act
    _check(out, q, k, v, indptr, indices, 128 ** -0.5, act)


@pytest.mark.parametrize("cap", [-1.0, float("nan"), float("inf")])
def test_bad_cap_refused(cap):
    q, k, v, indptr, indices = _case(torch.float32, 4, 2, 64, [3], 1)
    with pytest.raises(ValueError, match="logit_cap"):
        paged_attention.decode(q, k, v, indptr, indices, 0.125, logit_cap=cap)
