"""Cascade (shared-prefix) decode: `plan_shared_prefixes` groups requests whose KV index lists begin with
the same slots, and the paged kernel given that plan (each shared prefix read once for the whole group, then
merged with each request's own suffix) matches the plain per-request torch reference and the kernel
without a plan, in float32 and bfloat16, for GQA groups 1, 3 and 4, head dims 64/128/48, with the fused write
of the step's new K/V rows, groups split because their query rows exceed the kernel's limit, and requests
whose whole list is the shared prefix."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_paged_attention_kernel import TOL, _reference
from tokenloom.kernels import paged_attention

pytestmark = pytest.mark.skipif(not paged_attention.available(torch.float32, 4, 64),
                                reason="native kernels unavailable (no C compiler)")


def _shared_case(dtype, num_heads, num_kv, dim, prefixes, seed):
    """`prefixes`: per request (prefix id or None, prefix length, own length); requests with the same prefix
    id start with the same slots (the longest length given for that id is materialized)."""
    g = torch.Generator().manual_seed(seed)
    longest: dict[int, int] = {}
    for pid, plen, _ in prefixes:
        if pid is not None:
            longest[pid] = max(longest.get(pid, 0), plen)
    own_total = sum(own for _, _, own in prefixes) + sum(plen for pid, plen, _ in prefixes if pid is None)
    rows = sum(longest.values()) + own_total + 64
    perm = (torch.randperm(rows - 1, generator=g) + 1).tolist()
    prefix_slots = {pid: [perm.pop() for _ in range(n)] for pid, n in longest.items()}
    lists = []
    for pid, plen, own in prefixes:
        head = prefix_slots[pid][:plen] if pid is not None else [perm.pop() for _ in range(plen)]
        lists.append(head + [perm.pop() for _ in range(own)])
    indptr = torch.tensor([0] + [len(x) for x in lists]).cumsum(0)
    indices = torch.tensor([s for x in lists for s in x], dtype=torch.int64)
    k = torch.randn(num_kv, rows, dim, generator=g).to(dtype)
    v = torch.randn(num_kv, rows, dim, generator=g).to(dtype)
    q = torch.randn(len(prefixes), num_heads, dim, generator=g).to(dtype)
    return q, k, v, indptr, indices


def _groups(plan):
    ptr = plan.group_ptr[: plan.groups + 1].tolist()
    members = plan.members.tolist()
    return [sorted(members[ptr[i]:ptr[i + 1]]) for i in range(plan.groups)]


def test_plan_groups_requests_by_shared_leading_slots():
    # requests 0, 2, 3 share 100 slots (3 shares only 60 of them); 1 and 4 share 20 (< 32: not grouped)
    spec = [(0, 100, 5), (1, 20, 50), (0, 100, 0), (0, 60, 9), (1, 20, 3), (None, 80, 0)]
    _, _, _, indptr, indices = _shared_case(torch.float32, 3, 3, 64, spec, 0)
    plan = paged_attention.plan_shared_prefixes(indptr, indices, group=1)
    assert plan is not None and _groups(plan) == [[0, 2, 3]]
    assert plan.share_len.tolist() == [60, 0, 60, 60, 0, 0]


def test_plan_splits_groups_whose_queries_exceed_the_row_limit():
    spec = [(0, 64, i) for i in range(7)]  # 7 requests, GQA group 3: at most 16 // 3 = 5 per item
    _, _, _, indptr, indices = _shared_case(torch.float32, 9, 3, 64, spec, 1)
    plan = paged_attention.plan_shared_prefixes(indptr, indices, group=3)
    assert sorted(len(m) for m in _groups(plan)) == [3, 4]  # balanced, every request in one group
    assert sorted(sum(_groups(plan), [])) == list(range(7))
    assert paged_attention.plan_shared_prefixes(indptr, indices, group=16) is None  # one request per item
    assert paged_attention.plan_shared_prefixes(indptr[:2], indices, group=1) is None  # a single request


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv", [(4, 4), (9, 3), (16, 4)])
@pytest.mark.parametrize("dim", [64, 128, 48])
def test_cascade_matches_reference(dtype, num_heads, num_kv, dim):
    spec = [(0, 300, 17), (1, 40, 1), (0, 300, 0), (None, 33, 0), (0, 250, 70), (1, 40, 40), (0, 300, 2),
            (0, 300, 5), (0, 300, 6), (2, 700, 3), (2, 700, 900)]
    q, k, v, indptr, indices = _shared_case(dtype, num_heads, num_kv, dim, spec, num_heads + dim)
    plan = paged_attention.plan_shared_prefixes(indptr, indices, num_heads // num_kv)
    assert plan is not None and plan.groups >= 3
    previous = torch.get_num_threads()
    torch.set_num_threads(max(2, previous))  # so long suffixes are also split into chunks
    try:
        shared = paged_attention.decode(q, k, v, indptr, indices, dim ** -0.5, shared=plan)
        alone = paged_attention.decode(q, k, v, indptr, indices, dim ** -0.5)
    finally:
        torch.set_num_threads(previous)
    ref = _reference(q, k, v, indptr, indices, dim ** -0.5)
    assert (shared.float() - ref).abs().max().item() < TOL[dtype]
    assert (shared.float() - alone.float()).abs().max().item() < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cascade_with_fused_kv_write(dtype):
    """The step's new K/V rows (each request's last slot, outside the shared prefix) are written first."""
    num_heads, num_kv, dim = 9, 3, 64
    spec = [(0, 128, 4), (0, 128, 1), (0, 128, 9), (None, 50, 0)]
    q, k, v, indptr, indices = _shared_case(dtype, num_heads, num_kv, dim, spec, 3)
    k_new = torch.randn(4, num_kv, dim).to(dtype)
    v_new = torch.randn(4, num_kv, dim).to(dtype)
    out_loc = indices[indptr[1:] - 1]
    plan = paged_attention.plan_shared_prefixes(indptr, indices, 3)
    k_ref, v_ref = k.clone(), v.clone()
    out = paged_attention.decode(q, k, v, indptr, indices, 0.125, k_new=k_new, v_new=v_new, out_loc=out_loc,
                                 shared=plan)
    k_ref[:, out_loc] = k_new.transpose(0, 1)
    v_ref[:, out_loc] = v_new.transpose(0, 1)
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
    ref = _reference(q, k_ref, v_ref, indptr, indices, 0.125)
    assert (out.float() - ref).abs().max().item() < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cascade_with_long_suffixes_split_into_chunks(dtype):
    """Two requests, one kv head: too few (request, kv head) pairs, so each suffix is split across threads
    and merged with the shared prefix's state."""
    spec = [(0, 600, 1200), (0, 600, 5)]
    q, k, v, indptr, indices = _shared_case(dtype, 4, 1, 64, spec, 9)
    plan = paged_attention.plan_shared_prefixes(indptr, indices, 4)
    assert plan is not None and plan.share_len.tolist() == [600, 600]
    previous = torch.get_num_threads()
    torch.set_num_threads(max(2, previous))
    try:
        out = paged_attention.decode(q, k, v, indptr, indices, 0.125, shared=plan)
    finally:
        torch.set_num_threads(previous)
    ref = _reference(q, k, v, indptr, indices, 0.125)
    assert (out.float() - ref).abs().max().item() < TOL[dtype]
