"""`PrefillDisaggregation`: the prefill server's side of a disaggregated request, inside its `Scheduler`.

Lifecycle of a request with a bootstrap room (others — warm-up, health checks, SGLang's fake host — are
served as on a unified server):
- bootstrap queue: admitted to nothing until the decode server has pre-allocated the room's KV and every
  decode rank told this server where to write it (`TransferEvent` "ready"; the entry fails the room after
  the bootstrap timeout). Its max_new_tokens is 1: this side computes the prompt and the first token only.
- waiting queue → normal prefill batching (radix hits, chunking). After each chunk's results, its KV pages
  go to the agent's sender thread (page-aligned: a partial page waits for the next chunk); after the last
  chunk, the rest and the metadata slot (first token, its logprobs, cached tokens, room).
- inflight: the request holds its KV (the scheduler neither releases nor answers it: `holds_kv`) until
  "sent" (every prefill rank wrote its part): the KV goes into the prefix cache, the answer out.
  "failed" ends it with a 500 and frees the KV once no write reads it any more.
Every rank of the server runs this over the same messages and events, so all decide alike.

State: one `PrefillRoom` per request of ours, from `admit` until its KV is let go (the transfer is over, or
it was dropped): while it exists the request's KV and answer are held. A room's failure counts once in
`num_failed_transfer_reqs` (a late notice of a room already ended here finds nothing to count).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tokenloom.cache.kv_layout import aligned_prefix
from tokenloom.cache.pool_layout import swa_slots_of
from tokenloom.disaggregation.aux_buffer import encode_aux
from tokenloom.disaggregation.prefill_agent import PrefillAgent
from tokenloom.disaggregation.side import DisaggSide
from tokenloom.protocol import TransferEvent
from tokenloom.sampling.stopping import cap_new_tokens
from tokenloom.scheduler.lane import Lane
from tokenloom.scheduler.req import Req
from tokenloom.scheduler.schedule_batch import ScheduleBatch

if TYPE_CHECKING:
    from tokenloom.scheduler.scheduler import Scheduler

MAX_EARLY_READY = 100_000  # rooms whose destination arrived before their request (bounded)


def first_token_payload(req: Req) -> dict[str, Any]:
    """What the decode server needs to continue `req` after its prefill: the metadata slot's payload."""
    payload: dict[str, Any] = {"token": req.output_ids[0], "cached": req.cached_tokens}
    if req.return_logprob and req.output_token_logprobs:
        payload["logprob"] = req.output_token_logprobs[0][0]
        if req.top_logprobs_num and req.output_top_logprobs:
            payload["top"] = [list(pair) for pair in req.output_top_logprobs[0]]
        if req.token_ids_logprob is not None and req.output_token_ids_logprobs:
            payload["ids"] = req.output_token_ids_logprobs[0]
    return payload


@dataclass(eq=False)
class PrefillRoom:
    """This side's state of one request of ours while its KV is held for the transfer."""

    req: Req
    sent: int = 0  # prompt tokens handed to the sender so far (page-aligned until the last chunk)


class PrefillDisaggregation(DisaggSide):
    role = "prefill"

    def __init__(self, scheduler: Scheduler, agent: PrefillAgent) -> None:
        super().__init__(scheduler, agent)
        self.agent: PrefillAgent = agent
        self.rooms: dict[int, PrefillRoom] = {}  # every request of ours whose KV (and answer) is held
        self.bootstrap_queue: dict[int, Req] = {}
        self.inflight: dict[int, Req] = {}
        self.early_ready: dict[int, None] = {}
        self.early_failed: dict[int, tuple[str, int | None]] = {}  # failed before their request arrived: (why, status)
        self.transferred = 0
        self.failed = 0

    def num_queued(self) -> int:
        return len(self.bootstrap_queue)

    # --- requests ----------------------------------------------------------------------------------------
    def admit(self, req: Req) -> bool:
        """Take a validated request with a room into the bootstrap queue."""
        room = req.bootstrap.room
        in_use = room in self.bootstrap_queue or room in self.inflight or self._in_scheduler(room) is not None
        if self.refused(req, in_use):
            return True
        if room in self.early_failed:
            req.abort(*self.early_failed.pop(room))
            self.scheduler.emit(req)
            return True
        cap_new_tokens(req.sampling_params, 1)  # validated: max_new_tokens >= 1 here (0 was refused), so exactly 1
        self.rooms[room] = PrefillRoom(req)
        if room in self.early_ready:  # the decode side was faster than the request
            del self.early_ready[room]
            self.scheduler.queue_prefill(req)
        else:
            self.bootstrap_queue[room] = req
            self.agent.track_prefill(room)
        return True

    def _in_scheduler(self, room: int) -> Req | None:
        return self.scheduler.find_request(lambda r: self.owns(r) and r.bootstrap.room == room)

    def _held(self, req: Req) -> PrefillRoom | None:
        """`req`'s state while its KV is held (None: not ours, or let go)."""
        state = self.rooms.get(req.bootstrap.room) if req.bootstrap is not None else None
        return state if state is not None and state.req is req else None

    def on_event(self, event: TransferEvent) -> None:
        room = event.room
        if event.kind == "ready":
            req = self.bootstrap_queue.pop(room, None)
            if req is not None:
                self.scheduler.queue_prefill(req)
            elif self._in_scheduler(room) is None and room not in self.inflight:
                self.early_ready[room] = None
                while len(self.early_ready) > MAX_EARLY_READY:
                    self.early_ready.pop(next(iter(self.early_ready)))
        elif event.kind == "sent":
            req = self.inflight.pop(room, None)
            if req is not None:
                self.transferred += 1
                self._let_go(req)
            self.agent.forget(room)
        elif event.kind == "failed":
            data = event.data if isinstance(event.data, dict) else {}
            by_client, refused = data.get("by_client") is True, data.get("status")
            # the let-go is queued before `_fail`, whose abort of a request the scheduler holds forgets the
            # room (`settle_reads`): the agent still knows the peer to tell when every rank's writes of it are over
            self.agent.finished_failed(room, event.detail)
            ended = self._fail(room, event.detail if by_client or refused else f"KV transfer failed: {event.detail}",
                               None if by_client else refused or 500)
            self.failed += ended and not by_client and refused is None
            self.agent.forget(room)

    def _fail(self, room: int, message: str, status: int | None = 500) -> bool:
        """End the room's request (`status` None: a client abort on the decode side, answered as an abort).
        True when this ended a request of ours or is the first news of a room whose request has not arrived
        (a failure counts once)."""
        req = self.bootstrap_queue.pop(room, None) or self.inflight.pop(room, None)
        if req is not None:
            if not req.finished or req.finished_reason.get("type") != "abort":
                req.abort(message, status)
            self.agent.drop_writes(room)  # on every rank: no more of its chunks go out
            self._let_go(req)
            return True
        req = self._in_scheduler(room)
        if req is not None:  # waiting, or prefilling: the scheduler finds and frees it
            self.scheduler.abort_request(req.rid, message, status=status)
            return True
        first = room not in self.early_failed  # its request has not reached this server yet
        self.early_failed[room] = (message, status)
        while len(self.early_failed) > MAX_EARLY_READY:
            self.early_failed.pop(next(iter(self.early_failed)))
        return first

    def _let_go(self, req: Req) -> None:
        """The room's writes are over (or never started): release the KV into the cache and answer."""
        self.agent.wait_chunks(req.bootstrap.room)
        if self._held(req) is not None:
            del self.rooms[req.bootstrap.room]
        self.scheduler.finish(req)

    def abort(self, rid: str, message: str) -> bool:
        """Abort `rid` if it waits in the bootstrap queue or in flight here (False: not ours)."""
        for table in (self.bootstrap_queue, self.inflight):
            for room, req in list(table.items()):
                if req.rid == rid:
                    del table[room]
                    req.abort(message)
                    self.agent.abort(room, message, by_client=True)
                    self._let_go(req)
                    self.agent.forget(room)
                    return True
        return False

    # --- KV the transfer reads ----------------------------------------------------------------------------------
    def holds_kv(self, req: Req) -> bool:
        return self._held(req) is not None

    def settle_reads(self, req: Req, aborting: bool) -> None:
        """Before the scheduler re-points a held request's row (its queued writes must be done reading the
        slots) or frees the KV of one it aborted (client abort, failure: stop its writes, wait for any write
        still reading its slots, then let go so the scheduler frees them)."""
        if self._held(req) is None:
            return
        room = req.bootstrap.room
        if not aborting:
            self.agent.wait_chunks(room)
            return
        reason = req.finished_reason or {}
        self.agent.abort(room, reason.get("message", "aborted"), by_client=(reason.get("status_code") or 0) < 500)
        self.agent.wait_chunks(room)
        del self.rooms[room]
        self.agent.forget(room)  # after the abort (one queue): its notice to the peer is held apart

    # --- after a prefill batch's results --------------------------------------------------------------------
    def after_prefill(self, batch: ScheduleBatch) -> None:
        """Queue the KV each request of `batch` completed (its chunk) for the decode side."""
        page = self.scheduler.args.page_size
        seq_lens = batch.seq_lens.tolist()
        for req, upto in zip(batch.reqs, seq_lens, strict=True):
            state = self._held(req)
            if state is None or req.req_pool_idx is None:
                continue
            room = req.bootstrap.room
            if req.finished and req.finished_reason.get("type") == "abort":
                continue  # the abort path frees it
            last = bool(req.output_ids)
            end = upto if last else aligned_prefix(upto, page)
            if end > state.sent or last:
                slots = self.scheduler.request_slots(req, state.sent, end)
                # a sliding-window pool's swa slots are read now: the next chunk (after `settle_reads`) may drop them
                swa = swa_slots_of(self.scheduler.kv_memory.kv_pool, slots)
                aux = encode_aux(room, first_token_payload(req)) if last else None
                self.agent.send_chunk(room, state.sent, slots.tolist(), last, aux, swa)
                state.sent = end
            if last:
                self.inflight[room] = req

    # --- hooks the decode side uses -----------------------------------------------------------------------------
    def before_schedule(self, lane: Lane) -> None:
        """Nothing to plan here: ready requests join the waiting queue when their event arrives."""

    def retract(self, req: Req) -> bool:
        """A prefill server retracts by recomputing, as a unified one (its requests never decode)."""
        return False

    def holds_incoming_kv(self) -> bool:
        """No KV arrives at a prefill server (the KV its transfers hold is not a decoding request's to wait for)."""
        return False

    # --- state ------------------------------------------------------------------------------------------------
    def is_idle(self) -> bool:
        return not self.bootstrap_queue and not self.inflight

    def info(self) -> dict[str, Any]:
        return {"disaggregation_mode": "prefill", "num_bootstrap_reqs": len(self.bootstrap_queue),
                "num_inflight_transfer_reqs": len(self.inflight), "num_transferred_reqs": self.transferred,
                "num_failed_transfer_reqs": self.failed,
                "transfer_room_records": self.agent.room_records()}
