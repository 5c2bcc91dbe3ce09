"""The native paged extend (prefill) attention kernel against a float32 torch reference (per request, causal
over its prefix and its new tokens): GQA groups 1-16, head_dim 64 and 128, ragged prefixes and new-token
counts (one token, read in place through the decode path; tiles of 16 and their remainders; key chunks of 512
crossed), scattered slots, a strided (packed qkv) query, soft-capped scores, and each of the kernel's
arithmetic paths (AVX512-BF16 dot products, float32 FMAs) where this CPU has it."""

from __future__ import annotations

import pytest
import torch

from tokenloom.kernels import extend_attention

pytestmark = pytest.mark.skipif(not extend_attention.available(torch.bfloat16, 3, 64),
                                reason="native extend attention unavailable (no compiler or no AVX-512)")


def _reference(q, k, v, indptr, indices, starts, lens, scale, cap=0.0):
    tokens, num_heads, dim = q.shape
    group = num_heads // k.shape[0]
    out = torch.zeros(tokens, num_heads, dim)
    for b in range(lens.numel()):
        slots = indices[indptr[b]:indptr[b + 1]]
        new, total = int(lens[b]), slots.numel()
        keys = k[:, slots].float().repeat_interleave(group, 0)  # [Hq, total, D]
        vals = v[:, slots].float().repeat_interleave(group, 0)
        rows = q[starts[b]:starts[b] + new].float().transpose(0, 1)  # [Hq, new, D]
        scores = rows @ keys.transpose(1, 2) * scale
        if cap:
            scores = cap * torch.tanh(scores / cap)
        seen = torch.arange(total)[None, :] <= (total - new + torch.arange(new))[:, None]
        probs = torch.softmax(scores.masked_fill(~seen, float("-inf")), dim=-1)
        out[starts[b]:starts[b] + new] = (probs @ vals).transpose(0, 1)
    return out.view(tokens, -1)


def _case(num_heads, num_kv, dim, requests, seed, cap=0.0, packed=False):
    """requests: (prefix, new) per request. Returns (kernel output, reference) as float32."""
    g = torch.Generator().manual_seed(seed)
    rows = sum(p + n for p, n in requests) + 40
    k = torch.randn(num_kv, rows, dim, generator=g).bfloat16()
    v = torch.randn(num_kv, rows, dim, generator=g).bfloat16()
    order = torch.randperm(rows, generator=g)
    indptr, starts, lens = [0], [], []
    for prefix, new in requests:
        indptr.append(indptr[-1] + prefix + new)
        starts.append(sum(lens))
        lens.append(new)
    indices = order[:indptr[-1]]
    tokens = sum(lens)
    if packed:  # q as a view into a [T, (Hq + 2 Hkv) D] qkv tensor: heads contiguous, rows strided
        qkv = torch.randn(tokens, (num_heads + 2 * num_kv) * dim, generator=g).bfloat16()
        q = qkv[:, :num_heads * dim].view(tokens, num_heads, dim)
    else:
        q = torch.randn(tokens, num_heads, dim, generator=g).bfloat16()
    args = (q, k, v, torch.tensor(indptr), indices, torch.tensor(starts), torch.tensor(lens), dim ** -0.5)
    return extend_attention.extend(*args, logit_cap=cap).float(), _reference(*args, cap=cap)


def _paths():
    """The arithmetic paths this CPU has (setting one it lacks reads back the other)."""
    have = []
    for p in (1, 2):
        if extend_attention.path(p) == p:
            have.append(p)
    extend_attention.path(0)
    return have


@pytest.fixture(params=[1, 2], ids=["dpbf16", "fma"])
def arithmetic(request):
    if request.param not in _paths():
        pytest.skip("this CPU has no such path")
    extend_attention.path(request.param)
    yield request.param
    extend_attention.path(0)


CASES = [
    (9, 3, 64, [(0, 37), (5, 1), (100, 20), (0, 256)]),  # SmolLM2's heads: plain prefill, one token, prefix
    (9, 3, 64, [(600, 700)]),  # chunks of 512 keys crossed, prefix and new tokens alike
    (8, 2, 128, [(0, 33), (1030, 3)]),
    (4, 4, 64, [(0, 17), (16, 16)]),  # no GQA
    (16, 1, 128, [(3, 40)]),  # 16 query heads on one KV head
    (12, 4, 64, [(1, 1), (0, 2), (31, 15)]),
]


@pytest.mark.parametrize("num_heads,num_kv,dim,requests", CASES)
def test_matches_reference(arithmetic, num_heads, num_kv, dim, requests):
    out, ref = _case(num_heads, num_kv, dim, requests, seed=len(requests) + dim)
    err = (out - ref).abs()
    # bf16 output (half an ulp: 2^-9 relative) and, on the dot-product path, bf16 probabilities
    assert err.max().item() < 2e-2 and err.mean().item() < 2e-3, (err.max().item(), err.mean().item())


def test_soft_cap_and_packed_query(arithmetic):
    out, ref = _case(9, 3, 64, [(20, 30), (0, 9), (7, 1)], seed=5, cap=4.0, packed=True)
    assert (out - ref).abs().max().item() < 2e-2
    uncapped, _ = _case(9, 3, 64, [(20, 30), (0, 9), (7, 1)], seed=5, packed=True)
    assert (uncapped - ref).abs().max().item() > 5e-2  # the cap is applied, not ignored


def test_future_keys_are_not_seen(arithmetic):
    """Keys after a token's position carry huge values: a token that saw one would be far off."""
    g = torch.Generator().manual_seed(3)
    num_kv, dim, new = 1, 64, 24
    k = torch.randn(num_kv, new, dim, generator=g).bfloat16()
    v = torch.zeros(num_kv, new, dim).bfloat16()
    v[0, :, 0] = torch.arange(new).float().bfloat16() * 1000  # value = 1000 x position
    q = torch.randn(new, 1, dim, generator=g).bfloat16()
    out = extend_attention.extend(q, k, v, torch.tensor([0, new]), torch.arange(new), torch.tensor([0]),
                                  torch.tensor([new]), 0.125).float()
    assert (out[:, 0] <= torch.arange(new).float() * 1000 * 1.01 + 1).all()  # a weighted mean of positions <= its own
    assert out[0, 0].item() == 0.0


def test_bad_arguments_are_refused():
    q = torch.zeros(2, 3, 64).bfloat16()
    k = torch.zeros(1, 4, 64).bfloat16()
    args = (q, k, k, torch.tensor([0, 2]), torch.arange(2), torch.tensor([0]), torch.tensor([2]), 0.125)
    with pytest.raises(ValueError, match="logit_cap"):
        extend_attention.extend(*args, logit_cap=float("nan"))
    with pytest.raises(ValueError, match="bf16 KV pool"):
        extend_attention.extend(q, k.float(), k.float(), *args[3:])
    with pytest.raises(ValueError, match="kv_indptr"):
        extend_attention.extend(q, k, k, torch.tensor([0]), *args[4:])
    with pytest.raises(ValueError, match="head_dim 48"):
        extend_attention.extend(torch.zeros(2, 3, 48).bfloat16(), torch.zeros(1, 4, 48).bfloat16(),
                                torch.zeros(1, 4, 48).bfloat16(), *args[3:])
    assert not extend_attention.available(torch.float32, 3, 64)
    assert not extend_attention.available(torch.bfloat16, 3, 96)
