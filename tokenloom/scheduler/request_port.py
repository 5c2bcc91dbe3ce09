"""`RequestPort`: what changes how requests enter and leave a `Scheduler`, and `UnifiedPort`, the port of a
unified server (every request is prefilled and decoded here; every hook does nothing).

A prefill or decode server of prefill/decode disaggregation plugs its side in here
(disaggregation/prefill.py, decode.py): it takes the requests that carry a bootstrap room into its own queues
and hands them to the scheduler through the scheduler's public operations (`queue_prefill`, `reserve_kv`,
`apply_token`, `start_running`, ...); the scheduler tells it, through the hooks below, what it needs to know.
The scheduler always has a port (`Scheduler.port`, `UnifiedPort` unless `set_port` replaced it), so it never
asks which kind of server it is.

Every hook runs on the scheduler's thread, at points that every TP rank reaches at the same iteration over the
same messages, so a port's decisions are as deterministic as the scheduler's. A hook may change the port's own
state and call the scheduler's public operations, except where its docstring says otherwise; it never blocks
on the network (a port's I/O runs on its own threads).
"""

from __future__ import annotations

from typing import Any, Protocol

from tokenloom.protocol import TransferEvent
from tokenloom.scheduler.lane import Lane
from tokenloom.scheduler.req import Req
from tokenloom.scheduler.schedule_batch import ScheduleBatch


class RequestPort(Protocol):
    # --- requests in -------------------------------------------------------------------------------------
    def take(self, req: Req) -> bool:
        """Called by `Scheduler.add_request` for every new request, once the scheduler checked it. A request
        the scheduler refused arrives finished and answered: the port may only tell whoever else waits for it
        (a disaggregated request's other half) and returns False. Otherwise True when the port takes the
        request into its own keeping (it hands it to the scheduler later, or answers it itself); False leaves
        it to the scheduler's waiting queue."""
        ...

    def num_queued(self) -> int:
        """Requests the port holds that wait to be admitted; they count against --max-queued-requests."""
        ...

    def on_event(self, event: TransferEvent) -> None:
        """A `TransferEvent` reached the scheduler's inbox (from the port's own threads, through the entry
        rank's inbox, so every rank sees it at the same iteration)."""
        ...

    def abort(self, rid: str, message: str) -> bool:
        """Abort `rid`, which the scheduler holds nowhere (no queue, lane or launched batch): True if the port
        held it (and ended it: freed what it held, answered it)."""
        ...

    # --- scheduling ----------------------------------------------------------------------------------------
    def before_schedule(self, lane: Lane) -> None:
        """Called before the scheduler plans `lane`'s next batch: the port may hand requests over now
        (`queue_prefill`, `start_running`)."""
        ...

    def after_prefill(self, batch: ScheduleBatch) -> None:
        """Called once a prefill batch's results were applied (its requests took their first token, or a
        chunk of their prompt was computed). The port may read the requests' KV slots (`request_slots`)."""
        ...

    def retract(self, req: Req) -> bool:
        """The scheduler is retracting `req` (out of every lane already) to free KV for a decode step: True if
        the port takes it (keeping its KV elsewhere and freeing its slots with `free_kv`; it later resumes it
        with `reserve_kv` + `start_running`); False: the scheduler frees its KV and re-queues it for
        recompute, as on a unified server."""
        ...

    # --- KV the port reads -------------------------------------------------------------------------------------
    def holds_kv(self, req: Req) -> bool:
        """Whether something the port started (a KV transfer) may read `req`'s KV: the scheduler then neither
        frees it nor answers `req` (the port does both when it is done). Called for finished requests only;
        it must not change anything."""
        ...

    def settle_reads(self, req: Req, aborting: bool) -> None:
        """Called before the scheduler re-points `req`'s row at cached slots (continuing a chunked prefill:
        `aborting` False) or frees the KV of `req`, just aborted (`aborting` True). On return nothing the
        port started reads those slots any more: it waited for the reads already queued, and when aborting
        it dropped those not started and let go of the request (`holds_kv(req)` is False)."""
        ...

    # --- state ------------------------------------------------------------------------------------------------
    def holds_incoming_kv(self) -> bool:
        """Whether requests that are not running yet hold KV here and will run (or free it) without the
        scheduler's help: a retraction that finds nothing to free waits for them instead of ending its last
        request."""
        ...

    def is_idle(self) -> bool:
        """Whether the port holds nothing (no request, no KV)."""
        ...

    def info(self) -> dict[str, Any]:
        """The port's counters and queue sizes, merged into the scheduler's `internal_state`."""
        ...


class UnifiedPort:
    """The port of a unified server: takes nothing, holds nothing."""

    def take(self, req: Req) -> bool:
        return False

    def num_queued(self) -> int:
        return 0

    def on_event(self, event: TransferEvent) -> None:
        raise TypeError("a TransferEvent reached a scheduler that is not disaggregated")

    def abort(self, rid: str, message: str) -> bool:
        return False

    def before_schedule(self, lane: Lane) -> None:
        pass

    def after_prefill(self, batch: ScheduleBatch) -> None:
        pass

    def retract(self, req: Req) -> bool:
        return False

    def holds_kv(self, req: Req) -> bool:
        return False

    def settle_reads(self, req: Req, aborting: bool) -> None:
        pass

    def holds_incoming_kv(self) -> bool:
        return False

    def is_idle(self) -> bool:
        return True

    def info(self) -> dict[str, Any]:
        return {}
