"""`DecodeDisaggregation`: the decode server's side of a disaggregated request, inside its `Scheduler`.

Lifecycle of a request with a bootstrap room (others — warm-up, health checks, SGLang's fake host — are
prefilled here, as on a unified server):
- pre-allocation queue: the entry rank's agent looks the prefill server up ("bootstrapped"; an unreachable or
  incompatible one — page size, KV dtype, backend, layers — fails the room). In arrival order, while memory
  allows (the KV of the prompt, plus `--num-reserved-decode-tokens` of room kept for every request already
  decoding or arriving, a free request row and a metadata slot) and no retracted request waits to resume, the
  request gets its row, its KV slots and a metadata slot, and the agent tells the prefill ranks where to write.
- transfer queue: until "arrived" (every decode rank holds its KV and the metadata slot). The slot's room must
  be the request's, else the request fails ("context corruption") instead of trusting a wrong token.
- prebuilt: the first token (and its logprobs) is appended as if this server had sampled it, the token table
  gets it, and the request joins a lane's running requests: the next decode step extends it. No forward.
- retraction (KV short for a decode step): the request's KV is copied to host memory and its slots freed; it
  resumes (slots re-allocated, KV copied back) before any new pre-allocation. Nothing is recomputed.
- aborts and failures free the row, the slots and the metadata slot; a room aborted or failed while the prefill
  side may still be writing into its slots (a client abort mid-transfer, one prefill rank's failed write while
  another writes, a transfer timeout) keeps them ("draining") until the prefill side lets go or the room's
  final event, bounded by the transfer timeout + 5 s, so no write lands in KV another request owns.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from tokenloom.disaggregation.agent import TransferAgent
from tokenloom.disaggregation.aux_buffer import AuxBuffer, AuxSlotError
from tokenloom.disaggregation.side import DisaggSide
from tokenloom.executor.worker import ForwardOutput
from tokenloom.protocol import TransferEvent
from tokenloom.scheduler.lane import Lane
from tokenloom.scheduler.req import CLIP_MAX_NEW_TOKENS_ESTIMATION, Req

if TYPE_CHECKING:
    from tokenloom.scheduler.scheduler import Scheduler


class DecodeDisaggregation(DisaggSide):
    role = "decode"

    def __init__(self, scheduler: Scheduler, agent: TransferAgent, aux: AuxBuffer) -> None:
        super().__init__(scheduler)
        self.agent = agent
        self.aux = aux
        self.kv_pool = scheduler.kv_memory.kv_pool
        self.prealloc: list[Req] = []
        self.transfer: dict[int, Req] = {}
        self.arrived: list[Req] = []
        self.retracted: list[Req] = []
        self.draining: dict[int, Req] = {}  # aborted while the prefill side may still write into its slots
        self.received = 0
        self.failed = 0
        self.offloaded = 0
        self._polls = 0
        self.queue_polls = 0  # how often the queues were looked at

    # --- requests ----------------------------------------------------------------------------------------
    def add(self, req: Req) -> bool:
        if not self.owns(req):
            return False
        room = req.bootstrap.room
        if self.refused(req, room in self.transfer or any(r.bootstrap.room == room for r in self.prealloc)):
            return True
        req.input_logprobs = None  # the prompt's logprobs are the prefill server's answer (the router merges)
        req.pd_bootstrapped = False
        req.aux_index = None
        self.prealloc.append(req)
        self.agent.track_decode(room, req.bootstrap)
        return True

    def on_event(self, event: TransferEvent) -> None:
        room = event.room
        if event.kind == "bootstrapped":
            for req in self.prealloc:
                if req.bootstrap.room == room:
                    req.pd_bootstrapped = True
                    req.pd_prefill_info = event.data
        elif event.kind == "arrived":
            req = self.transfer.pop(room, None)
            if req is not None:
                self.arrived.append(req)
            self._end_drain(room)
        elif event.kind == "client_abort":  # after "arrived": the request decodes or is about to
            self._abort_past_transfer(room, event.detail)
        elif event.kind == "let_go":  # the prefill side is done with a room this side gave up on
            self._end_drain(room)
        elif event.kind == "failed":
            data = event.data if isinstance(event.data, dict) else {}
            by_client, refused = data.get("by_client") is True, data.get("status")
            self.failed += not by_client and refused is None
            # a prefill rank may still write into the slots of a room in transfer (another rank's write failed,
            # or the transfer timed out): they are kept until the prefill side lets go
            drain = data.get("writes_may_run") is True and room in self.transfer
            self._fail(room, event.detail if by_client or refused else f"KV transfer failed: {event.detail}",
                       None if by_client else refused or 500, drain=drain)
            if not drain:
                self._end_drain(room)
            self.agent.finished_failed(room, event.detail)

    def _fail(self, room: int, message: str, status: int | None = 500, drain: bool = False) -> None:
        """End the room's request (`status` None: a client abort on the prefill side, answered as an abort; such
        an abort also ends the request once its KV arrived, even decoding: the client asked for it, and the
        prefill side sends it only after its writes are over). `drain`: a request in transfer keeps its slots
        (answered now, freed at the let-go or its bound)."""
        for req in self.prealloc:
            if req.bootstrap.room == room:
                self.prealloc.remove(req)
                self._finish(req, message, status, error=status is not None)
                self.agent.forget(room)
                return
        req = self.transfer.pop(room, None)
        if req is not None and drain:
            self.draining[room] = req
            self.agent.bound_drain(room)
            self._finish(req, message, status, error=status is not None)
            return  # the agent keeps the room until the drain ends (`_end_drain` forgets it)
        if req is not None:
            self._free(req)
            self._finish(req, message, status, error=status is not None)
        elif status is None:
            self._abort_past_transfer(room, message)
        self.agent.forget(room)

    def _abort_past_transfer(self, room: int, message: str) -> None:
        """A client abort on the prefill side of a request whose KV already arrived here."""
        for queue in (self.arrived, self.retracted):
            for req in queue:
                if req.bootstrap.room == room:
                    queue.remove(req)
                    self._free(req)
                    req.offloaded_kv = None
                    self._finish(req, message, error=False)
                    return
        for lane in self.scheduler.lanes:
            for req in lane.running:
                if req.bootstrap is not None and req.bootstrap.room == room and not req.finished:
                    self.scheduler.abort_request(req.rid, message, status=None)
                    return

    def _end_drain(self, room: int) -> None:
        req = self.draining.pop(room, None)
        if req is not None:
            self._free(req)
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
        self.scheduler.output.emit([req])

    def _free(self, req: Req) -> None:
        """Give back the row, KV slots and metadata slot of a request that never decoded here."""
        if req.req_pool_idx is not None:
            slots = self.scheduler.req_to_token_pool.req_to_token[req.req_pool_idx, : req.kv_len].to(torch.int64)
            if req.kv_len:
                self.scheduler.allocator.free(slots)
            self.scheduler.req_to_token_pool.free(req.req_pool_idx)
            req.req_pool_idx = None
            req.kv_len = 0
        if req.aux_index is not None:
            self.aux.free(req.aux_index)
            req.aux_index = None

    def abort(self, rid: str, message: str) -> bool:
        for req in self.prealloc:
            if req.rid == rid:
                self.prealloc.remove(req)
                self.agent.abort(req.bootstrap.room, message, by_client=True)
                self.agent.forget(req.bootstrap.room)
                self._finish(req, message)
                return True
        for room, req in list(self.transfer.items()):
            if req.rid == rid:
                del self.transfer[room]
                self.agent.abort(room, message, by_client=True)
                self.draining[room] = req  # its slots may still be written: freed at the room's final event
                self._finish(req, message)
                return True
        for req in [*self.arrived, *self.retracted]:
            if req.rid == rid:
                (self.arrived if req in self.arrived else self.retracted).remove(req)
                self._free(req)
                req.offloaded_kv = None
                self.agent.forget(req.bootstrap.room)
                self._finish(req, message)
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
        reqs = [*self.scheduler.running, *self.transfer.values(), *self.arrived]
        return sum(min(per, max(r.sampling_params.max_new_tokens - len(r.output_ids), 0)) for r in reqs)

    def _room_for(self, tokens: int, req: Req) -> bool:
        s = self.scheduler
        budget = s.memory.available_tokens() - self._reserved()
        growth = min(s.args.num_reserved_decode_tokens, req.sampling_params.max_new_tokens,
                     CLIP_MAX_NEW_TOKENS_ESTIMATION)
        active = len(s.running) + len(self.transfer) + len(self.arrived)
        return (budget >= tokens + growth and s.req_to_token_pool.available_size() > 0
                and active < s.max_running_requests)

    def _allocate(self, req: Req, tokens: int) -> torch.Tensor:
        s = self.scheduler
        row = s.req_to_token_pool.alloc(1)[0]
        s.memory._ensure(tokens + s.args.page_size)
        zero = torch.zeros(1, dtype=torch.int64, device=s.kv_memory.device)
        slots = s.allocator.alloc_extend(zero, torch.tensor([tokens], dtype=torch.int64, device=zero.device), zero)
        if slots is None:
            s.req_to_token_pool.free(row)
            raise RuntimeError("decode pre-allocation found no KV slots although the budget said it fits")
        s.req_to_token_pool.req_to_token[row, :tokens] = slots.to(torch.int32)
        req.req_pool_idx = row
        req.kv_len = tokens
        return slots

    def _preallocate(self) -> None:
        for req in list(self.prealloc):
            if not req.pd_bootstrapped:
                continue
            tokens = len(req.origin_input_ids) + max(len(req.output_ids) - 1, 0)
            if self.aux.available() == 0 or not self._room_for(tokens, req):
                break  # in order: a large request is not overtaken forever
            self.prealloc.remove(req)
            slots = self._allocate(req, tokens)
            req.aux_index = self.aux.alloc()
            self.transfer[req.bootstrap.room] = req
            self.agent.send_metadata(req.bootstrap.room, req.pd_prefill_info, slots.tolist(), req.aux_index)
            req.pd_prefill_info = None

    def _prebuild(self) -> None:
        s = self.scheduler
        started: list[Req] = []
        for req in self.arrived:
            room = req.bootstrap.room
            try:
                payload = self.aux.read(req.aux_index, room)
            except AuxSlotError as e:
                self._free(req)
                self._finish(req, f"KV transfer failed: {e}", 500)
                self.agent.forget(room)
                continue
            self.aux.free(req.aux_index)
            req.aux_index = None
            self.agent.forget(room)
            self.received += 1
            req.cached_tokens = int(payload.get("cached", 0))
            token = int(payload["token"])
            out = ForwardOutput(next_token_ids=[token])
            if req.return_logprob and "logprob" in payload:
                out.logprobs = [float(payload["logprob"])]
                out.top_logprobs = [[(float(v), int(i)) for v, i in payload.get("top", [])]]
                out.token_ids_logprobs = [payload.get("ids")]
            s.output._append(req, 0, out)
            s.worker.write_tokens([req.req_pool_idx], [token])
            if req.finished:
                s.output.release(req)
            else:
                started.append(req)
            s.output.emit([req])
        self.arrived = []
        for req in started:
            self._least_busy_lane().running.append(req)

    def _least_busy_lane(self) -> Lane:
        return min(self.scheduler.lanes, key=lambda lane: (lane.admitted(), lane.index))

    # --- hooks the prefill side uses --------------------------------------------------------------------------------
    def after_extend(self, batch: Any) -> None:
        """Nothing to send: this server's own prefills (warm-up, fake rooms) are local."""

    def before_repoint(self, req: Req) -> None:
        """No transfer reads this server's KV."""

    def drop(self, req: Req) -> None:
        """Requests here never hold KV for a transfer (`kv_hold` is a prefill-side state)."""

    def retracts_to_host(self, req: Req) -> bool:
        return self.owns(req)

    def holds_incoming_kv(self) -> bool:
        """Whether requests not running yet hold KV here (pre-allocated, arrived, or aborted mid-transfer)."""
        return bool(self.transfer or self.arrived or self.draining)

    # --- retraction to host memory ---------------------------------------------------------------------------------
    def offload(self, req: Req) -> None:
        """Retract a running request: its KV to host memory, its slots and row freed (no recompute later)."""
        s = self.scheduler
        slots = s.req_to_token_pool.req_to_token[req.req_pool_idx, : req.kv_len].to(torch.int64)
        req.offloaded_kv = self.kv_pool.buffer.index_select(3, slots).cpu()
        s.allocator.free(slots)
        s.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx = None
        req.retraction_count += 1
        self.offloaded += 1
        self.retracted.append(req)

    def _resume(self) -> None:
        s = self.scheduler
        while self.retracted:
            req = self.retracted[0]
            tokens = req.kv_len
            if not self._room_for(tokens, req):
                return
            self.retracted.pop(0)
            slots = self._allocate(req, tokens)
            self.kv_pool.buffer.index_copy_(3, slots, req.offloaded_kv.to(self.kv_pool.buffer.device))
            req.offloaded_kv = None
            s.worker.write_tokens([req.req_pool_idx], [req.output_ids[-1]])
            self._least_busy_lane().running.append(req)

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
