"""How the scheduler ranks of one TP group stay in lockstep: the same inputs, in the same order, on every rank.

Every TP rank runs a full `Scheduler` over its own shard's `KVMemory`. Scheduling is deterministic given
the messages handled and the results processed (the prefix cache orders by a logical clock, retraction and
admission read only pool sizes, which are identical after the start-up MIN-reduce), and every rank samples
the same tokens (see entrypoints/scheduler_process.py). So the ranks only have to agree on the inputs:

- `BroadcastInbox`: each loop iteration the entry rank drains its ZMQ socket and broadcasts the list (even
  when empty) to its TP group; the other ranks have no socket and take the entry's list. Every rank calls it
  once per iteration, so the broadcasts pair up by construction.
- `BroadcastOverlap`: the adaptive overlap policy measures timings, which differ per rank; TP rank 0's
  choice is broadcast at every decision point (`overlap_now`), and the other ranks follow it.

Both run on the scheduling thread over `tp_cpu_group` (`distributed/comm.py`); the forward thread's
all-reduces use the compute group, so the two streams of collectives never interleave on one group.
"""

from __future__ import annotations

from typing import Any, Protocol

from tokenloom.distributed.comm import broadcast_pyobj
from tokenloom.distributed.parallel_state import ParallelContext
from tokenloom.scheduler.step_profile import StepTiming


class _Inbox(Protocol):
    def recv_all(self, timeout_ms: int = 0) -> list[Any]: ...


class _Policy(Protocol):
    def overlap_now(self) -> bool: ...

    def record(self, timing: StepTiming) -> None: ...

    def info(self) -> dict: ...


class BroadcastInbox:
    """The entry rank's inbox, shared with its TP group: `recv_all` returns the same list on every rank."""

    def __init__(self, inbox: _Inbox | None, ctx: ParallelContext) -> None:
        if (inbox is None) == ctx.is_entry:
            raise ValueError("exactly the entry rank (tp 0, pp 0) has an inbox")
        self.inbox = inbox
        self.ctx = ctx

    def recv_all(self, timeout_ms: int = 0) -> list[Any]:
        # Only the entry rank waits on its socket; the others wait in the broadcast for as long.
        messages = self.inbox.recv_all(timeout_ms) if self.inbox is not None else None
        return broadcast_pyobj(messages, self.ctx)


class BroadcastOverlap:
    """An overlap policy whose every decision is TP rank 0's (each rank still records its own timings)."""

    def __init__(self, policy: _Policy, ctx: ParallelContext) -> None:
        self.policy = policy
        self.ctx = ctx

    def overlap_now(self) -> bool:
        mine = self.policy.overlap_now() if self.ctx.tp_rank == 0 else None
        return bool(broadcast_pyobj(mine, self.ctx))

    def record(self, timing: StepTiming) -> None:
        self.policy.record(timing)

    def info(self) -> dict:
        return self.policy.info()


def discard(_obj: Any) -> None:
    """The output sink of a non-entry rank: the entry rank alone streams outputs to the detokenizer."""
