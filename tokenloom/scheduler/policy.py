"""Waiting-queue order (`--schedule-policy`): `fcfs` keeps arrival order; `lpm` puts the requests with the
longest cached prefix first (falling back to fcfs for long queues or without a radix cache, as SGLang does).

`lpm` also does SGLang's in-batch prefix caching: a request with at most IN_BATCH_CHECK_THRESHOLD cached
tokens whose first IN_BATCH_DEPRIORITIZE_THRESHOLD tokens equal those of an earlier waiting request (that
was not itself pushed back) goes to the end of the queue, so that requests sharing a prefix nobody has
cached yet do not all prefill it in one batch: the first warms the cache, the others then hit it.

Policies only reorder; admission re-matches each request it considers (the tree may have changed), and with
either policy skips, for this batch, a request whose `uncached_head` equals that of a request admitted in
the same batch or whose prefill is in flight (Scheduler._get_new_batch_prefill): the queue may be longer than
LPM_MAX_QUEUE, and fcfs does no reordering, yet requests sharing a prefix should still compute it once.
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
                        radix_enabled: bool, warming: set[tuple[int, ...]] | None = None) -> None:
    """Reorder `queue` in place (lpm matches every waiting request's prefix to learn its length). `warming`:
    `uncached_head`s of admitted requests whose prompt KV is not in the tree yet (a batch in flight)."""
    if policy == "fcfs" or not radix_enabled or len(queue) > LPM_MAX_QUEUE:
        return
    if policy == "lpm":
        for req in queue:
            req.init_next_round_input(match_prefix)
        pushed_back = in_batch_prefix_duplicates(queue, warming or set())
        queue.sort(key=lambda r: (id(r) in pushed_back, -r.prefix_len))  # stable: ties keep arrival order
        return
    raise ValueError(f"unknown schedule policy {policy!r}")


def uncached_head(req: Req) -> tuple[int, ...] | None:
    """The leading tokens by which in-batch prefix caching compares `req`, or None when it is not compared
    (enough of it is cached already, or it is too short to share the threshold)."""
    n = IN_BATCH_DEPRIORITIZE_THRESHOLD
    if req.prefix_len > IN_BATCH_CHECK_THRESHOLD or len(req.fill_ids) < n:
        return None
    return tuple(req.fill_ids[:n])


def in_batch_prefix_duplicates(queue: list[Req], warming: set[tuple[int, ...]]) -> set[int]:
    """ids of the requests to push back: little cached, and sharing their leading tokens with an earlier waiting
    request or with one whose prefill is in flight (`warming`). Two requests share at least
    IN_BATCH_DEPRIORITIZE_THRESHOLD leading tokens exactly when their first that-many tokens are equal, so a
    set of those prefixes answers it in one pass."""
    seen = set(warming)
    pushed_back: set[int] = set()
    for req in queue:
        head = uncached_head(req)
        if head is None:
            continue
        if head in seen:
            pushed_back.add(id(req))
        else:
            seen.add(head)
    return pushed_back
