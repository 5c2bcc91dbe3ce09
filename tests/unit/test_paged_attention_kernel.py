"""The native paged decode kernel against a plain torch reference (per request, per head), in float32 and
bfloat16, with GQA groups, ragged lengths and scattered slots."""

from __future__ import annotations

import pytest
import torch

from tokenloom.kernels import paged_attention

pytestmark = pytest.mark.skipif(not paged_attention.available(torch.float32, 4, 64),
                                reason="native kernels unavailable (no C compiler)")


def _reference(q, k, v, indptr, indices, scale):
    batch, num_heads, dim = q.shape
    num_kv = k.shape[0]
    group = num_heads // num_kv
    out = torch.zeros(batch, num_heads, dim)
    for b in range(batch):
        slots = indices[indptr[b]:indptr[b + 1]]
        for h in range(num_heads):
            keys = k[h // group, slots].float()
            vals = v[h // group, slots].float()
            p = torch.softmax(keys @ q[b, h].float() * scale, dim=0)
            out[b, h] = p @ vals
    return out.view(batch, -1)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("num_heads,num_kv", [(4, 4), (8, 2), (9, 3), (16, 1)])
def test_matches_reference(dtype, tol, num_heads, num_kv):
    g = torch.Generator().manual_seed(num_heads * 7 + num_kv)
    rows, dim, batch = 3000, 64, 6
    k = torch.randn(num_kv, rows, dim, generator=g).to(dtype)
    v = torch.randn(num_kv, rows, dim, generator=g).to(dtype)
    lens = torch.tensor([1, 7, 130, 33, 300, 2])
    indptr = torch.zeros(batch + 1, dtype=torch.int64)
    indptr[1:] = lens.cumsum(0)
    indices = torch.randperm(rows - 1, generator=g)[: int(indptr[-1])] + 1
    q = torch.randn(batch, num_heads, dim, generator=g).to(dtype)
    out = paged_attention.decode(q, k, v, indptr, indices, dim ** -0.5)
    ref = _reference(q, k, v, indptr, indices, dim ** -0.5)
    assert out.dtype == dtype and out.shape == (batch, num_heads * dim)
    assert (out.float() - ref).abs().max().item() < tol


def test_limits_reported():
    assert not paged_attention.available(torch.float32, 64, 64)
    assert not paged_attention.available(torch.float16, 4, 64)
