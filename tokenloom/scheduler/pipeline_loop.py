"""`PipelineLoop`: the event loop of one pipeline stage (`--pp-size` > 1), behind the same `EventLoop` protocol.

Every stage runs a full `Scheduler` over its own layers' `KVMemory` (capacities MIN-reduced over the world at
start) with L = pp_size + `--pp-async-batch-depth` micro-batch lanes (scheduler/lane.py). Stage 0 reads the
requests and every stage handles the same messages at the same iteration and applies the same sampled tokens
at the same iteration, so every stage makes the same decisions (admission, chunking, retraction, aborts) and
holds the same requests in the same lanes; nothing else is exchanged to keep them in step.

Iteration t on stage s, lane mb = t % L, nxt = (t + 1) % L. The order follows SGLang's `event_loop_pp`
(sglang/srt/managers/scheduler_pp_mixin.py; async sends and --pp-async-batch-depth came with SGLang #11852),
with two send optimizations, each on by default and each with an environment switch for the benchmark: the
early output send (the last stage's output leaves for stage 0 as soon as its forward ends) and overlapped
sends (a send is posted right behind the step that produced it, so sends and the next receives overlap the
forward; SGLang #7979 proposed overlapping PP sends and receives, #33705 posting the proxy send behind the
next forward):
1. requests: stage 0 drains its inbox; every other stage receives the list from s - 1; every non-last stage
   sends it on (the list is sent even when empty, so the stages iterate in step): at once when it holds
   messages (before handling them: a state report gathers over every stage), else after step 5's submit,
   so that its send (up to ~5 ms on a loaded host) is off the critical path from a lane's output to its
   next forward (s + 1 needs the list only before this iteration's proxy). Aborts and control
   requests thus reach every stage at the same iteration (SGLang #28881: a per-stage abort desynchronised
   stages). A cache flush waits until no lane has a batch in flight, scheduling nothing new meanwhile (every
   stage drains alike); a state report is answered at once, as things stand (in-flight prefills count as
   running).
2. every stage schedules lane mb and launches its batch (`Scheduler.launch`: prepare on this thread).
3. last stage, depth > 0: send stage 0 the output of the batch launched at iteration t - depth.
4. non-first stages with a batch: receive its proxy (hidden states, residual) from s - 1 (blocking).
5. submit the step to the executor (the last stage forwards and samples; others only forward). With
   `early_output_send` (the early output send) at depth 0 the executor sends the last stage's output to
   stage 0 right after sampling; with `overlap_sends` (overlapped sends) a non-last stage's executor sends
   the proxy to s + 1 right after the forward. Such a send is queued behind its step, as an isend on a CUDA forward
   stream is, and the scheduling thread never waits for the step: it goes on to step 7 and the next
   iteration's receives while the forward runs.
6. lane nxt's oldest batch (launched at t + 1 - L): stage 0 receives its output from the last stage; a
   middle stage receives it from s - 1 and sends it on unless s + 1 is the last; the last stage has it.
   Stage 0 records the tokens in its token table (it embeds them next); every stage then processes the
   result (`process_batch_result`). So a lane is scheduled again only after its result was applied: a lane
   never has pending tokens under PP.
7. the sends the executor does not do: the last stage's output at depth 0 with the early output send off
   (after step 6's processing); a non-last stage's proxy with overlapped sends off (the scheduling thread
   waits for the forward).
With `overlap_sends` off (for the benchmark) a stage also waits at the end of each iteration until every
message it sent in it was received, so sends never overlap the next receives.

Channels (distributed/pp_channel.py), one per message type, each on its own gloo tag: requests (s -> s + 1),
proxy (s -> s + 1), output (last -> 0 -> 1 -> ... -> pp - 2); one object per direction, each used by one
thread. Each is a chain, one message per channel per exchange, at most one send in flight per channel (an
executor-side send waits for its channel's previous message, never for a later step). No cycle of waits: a
stage's iteration t waits only on other stages' iterations <= t, and on a send of iteration t' completing,
which needs the receiver to reach iteration t' (requests, proxy) or t' + L - 1 - depth (output, received by
stage 0 L - 1 iterations after the batch launched; the last stage sends it at iteration t' + depth and stage 0
reaching t' + L - 1 needs only the last stage's iteration t' + depth - 1). Checked at depth 0, 1, 2 and pp 2,
3 in tests/integration/test_pipeline_loop.py.

Memory safety of chunked prefill: a chunk's KV can be inserted into the prefix cache (and duplicate slots
freed) while that chunk still runs on later stages; safe because every stage executes its batches in
launch order (one executor per stage), so a freed slot's next owner writes it after.
A dead neighbour fails the stage's channel at once (`PPChannelError`); a hung one is bounded by
--dist-timeout and named by the heartbeat (entrypoints/scheduler_process.py). A forward of this stage that never returns
(including the sends queued behind it) trips the stage's watchdog through the executor's `StepGuard`.
"""

from __future__ import annotations

import os
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from tokenloom.distributed.parallel_state import ParallelContext
from tokenloom.distributed.pp_channel import PPChannel
from tokenloom.executor.forward_thread import ForwardOnCaller, ForwardThread
from tokenloom.executor.worker import ForwardOutput, ForwardResult, ModelWorker, PreparedStep
from tokenloom.protocol import FlushCacheRequest
from tokenloom.scheduler.lane import Lane
from tokenloom.scheduler.loop_base import Inbox, LoopBase, serve_with_executor
from tokenloom.scheduler.schedule_batch import ScheduleBatch
from tokenloom.scheduler.scheduler import Scheduler
from tokenloom.scheduler.step_profile import StepProfiler, StepTiming

REQUESTS_TAG, PROXY_TAG, OUTPUT_TAG = 11, 12, 13  # gloo tags of the three channels
EARLY_OUTPUT_SEND_ENV = "TOKENLOOM_PP_EARLY_OUTPUT_SEND"  # "0": the early output send off (benchmarks)
OVERLAP_SENDS_ENV = "TOKENLOOM_PP_OVERLAP_SENDS"  # "0": overlapped sends off (benchmarks)


def send_options(environ: dict[str, str] | None = None) -> dict[str, bool]:
    """The two send optimizations (early output send, overlapped sends), each on unless the environment turns
    it off (for bench/pipeline.py)."""
    env = os.environ if environ is None else environ
    return {"early_output_send": env.get(EARLY_OUTPUT_SEND_ENV, "1") != "0",
            "overlap_sends": env.get(OVERLAP_SENDS_ENV, "1") != "0"}


@dataclass
class StageChannels:
    """The point-to-point channels of one stage, one object per direction (None where the stage does not
    use it), so that each is used by one thread only: the requests channel and every receiving channel by the
    scheduling thread; `proxy_out` and the last stage's `output_out` by whichever thread the loop's options
    give them to (the executor when sends queue behind the forward)."""

    requests: PPChannel | None  # s -> s + 1 (both directions on one object: the scheduling thread's)
    proxy_in: PPChannel | None  # s - 1 -> s
    proxy_out: PPChannel | None  # s -> s + 1
    output_in: PPChannel | None  # last -> 0, then s - 1 -> s up to pp - 2
    output_out: PPChannel | None  # last -> 0 (the ring), s -> s + 1 below pp - 2

    @classmethod
    def build(cls, ctx: ParallelContext) -> StageChannels:
        first, last = ctx.is_first_stage, ctx.is_last_stage
        prev, nxt = ctx.pp_prev_rank, ctx.pp_next_rank
        group = ctx.world_cpu_group

        def channel(send: int | None, recv: int | None, tag: int) -> PPChannel | None:
            return None if send is None and recv is None else PPChannel(group, send, recv, wire_tag=tag)

        forwards_output = not last and ctx.pp_rank + 1 < ctx.pp_size - 1
        return cls(requests=channel(None if last else nxt, None if first else prev, REQUESTS_TAG),
                   proxy_in=channel(None, None if first else prev, PROXY_TAG),
                   proxy_out=channel(None if last else nxt, None, PROXY_TAG),
                   output_in=channel(None, None if last else prev, OUTPUT_TAG),
                   output_out=channel(nxt if last or forwards_output else None, None, OUTPUT_TAG))

    @property
    def forwards_output(self) -> bool:
        """A stage below pp - 2 passes each output it receives on to the next stage."""
        return self.output_in is not None and self.output_out is not None


class PipelineLoop(LoopBase):
    def __init__(self, scheduler: Scheduler, inbox: Inbox | None, channels: StageChannels, ctx: ParallelContext,
                 executor: ForwardThread | ForwardOnCaller, depth: int = 0, *, early_output_send: bool = True,
                 overlap_sends: bool = True, profiler: StepProfiler | None = None) -> None:
        super().__init__(scheduler, inbox, profiler)
        if len(scheduler.lanes) != ctx.pp_size + depth:
            raise ValueError(f"the scheduler has {len(scheduler.lanes)} lanes; a pipeline of {ctx.pp_size} stages "
                             f"at depth {depth} needs {ctx.pp_size + depth}")
        if ctx.is_first_stage != (inbox is not None):
            raise ValueError("exactly the first stage reads an inbox")
        self.channels = channels
        self.ctx = ctx
        self.executor = executor
        self.depth = depth
        self.early_output_send = early_output_send
        self.overlap_sends = overlap_sends
        # Which sends the executor posts, right behind the step that produced them (the scheduling thread
        # does not wait for that step): the last stage's outputs at depth 0 with the early output send, every
        # proxy with overlapped sends. The others are posted by the scheduling thread.
        self.executor_sends_output = ctx.is_last_stage and depth == 0 and early_output_send
        self.executor_sends_proxy = not ctx.is_last_stage and overlap_sends
        self.worker: ModelWorker = scheduler.worker  # type: ignore[assignment]
        self.iteration = 0
        self.pending_controls: list[Any] = []
        self._steps: dict[int, PreparedStep] = {}  # stage 0: launched steps, to record their tokens
        self._timings: dict[int, StepTiming] = {}
        self._forwards: dict[int, Future] = {}  # each launched batch's step on the executor, until processed
        self._unsent: deque[tuple[int, ScheduleBatch]] = deque()  # last stage: outputs the loop still sends
        # this stage's own forwards (prefill: per token; decode: per step), and its waits on the others
        self.totals.update({"stage_forward_s": 0.0, "stage_prefill_s": 0.0, "stage_prefill_tokens": 0,
                            "stage_decode_s": 0.0, "stage_decode_steps": 0, "stage_decode_reqs": 0,
                            "recv_wait_s": 0.0, "send_wait_s": 0.0, "forward_wait_s": 0.0, "iterations": 0})

    # --- LoopControl ----------------------------------------------------------------------------------
    def settle(self, lane: Lane) -> None:
        """A lane is scheduled only after its result was processed: nothing of it is in flight."""
        if lane.launched:
            raise AssertionError(f"lane {lane.index} has a batch in flight while it is scheduled")

    def settle_all(self) -> None:
        """Nothing to do here: a cache flush is handled only once no lane has a batch in flight (`run_once`
        defers it), and a state report is taken as it stands at this iteration, the same on every stage (a
        drain per report would stall the pipeline for pp + depth - 1 iterations each time /metrics or a
        router's load poll asks)."""

    def info(self) -> dict:
        """The loop's state, with every stage's pools and counters (`pp_stages`, gathered over the world:
        called only while handling a get-internal-state request, which every rank does at the same
        iteration)."""
        return {"overlap_schedule": "pipeline", "pp_size": self.ctx.pp_size, "pp_rank": self.ctx.pp_rank,
                "pp_async_batch_depth": self.depth, "pp_lanes": len(self.scheduler.lanes),
                "pp_early_output_send": self.early_output_send, "pp_overlap_sends": self.overlap_sends,
                "pp_stages": self._gather_stages(), **super().info()}

    def _gather_stages(self) -> list[dict]:
        sched = self.scheduler
        mine = {"rank": self.ctx.rank, "pp_rank": self.ctx.pp_rank, "tp_rank": self.ctx.tp_rank,
                "layers": (sched.kv_memory.kv_pool.start_layer, sched.kv_memory.kv_pool.end_layer),
                "max_total_num_tokens": sched.max_total_num_tokens,
                "available_kv_tokens": sched.allocator.full_available_size(),
                "evictable_kv_tokens": sched.tree_cache.evictable_size(),
                "free_request_slots": sched.req_to_token_pool.available_size(),
                "num_running_reqs": len(sched.running), "num_waiting_reqs": len(sched.waiting_queue),
                "num_retracted_reqs": sched.num_retracted, **self.totals}
        gathered: list[Any] = [None] * self.ctx.world_size
        dist.all_gather_object(gathered, mine, group=self.ctx.world_cpu_group)
        return gathered

    # --- the loop -------------------------------------------------------------------------------------
    def run_once(self, timeout_ms: int = 0) -> bool:
        sched, lanes, ctx = self.scheduler, self.scheduler.lanes, self.ctx
        t = self.iteration
        lane, nxt = lanes[t % len(lanes)], lanes[(t + 1) % len(lanes)]
        in_flight = any(each.launched for each in lanes)
        messages = self._take_requests(0 if in_flight or not sched.is_idle() else timeout_ms)
        if messages:  # before handling them: a state report gathers over every stage
            self._pass_requests_on(messages)
        start = time.perf_counter()
        for msg in messages:
            if isinstance(msg, FlushCacheRequest):
                self.pending_controls.append(msg)
            else:
                sched.handle(msg, self)
        if self.pending_controls and not in_flight:  # drained: every stage answers at this same iteration
            controls, self.pending_controls = self.pending_controls, []
            for msg in controls:
                sched.handle(msg, self)
        batch = None if self.pending_controls else sched.get_next_batch_to_run(self, lane)
        schedule_s = time.perf_counter() - start
        if ctx.is_last_stage and self.depth > 0:
            self._send_outputs(t - self.depth)
        if batch is not None:
            start = time.perf_counter()
            step = sched.launch(batch, lane)
            self._timings[id(batch)] = StepTiming(schedule=schedule_s, prepare=time.perf_counter() - start,
                                                  batch_size=batch.batch_size, is_decode=batch.forward_mode.is_decode())
            proxy = None if ctx.is_first_stage else self._recv(self.channels.proxy_in, "proxy")
            self._forwards[id(batch)] = self._submit(step, proxy)
            if ctx.is_first_stage:
                self._steps[id(batch)] = step
            if ctx.is_last_stage and not self.executor_sends_output:
                self._unsent.append((t, batch))
        if not messages:  # after the launch: the next stage needs the list only before this batch's proxy
            self._pass_requests_on(messages)
        if nxt.launched:
            self._apply_result(nxt)
        if ctx.is_last_stage and self.depth == 0:
            self._send_outputs(t)  # early output send off: this step's output, after the processing above
        if batch is not None and not ctx.is_last_stage and not self.executor_sends_proxy:
            self._send(self.channels.proxy_out, "proxy", self._wait(self._forwards[id(batch)]).proxy)
        if not self.overlap_sends:  # overlapped sends off: this iteration's sends complete before the next receives
            for channel in (self.channels.requests, self.channels.output_out, self.channels.proxy_out):
                if channel is not None and not (channel is self.channels.output_out and self.executor_sends_output):
                    self._wait_sent(channel)
        self.iteration += 1
        self.totals["iterations"] += 1
        busy = batch is not None or any(each.launched for each in lanes) or bool(messages)
        if not busy and sched.is_idle() and not self.pending_controls:
            self._went_idle()
        return busy

    def _take_requests(self, timeout_ms: int) -> list[Any]:
        if self.ctx.is_first_stage:
            return self.inbox.recv_all(timeout_ms)
        return self._recv(self.channels.requests, "requests")["messages"]

    def _pass_requests_on(self, messages: list[Any]) -> None:
        if not self.ctx.is_last_stage:
            self._send(self.channels.requests, "requests", {"messages": messages})

    def _submit(self, step: PreparedStep, proxy: dict | None) -> Future:
        """Queue the step on the executor; where the executor posts the step's send, it does so right after
        the step (stream order, as a CUDA isend on the forward stream would be), off the scheduling thread."""
        worker, wait_each = self.worker, not self.overlap_sends
        if self.ctx.is_last_stage:
            output_out = self.channels.output_out if self.executor_sends_output else None

            def last_stage(s: PreparedStep) -> ForwardOutput:
                out = worker.sample(s, worker.forward(s, proxy))
                if output_out is not None:
                    output_out.isend("output", {"out": out})
                    if wait_each:
                        output_out.wait_send()
                return out

            return self.executor.submit(step, last_stage)
        proxy_out = self.channels.proxy_out if self.executor_sends_proxy else None

        def stage(s: PreparedStep) -> ForwardResult:
            res = worker.forward(s, proxy)
            if proxy_out is not None:
                proxy_out.isend("proxy", res.proxy)  # the send handle keeps the tensors until received
                res.proxy = None
            return res

        return self.executor.submit(step, stage)

    def _send_outputs(self, upto: int) -> None:
        """Last stage: send stage 0 the outputs of the batches launched at iterations <= `upto`, in order
        (those the executor does not send itself)."""
        while self._unsent and self._unsent[0][0] <= upto:
            _, batch = self._unsent.popleft()
            out: ForwardOutput = self._wait(self._forwards[id(batch)])
            self._send(self.channels.output_out, "output", {"out": out})

    def _apply_result(self, lane: Lane) -> None:
        batch = lane.launched[0]
        done = self._wait(self._forwards.pop(id(batch)))  # this stage's step of it (long done, but for errors)
        if self.ctx.is_last_stage:
            out: ForwardOutput = done
            self._count_forward(batch, out.forward_s + out.sample_s)
        else:
            self._count_forward(batch, done.forward_s)
            payload = self._recv(self.channels.output_in, "output")
            if self.channels.forwards_output:
                self._send(self.channels.output_out, "output", payload)
            out = payload["out"]
        if self.ctx.is_first_stage:
            self.worker.record_tokens(self._steps.pop(id(batch)), out.next_token_ids)
        self._finish_step(batch, out, self._timings.pop(id(batch)), lane)

    def _count_forward(self, batch: ScheduleBatch, seconds: float) -> None:
        totals = self.totals
        totals["stage_forward_s"] += seconds
        if batch.forward_mode.is_decode():
            totals["stage_decode_s"] += seconds
            totals["stage_decode_steps"] += 1
            totals["stage_decode_reqs"] += batch.batch_size
        else:
            totals["stage_prefill_s"] += seconds
            totals["stage_prefill_tokens"] += int((batch.seq_lens - batch.prefix_lens).sum())

    # --- timed waits (scheduling thread) ---------------------------------------------------------------
    def _recv(self, channel: PPChannel | None, tag: str) -> dict:
        start = time.perf_counter()
        payload = channel.recv(tag)
        self.totals["recv_wait_s"] += time.perf_counter() - start
        return payload

    def _send(self, channel: PPChannel | None, tag: str, payload: dict) -> None:
        start = time.perf_counter()
        channel.isend(tag, payload)  # waits for the channel's previous message first
        self.totals["send_wait_s"] += time.perf_counter() - start

    def _wait_sent(self, channel: PPChannel) -> None:
        start = time.perf_counter()
        channel.wait_send()
        self.totals["send_wait_s"] += time.perf_counter() - start

    def _wait(self, future: Future) -> Any:
        start = time.perf_counter()
        result = future.result()
        self.totals["forward_wait_s"] += time.perf_counter() - start
        return result

    def run_forever(self) -> None:
        serve_with_executor(self.executor, super().run_forever)
