"""Waiting-queue order (`--schedule-policy`): `fcfs` keeps arrival order; `lpm` puts the requests with the
longest cached prefix first (falling back to fcfs for long queues or without a radix cache, as SGLang does).

Policies only reorder; admission re-matches each request it considers (the tree may have changed).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tokenloom.scheduler.req import Req

POLICIES = ("fcfs", "lpm")
LPM_MAX_QUEUE = 128  # beyond this, matching every waiting request each step costs more than it saves


def order_waiting_queue(queue: list[Req], policy: str, match_prefix: Callable[[list[int]], Any],
                        radix_enabled: bool) -> None:
    """Reorder `queue` in place (lpm matches every waiting request's prefix to learn its length)."""
    if policy == "fcfs" or not radix_enabled or len(queue) > LPM_MAX_QUEUE:
        return
    if policy == "lpm":
        for req in queue:
            req.init_next_round_input(match_prefix)
        queue.sort(key=lambda r: -r.prefix_len)  # stable: ties keep arrival order
        return
    raise ValueError(f"unknown schedule policy {policy!r}")
