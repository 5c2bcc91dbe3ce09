"""`Scheduler`: owns the waiting queue and the micro-batch lanes (scheduler/lane.py: each lane's running
requests and launched batches), drives the worker and the rank's KV memory (request rows, KV slots, prefix
cache), and turns them into one batch per step of a lane. It does no I/O itself: requests arrive through
`handle(msg)`, outputs leave through the `send` callable, and an event loop (loops.py, pipeline_loop.py)
decides when to call what. The normal and overlap loops drive one lane; the pipeline loop pp + depth lanes.

Per step: `get_next_batch_to_run(loop, lane)` → `launch(batch, lane)` (prepare on this thread) → the loop runs
the step (inline, on the forward thread while it plans the next batch, or down the pipeline's stages) →
`process_batch_result(batch, out, lane)`, for each lane in launch order.
With overlap, a batch is planned before the results of the one in flight are processed; the few decisions
that need exact state (retraction, flushing the cache, reporting the state) first ask the loop that drives
the scheduler to settle: `LoopControl.settle_all()`, "process every launched batch". The loop is passed to
`handle` and `get_next_batch_to_run` on each call (never stored here), so the scheduler holds no callbacks
the loops overwrite.
Prefill has priority: a new prefill batch is built whenever waiting requests fit; otherwise all running
requests decode one token. Before a decode step that would not fit in KV memory, cached KV is evicted, then
requests are retracted (fewest output tokens first) and re-queued; they are recomputed later. Nothing is
dropped: every request ends with a finish reason sent to the detokenizer.

The KV memory (request table, allocator, prefix cache) is the rank's `KVMemory`, handed in by the rank's
entry, which hands the same object to the model runner; the scheduler is the only one that allocates, frees,
caches or evicts in it. The worker is reached only through `SchedulerWorker` (scheduler/interfaces.py:
prepare, execute, its EOS ids, its device), so scheduling runs against a fake worker in unit tests
(tests/unit/test_scheduler_fake_runner.py).

How requests enter and leave is the request port's (scheduler/request_port.py): `UnifiedPort` on a unified
server; a prefill or decode server's side of disaggregation (disaggregation/prefill.py, decode.py), set with
`set_port`, takes the requests with a bootstrap room and hands them over through the operations in the
"request port" section below (queue for prefill, reserve KV, apply a token sampled elsewhere, start running,
find, answer); the scheduler tells it what it needs to know through the port's hooks, and nothing else.

Tensor parallelism: every TP rank runs its own `Scheduler` over its shard's `KVMemory` (same capacities, MIN-
reduced at start) and handles the entry rank's broadcast messages in the same order (scheduler/rank_sync.py).
Every decision here is a function of those messages, the pool sizes and the sampled tokens (no clocks, no
per-process hashing; the prefix cache's LRU is a logical tick), so the ranks make the same decisions. Sampled
tokens are identical on every rank by construction, not broadcast: each rank samples from the same
all-gathered float32 logits with the same generator seed and per-request seeds (checked at temperature 0.8 in
tests/integration/test_tensor_parallel.py; `internal_state()["tp_ranks_agree"]` compares every rank's pool
sizes, queues and a running hash of its sampled tokens).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from tokenloom.cache.kv_memory import KVMemory
from tokenloom.config import ServerArgs
from tokenloom.executor.worker import ForwardOutput
from tokenloom.grammar.backends import make_backend
from tokenloom.protocol import (
    AbortRequest,
    FlushCacheReply,
    FlushCacheRequest,
    GetInternalStateRequest,
    GrammarDecision,
    InternalStateReply,
    RequestAccepted,
    StartProfileRequest,
    StopProfileRequest,
    TokenizedRequest,
    TransferEvent,
)
from tokenloom.sampling.stopping import cap_new_tokens, new_token_room
from tokenloom.scheduler.grammar_queue import GrammarQueue
from tokenloom.scheduler.interfaces import NO_LOOP, LoopControl, PreparedStepLike, SchedulerWorker
from tokenloom.scheduler.jump_forward import JumpForward
from tokenloom.scheduler.lane import Lane
from tokenloom.scheduler.output_processor import OutputProcessor
from tokenloom.scheduler.policy import order_waiting_queue, uncached_head
from tokenloom.scheduler.prefill_adder import AddResult, PrefillAdder
from tokenloom.scheduler.profiler import TraceProfiler
from tokenloom.scheduler.req import LONG_FACTOR_KEYS, Req
from tokenloom.scheduler.request_port import RequestPort, UnifiedPort
from tokenloom.scheduler.schedule_batch import BatchMemory, ScheduleBatch
from tokenloom.scheduler.state_report import scheduler_state
from tokenloom.scheduler.stats import NewTokenRatio, StepStats

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, args: ServerArgs, worker: SchedulerWorker, tokenizer: Any, send: Callable[[Any], None],
                 memory: KVMemory, ranks_agree: Callable[[object], bool] | None = None, num_lanes: int = 1,
                 lane_cap: int | None = None, trace_profiler: TraceProfiler | None = None) -> None:
        """`ranks_agree` (tp_size > 1): whether every TP rank holds the same value (rank_sync /
        comm.all_equal); called only from `handle`, which every rank runs on the same messages in the same
        order. `num_lanes` micro-batch lanes (scheduler/lane.py), each holding at most `lane_cap` requests
        (default: `--pp-max-micro-batch-size`, else max_running_requests // pp_size under PP, else
        max_running_requests; max_running_requests bounds all lanes together too). `trace_profiler`: the rank's
        /start_profile sessions (scheduler/profiler.py; default: one named as rank 0), stepped by the loop."""
        if memory.page_size != args.page_size:
            raise ValueError(f"KVMemory has page size {memory.page_size}, --page-size is {args.page_size}")
        self.args = args
        self.worker = worker
        self.kv_memory = memory
        self.req_to_token_pool = memory.req_to_token_pool
        self.allocator = memory.token_allocator
        self.tree_cache = memory.tree_cache
        self.memory = BatchMemory(self.req_to_token_pool, self.allocator, self.tree_cache, memory.device)
        # How requests enter and leave (scheduler/request_port.py): a unified server's until `set_port`.
        self.port: RequestPort = UnifiedPort()
        self.output = OutputProcessor(self.tree_cache, self.req_to_token_pool, tokenizer, send, args.stream_interval,
                                      held=self.port.holds_kv)
        self.send = send
        self.max_total_num_tokens = memory.max_total_num_tokens
        self.context_len = memory.context_len
        self.max_req_input_len = min(self.context_len - 1, self.max_total_num_tokens - 1) - 1
        self.max_running_requests = min(self.req_to_token_pool.size,
                                        args.max_running_requests or max(self.max_total_num_tokens // 2, 1))
        self.chunked_prefill_size = None if args.chunked_prefill_size == -1 else args.chunked_prefill_size
        self.waiting_queue: list[Req] = []
        if lane_cap is None and args.pp_size > 1:  # SGLang's pp_max_micro_batch_size default
            lane_cap = args.pp_max_micro_batch_size or max(self.max_running_requests // args.pp_size, 1)
        cap = self.max_running_requests if lane_cap is None else max(1, min(lane_cap, self.max_running_requests))
        self.lanes = [Lane(i, cap, worker.new_lane_state()) for i in range(num_lanes)]
        # Requests of launched prefill batches whose results are not processed yet: in no queue and not yet
        # running (with the overlap scheduler a whole step long), but an abort must still find them.
        self.prefilling: dict[int, Req] = {}
        self.chunked_req: Req | None = None
        # in-batch prefix caching: heads of admitted prompts whose KV reaches the tree when their batch is processed
        self.warming_heads: dict[int, tuple[int, ...]] = {}
        self.ratio = NewTokenRatio(args.schedule_conservativeness)
        self.stats = StepStats(args.decode_log_interval)
        self.eos_token_ids = worker.eos_token_ids
        self.long_rope_after: int | None = getattr(worker, "long_rope_after", None)
        self.ranks_agree = ranks_agree
        self.num_retracted = 0  # requests retracted so far (reported in internal_state)
        self.token_digest = 0  # with ranks_agree: a running hash of every token sampled, compared across ranks
        self.trace_profiler = trace_profiler or TraceProfiler()
        # Requests waiting for their grammar to compile (scheduler/grammar_queue.py). With several ranks (TP,
        # PP) the entry rank decides when each is admitted or refused and every rank follows its
        # `GrammarDecision` messages (scheduler/grammar_sync.py); a single rank polls its own queue.
        vocab_size = getattr(worker, "vocab_size", None)
        self.grammar_queue = GrammarQueue(
            lambda: make_backend(args.grammar_backend, tokenizer, vocab_size, tuple(self.eos_token_ids)),
            args.grammar_compile_timeout)
        # --enable-jump-forward (scheduler/jump_forward.py): the worker finds the forced tokens, lanes extend them
        self.jump = JumpForward(self.memory) if args.enable_jump_forward else None
        if self.jump is not None:
            worker.jump_forward = True

    def set_port(self, port: RequestPort) -> None:
        """Make `port` decide how requests enter and leave (a prefill or decode server's side of
        disaggregation); set before the first request arrives."""
        self.port = port
        self.output.held = port.holds_kv  # a request whose KV a transfer reads is released and answered by the port

    @property
    def running(self) -> list[Req]:
        """Every lane's running requests, with those waiting for a jump-forward extend (a new list; lanes own
        them)."""
        return [r for lane in self.lanes for r in (*lane.running, *lane.jumping)]

    # --- inputs --------------------------------------------------------------------------------------
    def handle(self, msg: Any, loop: LoopControl = NO_LOOP) -> None:
        if isinstance(msg, TokenizedRequest):
            self.add_request(msg)
        elif isinstance(msg, AbortRequest):
            self.abort_request(msg.rid, msg.message)
        elif isinstance(msg, TransferEvent):
            self.port.on_event(msg)
        elif isinstance(msg, GrammarDecision):
            self._admit_grammar_requests(msg)
        elif isinstance(msg, FlushCacheRequest):
            loop.settle_all()
            self.send(self.flush_cache())
        elif isinstance(msg, GetInternalStateRequest):
            loop.settle_all()  # report settled numbers (e.g. no KV held by requests that finished)
            self.send(InternalStateReply(self.internal_state(loop.info())))
        elif isinstance(msg, StartProfileRequest | StopProfileRequest):
            self.send(self.trace_profiler.handle(msg))
        else:
            raise TypeError(f"scheduler got an unknown message {type(msg).__name__}")

    def add_request(self, tr: TokenizedRequest) -> None:
        req = Req(tr.rid, tr.input_ids, tr.sampling_params, input_text=tr.input_text, stream=tr.stream,
                  return_logprob=tr.return_logprob, top_logprobs_num=tr.top_logprobs_num,
                  logprob_start_len=tr.logprob_start_len, token_ids_logprob=tr.token_ids_logprob,
                  arrival_time=tr.arrival_time,
                  eos_token_ids=self.eos_token_ids, bootstrap=tr.bootstrap)
        if self.long_rope_after is not None and len(req.origin_input_ids) > self.long_rope_after:
            req.cache_namespace = LONG_FACTOR_KEYS  # its KV is computed with the long factors (req.py)
        error = self._validate(req)
        if error is not None:
            req.abort(*error)
            self.output.emit([req])
            self.port.take(req)  # refused: the port may only tell whoever else waits for it
            return
        spec = self.grammar_queue.spec_of(req)
        if spec is not None:
            # A request with a grammar enters (the port, the waiting queue) only once its grammar compiled: a
            # disaggregated request's peer is paired and its KV reserved only for a grammar that can run (each
            # side compiles its own, both at arrival), and one that fails is refused at the door like any other.
            self.grammar_queue.add(req, spec)
            return
        self._enter(req)

    def _enter(self, req: Req) -> None:
        """A checked request (its grammar compiled, if any) goes to the port or the waiting queue."""
        taken = self.port.take(req)  # (or refused by it: then finished)
        if req.stream and not req.finished:  # the HTTP side may now start the answer as a 200 stream
            self.send(RequestAccepted(req.rid))
        if not taken:
            self.waiting_queue.append(req)

    def _refuse(self, req: Req, message: str, status: int) -> None:
        """End a request that holds nothing yet (it waited for its grammar) and tell the port, whose peer
        server holds the other half of a disaggregated request (it ends with the same status and message)."""
        req.abort(message, status)
        self.output.emit([req])
        self.port.take(req)

    def _validate(self, req: Req) -> tuple[str, int] | None:
        n = len(req.origin_input_ids)
        if n == 0:
            return "input_ids cannot be empty.", 400
        if n > self.max_req_input_len:
            return (f"The input ({n} tokens) is longer than the model's context length or KV pool "
                    f"({self.max_req_input_len} tokens).", 400)
        if req.return_logprob and not -1 <= req.logprob_start_len < n:  # the tokenizer manager checks it first
            return f"logprob_start_len ({req.logprob_start_len}) must be -1 or a prompt position below {n}.", 400
        queued = len(self.waiting_queue) + self.port.num_queued()
        if self.args.max_queued_requests is not None and queued >= self.args.max_queued_requests:
            return "The request queue is full.", 503
        # SGLang's clamp: prompt + outputs must fit the context and the KV pool (a request alone always fits)
        cap_new_tokens(req.sampling_params, new_token_room(n, min(self.context_len, self.max_total_num_tokens)))
        return None

    def abort_request(self, rid: str, message: str = "Aborted by the client.", status: int = 400) -> None:
        """Finish `rid` wherever it is, freeing its KV now (or, if a launched batch still uses it, as soon as
        that batch's results are processed). `status`: the HTTP status the answer carries."""
        for req in self.waiting_queue:
            if req.rid == rid:
                self.waiting_queue.remove(req)
                self._finish_aborted(req, message, status)
                return
        req = self.grammar_queue.remove(rid)
        if req is not None:
            self._refuse(req, message, status)
            return
        if self.chunked_req is not None and self.chunked_req.rid == rid:
            req, self.chunked_req = self.chunked_req, None
            req.is_chunked = 0
            self._finish_aborted(req, message, status)
            return
        for lane in self.lanes:
            for held in (lane.running, lane.jumping):
                for req in held:
                    if req.rid == rid:
                        held.remove(req)
                        self._finish_aborted(req, message, status)
                        return
        for req in self.prefilling.values():
            if req.rid == rid and not req.finished:  # processing its prefill's result releases it
                self._finish_aborted(req, message, status)
                return
        self.port.abort(rid, message)

    def _finish_aborted(self, req: Req, message: str, status: int = 400) -> None:
        req.abort(message, status)
        self.port.settle_reads(req, aborting=True)  # a transfer reading its KV stops first
        self.output.release(req)
        self.output.emit([req])

    # --- batch selection -----------------------------------------------------------------------------
    def get_next_batch_to_run(self, loop: LoopControl = NO_LOOP, lane: Lane | None = None) -> ScheduleBatch | None:
        """The next batch of `lane` (the first lane by default): a prefill when waiting requests fit, else a
        decode step of the lane's running requests."""
        lane = lane or self.lanes[0]
        self.port.before_schedule(lane)
        if len(self.grammar_queue) and not self.grammar_queue.lockstep:
            self._admit_grammar_requests()
        batch = self.jump.next_batch(lane, self._requeue) if self.jump is not None and lane.jumping else None
        if batch is None:
            batch = self._get_new_batch_prefill(lane)
        if batch is not None:
            lane.last_decode = None
            return batch
        if lane.running:
            batch = self._update_running_batch(lane, loop)
            if batch is not None:
                lane.last_decode = batch
            return batch
        return None

    def has_nothing_to_run(self) -> bool:
        """No request waits, is chunked or runs (requests waiting for their grammar aside)."""
        return not self.waiting_queue and self.chunked_req is None and all(not lane.running for lane in self.lanes)

    def _admit_grammar_requests(self, decision: GrammarDecision | None = None) -> None:
        """Let in requests whose grammar compiled (the port or the waiting queue); end those whose compile
        failed. A single rank polls its queue; ranks in lockstep follow the entry rank's `decision`."""
        if decision is None:
            ready, failed = self.grammar_queue.poll(idle=self.has_nothing_to_run())
        else:
            ready, failed = self.grammar_queue.follow(decision)
        for req in ready:
            self._enter(req)
        for req, reason, status in failed:
            self._refuse(req, reason, status)

    def _in_flight_prefills(self) -> list[Req]:
        """Requests of launched prefill batches that will start decoding when processed (not yet running)."""
        return [r for r in self.prefilling.values() if not r.finished and r is not self.chunked_req]

    def _get_new_batch_prefill(self, lane: Lane) -> ScheduleBatch | None:
        # A request row is free only once no launched batch uses it: with the overlap scheduler a request that
        # finished may still hold its row while riding the batch in flight, so rows can be scarcer than slots.
        # (A chunked request already holds its row and counts as one of the admitted.)
        free_rows = self.req_to_token_pool.available_size() + (self.chunked_req is not None)
        admitted = sum(other.admitted() for other in self.lanes)
        running_slots = min(self.max_running_requests - admitted, lane.cap - lane.admitted(), free_rows)
        if self.chunked_req is None and (not self.waiting_queue or running_slots <= 0):
            return None
        match = self.tree_cache.match_prefix
        order_waiting_queue(self.waiting_queue, self.args.schedule_policy, match, not self.args.disable_radix_cache,
                            warming=set(self.warming_heads.values()))
        adder = PrefillAdder(self.args.page_size, self.memory.available_tokens, self.tree_cache.inc_lock_ref,
                             self.tree_cache.dec_lock_ref, self.running + self._in_flight_prefills(), self.ratio.value,
                             self.args.max_prefill_tokens,
                             self.chunked_prefill_size, running_slots)
        if self.chunked_req is not None:
            self.port.settle_reads(self.chunked_req, aborting=False)  # its slots are re-pointed at cached ones
            self.output.cache_progress(self.chunked_req)  # its previous chunk becomes its locked prefix
            self.chunked_req.init_next_round_input(match)
            adder.add_chunked_req(self.chunked_req)
            if self.chunked_req not in adder.can_run_list:
                return None  # no room to continue it yet; let running requests decode (or retract) first
        # In-batch prefix caching at admission (both policies): a request whose uncached leading tokens are
        # being prefilled by a request admitted in this batch or still in flight waits; one step later that
        # prefix is in the tree and it is a cache hit instead of computing the same KV twice.
        heads_in_prefill = set(self.warming_heads.values())
        for req in list(self.waiting_queue):
            req.init_next_round_input(match)
            head = uncached_head(req) if not self.args.disable_radix_cache else None
            if head is not None and head in heads_in_prefill:
                continue
            if adder.add_one_req(req) is not AddResult.CONTINUE:
                break
            if head is not None:
                heads_in_prefill.add(head)
        if not adder.can_run_list:
            return None
        for req in adder.can_run_list:
            req.mark_admitted()  # queue_time, from the first admission only
            if req.retraction_count == 0 and req.req_pool_idx is None:
                req.cached_tokens = req.prefix_len
        for req in adder.can_run_list:  # prompts whose KV reaches the tree only once this batch is processed
            head = uncached_head(req)
            if head is not None:
                self.warming_heads[id(req)] = head
        admitted = {id(r) for r in adder.can_run_list}
        self.waiting_queue = [r for r in self.waiting_queue if id(r) not in admitted]
        self.chunked_req = adder.new_chunked_req
        if self.chunked_req is not None:
            self.chunked_req.is_chunked += 1
        batch = self.memory.prepare_for_extend(adder.can_run_list)
        self.stats.on_prefill(batch, len(self.waiting_queue), self.tree_cache, self.max_total_num_tokens)
        return batch

    def _update_running_batch(self, lane: Lane, loop: LoopControl) -> ScheduleBatch | None:
        if self.memory.available_tokens() < self.memory.decode_tokens_needed(lane.running):
            loop.settle(lane)  # finished requests may free enough; retraction needs settled requests
            if not lane.running:
                return None
        if self.memory.available_tokens() < self.memory.decode_tokens_needed(lane.running):
            if not self._retract(lane):
                return None  # the lane waits a round: other lanes' batches in flight hold the KV it needs
        else:
            self.ratio.decay(1 / len(self.lanes))  # one decay per round of every lane's decode
        return self.memory.prepare_for_decode(lane.running, lane.last_decode)

    def _retract(self, lane: Lane) -> bool:
        """Free KV for `lane`'s decode step by re-queueing the requests with the fewest outputs (then the
        longest prompts). Candidates: the lane's running requests and those of lanes with nothing in flight
        (settled; a launched batch's KV is in use on some stage). False when even the lane's last request does
        not fit while other lanes' batches are in flight, or while a decode server's requests on their way hold
        pre-allocated KV (they arrive, then decode or retract in turn): the lane idles until then. A last request
        that does not fit while nothing else holds KV (admission's clamp to the pool makes that unexpected) is
        ended with a 500; the scheduler keeps serving."""
        settled = [r for other in self.lanes if other is not lane and not other.launched for r in other.running]
        order = sorted([*lane.running, *settled], key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)),
                       reverse=True)
        retracted: list[Req] = []
        fits = True
        while self.memory.available_tokens() < self.memory.decode_tokens_needed(lane.running):
            victims = [r for r in order if not (len(lane.running) == 1 and r is lane.running[0])]
            if not victims:
                waits = any(other.launched for other in self.lanes if other is not lane) or \
                    self.port.holds_incoming_kv()
                if not waits:  # nothing else holds the KV it needs and never will: end it, keep serving
                    last = lane.running[0]
                    lane.running.remove(last)
                    logger.error("request %s cannot continue: the KV pool is full even after retracting every "
                                 "other request", last.rid)
                    self._finish_aborted(last, "The KV cache pool is full even after retracting every other "
                                         "request; raise --max-total-tokens.", 500)
                fits = False
                break
            req = victims[-1]
            order.remove(req)
            for each in self.lanes:
                if req in each.running:
                    each.running.remove(req)
            self.num_retracted += 1
            if self.port.retract(req):  # e.g. a decode server's: KV to host memory, resumed without recompute
                req.retraction_count += 1
                continue
            self.tree_cache.release_unfinished(req.req_pool_idx, req.kv_len, req.prefix_len, req.last_node)
            self.req_to_token_pool.free(req.req_pool_idx)
            req.reset_for_retract()
            retracted.append(req)
        if not retracted:
            return fits
        self._requeue_front(retracted)
        return fits

    def _requeue(self, req: Req) -> None:
        """Re-queue a settled request holding a row (a jumping one the KV pool cannot extend) as retracted: its
        KV is freed and its prompt and outputs are recomputed when it is admitted again."""
        self.num_retracted += 1
        self.tree_cache.release_unfinished(req.req_pool_idx, req.kv_len, req.prefix_len, req.last_node)
        self.req_to_token_pool.free(req.req_pool_idx)
        req.reset_for_retract()
        self._requeue_front([req])

    def _requeue_front(self, retracted: list[Req]) -> None:
        self.waiting_queue[:0] = reversed(retracted)  # retracted requests go first, oldest first
        self.ratio.after_retract(self.running)
        logger.warning("KV cache pool is full. Retract requests. #retracted_reqs: %d, #new_token_ratio: %.4f",
                       len(retracted), self.ratio.value)

    # --- running ------------------------------------------------------------------------------------
    def launch(self, batch: ScheduleBatch, lane: Lane | None = None) -> PreparedStepLike:
        """Prepare `batch` (planned for `lane`, the first by default) for the forward (this thread) and mark
        its requests as in flight; a decode request's newest token is then known only to the worker's token
        table until the result is processed."""
        lane = lane or self.lanes[0]
        step = self.worker.prepare(batch, lane.sampling)
        decode = batch.forward_mode.is_decode()
        for req in batch.reqs:
            req.inflight += 1
            if decode:
                req.pending_tokens += 1
            else:
                self.prefilling[id(req)] = req
        batch.launched = True
        lane.launched.append(batch)
        return step

    def process_batch_result(self, batch: ScheduleBatch, out: ForwardOutput, lane: Lane | None = None) -> None:
        """Apply `out` to `batch`, the oldest launched batch of `lane` (the first by default)."""
        lane = lane or self.lanes[0]
        if not lane.launched or lane.launched[0] is not batch:
            raise AssertionError(f"lane {lane.index}: results must be processed in launch order")
        lane.launched.popleft()
        decode = batch.forward_mode.is_decode()
        for req in batch.reqs:
            req.inflight -= 1
            if decode:
                req.pending_tokens -= 1
        if batch.forward_mode.is_extend():
            for req in batch.reqs:
                self.warming_heads.pop(id(req), None)
                if req.inflight == 0:
                    self.prefilling.pop(id(req), None)
            lane.running.extend(self.output.process_extend(batch, out))
            self.port.after_prefill(batch)
        else:
            self.output.process_decode(batch, out)
            self.stats.on_decode(batch, len(self.waiting_queue), self.tree_cache, self.max_total_num_tokens)
        lane.running = [r for r in lane.running if not r.finished and not r.forced_pending]
        if self.output.jumped:  # jump-forward: they wait for the extend of their forced tokens
            lane.jumping.extend(self.output.jumped)
            self.output.jumped.clear()
        if self.ranks_agree is not None:  # ints hash alike in every process (no hash seed)
            self.token_digest = hash((self.token_digest, tuple(r.output_ids[-1] if r.output_ids else -1
                                                                for r in batch.reqs)))

    # --- the request port's operations (a disaggregated server's side hands its requests over) -----------------
    def queue_prefill(self, req: Req) -> None:
        """Queue `req` (checked by `add_request`, then taken by the port) for prefill, as a new request."""
        self.waiting_queue.append(req)

    def find_request(self, match: Callable[[Req], bool]) -> Req | None:
        """An unfinished request the scheduler holds (waiting, chunked, being prefilled or running) that
        `match`es, or None."""
        candidates = [*self.waiting_queue, *self.running, *self.prefilling.values()]
        if self.chunked_req is not None:
            candidates.append(self.chunked_req)
        return next((r for r in candidates if not r.finished and match(r)), None)

    def free_kv_tokens(self) -> int:
        """KV slots a reservation may take now: free ones and those the prefix cache would evict."""
        return self.memory.available_tokens()

    def free_request_rows(self) -> int:
        return self.req_to_token_pool.available_size()

    def reserve_kv(self, req: Req, tokens: int, swa_tail: int | None = None) -> torch.Tensor:
        """Give `req` (not admitted anywhere) a row and KV slots for `tokens` tokens, evicting from the prefix
        cache as a batch would: for KV that arrives from elsewhere (`swa_tail`: `BatchMemory.reserve`'s). Returns
        the slots in token order; the caller checked they fit (`free_kv_tokens`, `free_request_rows`)."""
        return self.memory.reserve(req, tokens, swa_tail)

    def request_slots(self, req: Req, start: int = 0, end: int | None = None) -> torch.Tensor:
        """The KV slots (int64) of `req`'s tokens [start, end) (end: all it holds)."""
        return self.memory.slots(req, start, end)

    def free_kv(self, req: Req) -> None:
        """Free `req`'s row and KV without caching it: a request that never decoded here (its KV reserved for
        a transfer), or whose KV was copied elsewhere. Not for a request in a lane or a launched batch."""
        self.memory.free(req)

    def apply_token(self, req: Req, out: ForwardOutput) -> bool:
        """Apply the token of row 0 of `out` (id, logprobs), sampled elsewhere, to `req` as if this scheduler
        had sampled it: appended with its stop checks, then answered (streamed; or finished: its KV released
        into the cache). True when `req` goes on: then `start_running` it. A request with a grammar advances its
        matcher by the token first (the decode steps here continue the grammar from it); a token the grammar
        does not allow (the other server did not apply it) ends the request with a 500 naming it."""
        grammar = req.grammar
        if grammar is not None and not req.finished and not grammar.is_terminated():
            token = out.next_token_ids[0]
            if not grammar.accept(token):
                req.abort(f"The first token (id {token}) sampled by the prefill server is not allowed by the "
                          f"request's grammar: that server did not apply it.", 500)
                self.output.release(req)
                self.output.emit([req])
                return False
            if grammar.is_terminated():
                out.grammar_finished = {0}
        self.output.append_token(req, 0, out)
        if req.finished:
            self.output.release(req)
        self.output.emit([req])
        return not req.finished

    def start_running(self, req: Req) -> None:
        """`req` holds its row and the KV of every token but its newest (`output_ids[-1]`, the input of its
        next decode step): that token goes into the worker's token table and `req` joins the running
        requests of the least busy lane, whose next decode step extends it (no prefill)."""
        self.worker.write_tokens([req.req_pool_idx], [req.output_ids[-1]])
        min(self.lanes, key=lambda lane: (lane.admitted(), lane.index)).running.append(req)

    def emit(self, req: Req) -> None:
        """Send `req`'s news (new tokens; its finish, once set) to the detokenizer now."""
        self.output.emit([req])

    def finish(self, req: Req) -> None:
        """`req` finished outside a step (its finish reason is set, no lane holds it): its KV goes to the prefix
        cache and its row is freed (unless a launched batch or the port still holds them), and it is answered."""
        self.output.release(req)
        self.output.emit([req])

    # --- control ------------------------------------------------------------------------------------
    def is_idle(self) -> bool:
        return (not self.waiting_queue and self.chunked_req is None and all(lane.is_empty() for lane in self.lanes)
                and self.port.is_idle() and not len(self.grammar_queue))

    def check_idle_integrity(self) -> None:
        if self.is_idle():
            self.kv_memory.check_idle_integrity()
            if self.warming_heads:
                raise AssertionError(f"{len(self.warming_heads)} prefill heads still marked in flight while idle")

    def flush_cache(self) -> FlushCacheReply:
        if not self.is_idle():
            return FlushCacheReply(False, "Cache not flushed: there are running or waiting requests.")
        self.tree_cache.reset()
        return FlushCacheReply(True, "Cache flushed.")

    def internal_state(self, loop_info: dict[str, Any] | None = None) -> dict[str, Any]:
        """The scheduler's state (pools, queues, counters), with the driving loop's `loop_info` merged in."""
        return scheduler_state(self, loop_info)
