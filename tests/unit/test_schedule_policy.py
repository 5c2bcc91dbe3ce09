"""Waiting-queue policies: fcfs keeps arrival order; lpm sorts by cached prefix and pushes back requests that
share an uncached prefix with an earlier waiting request (SGLang's in-batch prefix caching)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from tokenloom.sampling.sampling_params import SamplingParams
from tokenloom.scheduler.policy import order_waiting_queue
from tokenloom.scheduler.req import Req


def _req(name: str, ids: list[int]) -> Req:
    return Req(name, ids, SamplingParams.from_dict({"max_new_tokens": 4}, 1000))


def _matcher(cached: dict[tuple[int, ...], int]):
    """A stand-in radix match: the longest listed prefix of the key counts as cached."""
    def match(key: list[int]):
        best = max((n for p, n in cached.items() if tuple(key[: len(p)]) == p), default=0)
        return SimpleNamespace(indices=torch.arange(best), last_node=None)
    return match


def test_fcfs_keeps_arrival_order():
    queue = [_req(str(i), [i] * 40) for i in range(4)]
    order_waiting_queue(queue, "fcfs", _matcher({}), radix_enabled=True)
    assert [r.rid for r in queue] == ["0", "1", "2", "3"]


def test_lpm_pushes_back_requests_sharing_an_uncached_prefix():
    shared = list(range(100, 140))  # 40 tokens nobody has cached
    a1, a2, a3 = (_req(f"a{i}", shared + [i, i + 1]) for i in range(3))
    b = _req("b", list(range(500, 540)))
    short = _req("short", list(range(100, 120)))  # 20 tokens: too short to share 32
    cached = _req("cached", list(range(900, 960)))  # 50 tokens cached: sorted first
    queue = [a1, a2, b, a3, short, cached]
    order_waiting_queue(queue, "lpm", _matcher({tuple(range(900, 950)): 50}), radix_enabled=True)
    assert [r.rid for r in queue] == ["cached", "a0", "b", "short", "a1", "a2"]


def test_lpm_does_not_push_back_requests_with_a_cached_prefix():
    shared = list(range(100, 180))
    first, second = _req("x", shared + [1]), _req("y", shared + [2])
    queue = [first, second]
    order_waiting_queue(queue, "lpm", _matcher({tuple(shared[:64]): 64}), radix_enabled=True)
    assert [r.rid for r in queue] == ["x", "y"]  # both hit the cache (> 32 tokens): nothing to warm


def test_lpm_pushes_back_behind_a_prefill_in_flight():
    """A request whose uncached prefix an admitted, not yet processed prefill is computing waits too."""
    shared = list(range(100, 140))
    member, other = _req("member", shared + [7]), _req("other", list(range(600, 650)))
    queue = [member, other]
    order_waiting_queue(queue, "lpm", _matcher({}), radix_enabled=True, warming={tuple(shared[:32])})
    assert [r.rid for r in queue] == ["other", "member"]
