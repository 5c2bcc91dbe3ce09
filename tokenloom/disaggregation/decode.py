"""`DecodeDisaggregation`: the decode server's side of a disaggregated request, inside its `Scheduler`.

Lifecycle of a request with a bootstrap room (others — warm-up, health checks, SGLang's fake host — are
prefilled here, as on a unified server):
- pre-allocation queue: the entry rank's agent looks the prefill server up ("bootstrapped"; an unreachable or
  incompatible one — page size, KV dtype, backend, layers, sliding-window pool or not — fails the room). In
  arrival order, while memory allows (the KV of the prompt, plus `--num-reserved-decode-tokens` of room kept for
  every request already decoding or arriving, a free request row and a metadata slot) and no retracted request
  waits to resume, the request gets its row, its KV slots and a metadata slot, and the agent tells the prefill
  ranks where to write. A sliding-window pool gives sliding-layer slots to the window's tail only (the earlier
  positions' sliding K/V is never read here, so never sent); a request whose window that pool cannot hold is
  refused at admission.
- transfer queue: until "arrived" (every decode rank holds its KV and the metadata slot). The slot's room must
  be the request's, else the request fails ("context corruption") instead of trusting a wrong token.
- prebuilt: the first token (and its logprobs) is appended as if this server had sampled it, the token table
  gets it, and the request joins a lane's running requests: the next decode step extends it. No forward.
- retraction (KV short for a decode step): the request's KV is copied to host memory and its slots freed; it
  resumes (slots re-allocated, KV copied back) before any new pre-allocation. Nothing is recomputed.
- aborts and failures free the row, the slots and the metadata slot; a room aborted or failed while the prefill
  side may still be writing into its slots (a client abort mid-transfer, one prefill rank's failed write while
  another writes, a transfer timeout) keeps them ("draining") until the prefill side lets go or the room's
  final event, bounded by the transfer timeout + 5 s, so no write lands in KV another request owns. A room
  already draining (a client abort) that then fails while writes may run keeps draining; so does a room whose
  prefill server stopped answering its heartbeats (it may be frozen mid-write, and resume).

State: one `DecodeRoom` per request of ours, from `admit` until it runs (prebuilt: from then on the scheduler
holds it) or ends, and one for a running request retracted to host memory until it resumes. A room's failure
counts once in `num_failed_transfer_reqs`: a late failure of a room this side no longer holds counts nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from tokenloom.cache.pool_layout import swa_slots_of
from tokenloom.disaggregation.aux_buffer import AuxBuffer, AuxSlotError
from tokenloom.disaggregation.decode_agent import DecodeAgent
from tokenloom.disaggregation.side import DisaggSide
from tokenloom.executor.worker import ForwardOutput
from tokenloom.protocol import TransferEvent
from tokenloom.scheduler.lane import Lane
from tokenloom.scheduler.req import CLIP_MAX_NEW_TOKENS_ESTIMATION, Req
from tokenloom.scheduler.schedule_batch import ScheduleBatch

if TYPE_CHECKING:
    from tokenloom.scheduler.scheduler import Scheduler


@dataclass(eq=False)
class DecodeRoom:
    """This side's state of one request of ours that the scheduler does not hold (yet, or while retracted)."""

    req: Req
    bootstrapped: bool = False  # the prefill server was found and is compatible
    prefill_info: dict[str, Any] | None = None  # its layout ("bootstrapped" event), until the destination is sent
    aux_index: int | None = None  # its metadata slot, from pre-allocation until the first token is read
    offloaded_kv: torch.Tensor | None = None  # retracted: its KV in host memory
    offloaded_len: int = 0  # retracted: how many tokens' KV that is
    failure_counted: bool = False  # its failure was counted in `failed` already

    @property
    def room(self) -> int:
        return self.req.bootstrap.room


class DecodeDisaggregation(DisaggSide):
    role = "decode"

    def __init__(self, scheduler: Scheduler, agent: DecodeAgent, aux: AuxBuffer) -> None:
        super().__init__(scheduler, agent)
        self.agent: DecodeAgent = agent
        self.aux = aux
        self.kv_pool = scheduler.kv_memory.kv_pool
        self.prealloc: list[DecodeRoom] = []
        self.transfer: dict[int, DecodeRoom] = {}
        self.arrived: list[DecodeRoom] = []
        self.retracted: list[DecodeRoom] = []
        self.draining: dict[int, DecodeRoom] = {}  # answered while the prefill side may still write into its slots
        self.received = 0
        self.failed = 0
        self.offloaded = 0
        self._polls = 0
        self.queue_polls = 0  # how often the queues were looked at

    # --- requests ----------------------------------------------------------------------------------------
    def admit(self, req: Req) -> bool:
        room = req.bootstrap.room
        if self.refused(req, room in self.transfer or any(r.room == room for r in self.prealloc)):
            return True
        if self._beyond_swa_pool(req):
            return True
        req.input_logprobs = None  # the prompt's logprobs are the prefill server's answer (the router merges)
        self.prealloc.append(DecodeRoom(req))
        self.agent.track_decode(room, req.bootstrap)
        return True

    def _beyond_swa_pool(self, req: Req) -> bool:
        """Answer `req` with a 400 (True) when a sliding-window pool could never pre-allocate it: smaller than
        the window (plus the decode reservation) its first query reads."""
        swa_size, tail = getattr(self.kv_pool, "swa_size", None), self.scheduler.kv_memory.swa_tail()
        if swa_size is None or tail is None:
            return False
        need = min(len(req.origin_input_ids), tail) + self._growth(req)
        if need <= swa_size:
            return False
        req.abort(f"this decode server's sliding-window KV pool ({swa_size} slots, --swa-full-tokens-ratio of "
                  f"--max-total-tokens) cannot hold the window of this request ({need} slots): raise them, or pass "
                  "--disable-hybrid-swa-memory to both servers", 400)
        self.scheduler.emit(req)
        self._tell_peer_refused(req)
        return True

    def on_event(self, event: TransferEvent) -> None:
        room = event.room
        if event.kind == "bootstrapped":
            for state in self.prealloc:
                if state.room == room:
                    state.bootstrapped = True
                    state.prefill_info = event.data
        elif event.kind == "arrived":
            state = self.transfer.pop(room, None)
            if state is not None:
                self.arrived.append(state)
            self._end_drain(room)
        elif event.kind == "client_abort":  # after "arrived": the request decodes or is about to
            self._abort_past_transfer(room, event.detail)
        elif event.kind == "let_go":  # the prefill side is done with a room this side gave up on
            self._end_drain(room)
        elif event.kind == "failed":
            self._on_failed(room, event)

    def _on_failed(self, room: int, event: TransferEvent) -> None:
        data = event.data if isinstance(event.data, dict) else {}
        by_client, refused = data.get("by_client") is True, data.get("status")
        held = self._held(room)
        if held is not None and not held.failure_counted and not by_client and refused is None:
            held.failure_counted = True  # a room fails once here, however many notices of it come
            self.failed += 1
        # a prefill rank may still write into the slots of a room in transfer (another rank's write failed, the
        # transfer timed out, the prefill server stopped answering): they are kept until the prefill side lets go,
        # also when a client abort already moved the room to draining
        drain = data.get("writes_may_run") is True and (room in self.transfer or room in self.draining)
        self._fail(room, event.detail if by_client or refused else f"KV transfer failed: {event.detail}",
                   None if by_client else refused or 500, drain=drain)
        if not drain:
            self._end_drain(room)
        self.agent.finished_failed(room, event.detail)

    def _held(self, room: int) -> DecodeRoom | None:
        """The room's state while this side holds it short of running (pre-allocation, transfer, draining)."""
        found = self.transfer.get(room) or self.draining.get(room)
        return found or next((state for state in self.prealloc if state.room == room), None)

    def _fail(self, room: int, message: str, status: int | None = 500, drain: bool = False) -> None:
        """End the room's request (`status` None: a client abort on the prefill side, answered as an abort; such
        an abort also ends the request once its KV arrived, even decoding: the client asked for it, and the
        prefill side sends it only after its writes are over). `drain`: a request in transfer keeps its slots
        (answered now, freed at the let-go or its bound), and one draining already keeps draining."""
        for state in self.prealloc:
            if state.room == room:
                self.prealloc.remove(state)
                self._finish(state.req, message, status, error=status is not None)
                self.agent.forget(room)
                return
        if drain and room in self.draining:  # answered already; its slots wait for the let-go, bounded
            self.agent.bound_drain(room)
            return
        state = self.transfer.pop(room, None)
        if state is not None and drain:
            self.draining[room] = state
            self.agent.bound_drain(room)
            self._finish(state.req, message, status, error=status is not None)
            return  # the agent keeps the room until the drain ends (`_end_drain` forgets it)
        if state is not None:
            self._free(state)
            self._finish(state.req, message, status, error=status is not None)
        elif status is None:
            self._abort_past_transfer(room, message)
        self.agent.forget(room)

    def _abort_past_transfer(self, room: int, message: str) -> None:
        """A client abort on the prefill side of a request whose KV already arrived here."""
        for queue in (self.arrived, self.retracted):
            for state in queue:
                if state.room == room:
                    queue.remove(state)
                    self._free(state)
                    self._finish(state.req, message, error=False)
                    return
        req = self.scheduler.find_request(lambda r: self.owns(r) and r.bootstrap.room == room)
        if req is not None:  # decoding
            self.scheduler.abort_request(req.rid, message, status=None)

    def _end_drain(self, room: int) -> None:
        state = self.draining.pop(room, None)
        if state is not None:
            self._free(state)
            self.agent.forget(room)

    def _finish(self, req: Req, message: str, status: int | None = None, error: bool = True) -> None:
        """`status` None: the scheduler's client-abort status; `error` False: no status at all (an abort the
        client asked for on the other server, answered as a normal response with finish reason abort)."""
        if not error:
            req.abort(message, None)
        elif status is None:
            req.abort(message)
        else:
            req.abort(message, status)
        self.scheduler.emit(req)

    def _free(self, state: DecodeRoom) -> None:
        """Give back the row, KV slots, metadata slot and host copy of a request that is not decoding here."""
        self.scheduler.free_kv(state.req)
        if state.aux_index is not None:
            self.aux.free(state.aux_index)
            state.aux_index = None
        state.offloaded_kv = None

    def abort(self, rid: str, message: str) -> bool:
        for state in self.prealloc:
            if state.req.rid == rid:
                self.prealloc.remove(state)
                self.agent.abort(state.room, message, by_client=True)
                self.agent.forget(state.room)
                self._finish(state.req, message)
                return True
        for room, state in list(self.transfer.items()):
            if state.req.rid == rid:
                del self.transfer[room]
                self.agent.abort(room, message, by_client=True)
                self.draining[room] = state  # its slots may still be written: freed at the room's final event
                self._finish(state.req, message)
                return True
        for state in [*self.arrived, *self.retracted]:
            if state.req.rid == rid:
                (self.arrived if state in self.arrived else self.retracted).remove(state)
                self._free(state)
                self.agent.forget(state.room)
                self._finish(state.req, message)
                return True
        return False

    # --- before each scheduling decision ------------------------------------------------------------------------
    def before_schedule(self, lane: Lane) -> None:
        """Resume retracted requests, pre-allocate new ones, and start the arrived ones decoding (every
        `--disaggregation-decode-polling-interval` scheduling decisions, or whenever nothing runs)."""
        self._polls += 1
        interval = self.scheduler.args.disaggregation_decode_polling_interval
        if self._polls % interval and self.scheduler.running:
            return
        self.queue_polls += 1
        self._resume()
        if not self.retracted:
            self._preallocate()
        if self.arrived:
            self._prebuild()

    def _reserved(self) -> int:
        """KV tokens kept for the requests already decoding or on their way (SGLang's decode reservation)."""
        per = self.scheduler.args.num_reserved_decode_tokens
        reqs = [*self.scheduler.running, *(s.req for s in self.transfer.values()), *(s.req for s in self.arrived)]
        return sum(min(per, max(r.sampling_params.max_new_tokens - len(r.output_ids), 0)) for r in reqs)

    def _growth(self, req: Req) -> int:
        return min(self.scheduler.args.num_reserved_decode_tokens, req.sampling_params.max_new_tokens,
                   CLIP_MAX_NEW_TOKENS_ESTIMATION)

    def _room_for(self, tokens: int, req: Req) -> bool:
        """Whether `tokens` positions of `req` can be reserved now (`_reserve`), leaving the decode reservation.
        A sliding-window pool's sliding layers need slots only for the window's tail."""
        s = self.scheduler
        reserved, growth = self._reserved(), self._growth(req)
        full, swa = s.kv_memory.free_by_pool()
        tail = s.kv_memory.swa_tail()
        swa_need = tokens if tail is None else min(tokens, tail)
        active = len(s.running) + len(self.transfer) + len(self.arrived)
        return (full - reserved >= tokens + growth and swa - reserved >= swa_need + growth
                and s.free_request_rows() > 0 and active < s.max_running_requests)

    def _reserve(self, req: Req, tokens: int) -> torch.Tensor:
        """A row and slots for `tokens` positions of `req`; in a sliding-window pool sliding-layer slots only for
        the last positions its queries read (the KV of the others is not sent, sgl-project/sglang#24036)."""
        return self.scheduler.reserve_kv(req, tokens, self.scheduler.kv_memory.swa_tail())

    def _preallocate(self) -> None:
        for state in list(self.prealloc):
            if not state.bootstrapped:
                continue
            req = state.req
            tokens = len(req.origin_input_ids) + max(len(req.output_ids) - 1, 0)
            if self.aux.available() == 0 or not self._room_for(tokens, req):
                break  # in order: a large request is not overtaken forever
            self.prealloc.remove(state)
            slots = self._reserve(req, tokens)
            state.aux_index = self.aux.alloc()
            self.transfer[state.room] = state
            self.agent.send_metadata(state.room, state.prefill_info, slots.tolist(), state.aux_index,
                                     swa_slots_of(self.kv_pool, slots))
            state.prefill_info = None

    def _prebuild(self) -> None:
        """The first token (and its logprobs) of each arrived request, read from its metadata slot, is applied as
        if this server had sampled it; the requests that go on start decoding (no forward)."""
        started: list[Req] = []
        for state in self.arrived:
            req, room = state.req, state.room
            try:
                payload = self.aux.read(state.aux_index, room)
            except AuxSlotError as e:
                self._free(state)
                self._finish(req, f"KV transfer failed: {e}", 500)
                self.agent.forget(room)
                continue
            self.aux.free(state.aux_index)
            state.aux_index = None
            self.agent.forget(room)
            self.received += 1
            req.cached_tokens = int(payload.get("cached", 0))
            out = ForwardOutput(next_token_ids=[int(payload["token"])])
            if req.return_logprob and "logprob" in payload:
                out.logprobs = [float(payload["logprob"])]
                out.top_logprobs = [[(float(v), int(i)) for v, i in payload.get("top", [])]]
                out.token_ids_logprobs = [payload.get("ids")]
            if self.scheduler.apply_token(req, out):
                started.append(req)
        self.arrived = []
        for req in started:
            self.scheduler.start_running(req)

    # --- hooks the prefill side uses --------------------------------------------------------------------------------
    def after_prefill(self, batch: ScheduleBatch) -> None:
        """Nothing to send: this server's own prefills (warm-up, fake rooms) are local."""

    def holds_kv(self, req: Req) -> bool:
        """No transfer reads this server's KV."""
        return False

    def settle_reads(self, req: Req, aborting: bool) -> None:
        """No transfer reads this server's KV."""

    def holds_incoming_kv(self) -> bool:
        """Whether requests not running yet hold KV here (pre-allocated, arrived, or aborted mid-transfer)."""
        return bool(self.transfer or self.arrived or self.draining)

    # --- retraction to host memory ---------------------------------------------------------------------------------
    def retract(self, req: Req) -> bool:
        """Retract a running request of ours: its KV to host memory, its slots and row freed; it resumes before any
        new pre-allocation, without recompute."""
        if not self.owns(req):
            return False
        state = DecodeRoom(req, offloaded_len=req.kv_len)
        state.offloaded_kv = self.kv_pool.read_slots(self.scheduler.request_slots(req)).cpu()
        self.scheduler.free_kv(req)
        self.offloaded += 1
        self.retracted.append(state)
        return True

    def _resume(self) -> None:
        while self.retracted:
            state = self.retracted[0]
            if not self._room_for(state.offloaded_len, state.req):
                return
            self.retracted.pop(0)
            slots = self._reserve(state.req, state.offloaded_len)
            self.kv_pool.write_slots(slots, state.offloaded_kv)
            state.offloaded_kv = None
            self.scheduler.start_running(state.req)

    # --- state --------------------------------------------------------------------------------------------------------
    def num_queued(self) -> int:
        return len(self.prealloc)

    def is_idle(self) -> bool:
        return not (self.prealloc or self.transfer or self.arrived or self.retracted or self.draining)

    def info(self) -> dict[str, Any]:
        return {"disaggregation_mode": "decode", "num_prealloc_queue_reqs": len(self.prealloc),
                "num_transfer_queue_reqs": len(self.transfer), "num_decode_retracted_reqs": len(self.retracted),
                "num_draining_reqs": len(self.draining),
                "num_received_reqs": self.received, "num_failed_transfer_reqs": self.failed,
                "num_offloaded_reqs": self.offloaded, "free_aux_slots": self.aux.available(),
                "num_queue_polls": self.queue_polls,
                "transfer_room_records": self.agent.room_records()}
