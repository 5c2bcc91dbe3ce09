"""Waiting-queue order (`--schedule-policy`): `fcfs` keeps arrival order; `lpm` puts the requests with the
longest cached prefix first (falling back to fcfs for long queues or without a radix cache, as SGLang does).

`lpm` also does SGLang's in-batch prefix caching: a request with at most IN_BATCH_CHECK_THRESHOLD cached
tokens whose first IN_BATCH_DEPRIORITIZE_THRESHOLD tokens equal those of an earlier waiting request (that
was not itself pushed back) goes to the end of the queue, so that requests sharing a prefix nobody has
cached yet do not all prefill it in one batch: the first warms the cache, the others then hit it.

Policies only reorder; admission re-matches each request it considers (the tree may have changed).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tokenloom.scheduler.req import Req

POLICIES = ("fcfs", "lpm")
LPM_MAX_QUEUE = 128  # beyond this, matching every waiting request each step costs more than it saves
IN_BATCH_CHECK_THRESHOLD = 32  # requests with a longer cached prefix are never pushed back
IN_BATCH_DEPRIORITIZE_THRESHOLD = 32  # leading tokens two waiting requests must share


def order_waiting_queue(queue: list[Req], policy: str, match_prefix: Callable[[list[int]], Any],
                        radix_enabled: bool) -> None:
    """Reorder `queue` in place (lpm matches every waiting request's prefix to learn its length)."""
    if policy == "fcfs" or not radix_enabled or len(queue) > LPM_MAX_QUEUE:
        return
    if policy == "lpm":
        for req in queue:
            req.init_next_round_input(match_prefix)
        pushed_back = in_batch_prefix_duplicates(queue)
        queue.sort(key=lambda r: (id(r) in pushed_back, -r.prefix_len))  # stable: ties keep arrival order
        return
    raise ValueError(f"unknown schedule policy {policy!r}")


def in_batch_prefix_duplicates(queue: list[Req]) -> set[int]:
    """ids of the requests to push back: little cached, and sharing their leading tokens with an earlier waiting
    request. Two requests share at least IN_BATCH_DEPRIORITIZE_THRESHOLD leading tokens exactly when their
    first that-many tokens are equal, so a set of those prefixes answers it in one pass."""
    n = IN_BATCH_DEPRIORITIZE_THRESHOLD
    seen: set[tuple[int, ...]] = set()
    pushed_back: set[int] = set()
    for req in queue:
        if req.prefix_len > IN_BATCH_CHECK_THRESHOLD or len(req.fill_ids) < n:
            continue
        head = tuple(req.fill_ids[:n])
        if head in seen:
            pushed_back.add(id(req))
        else:
            seen.add(head)
    return pushed_back
