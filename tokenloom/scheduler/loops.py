"""Event loops: the order in which a scheduler receives, schedules, runs and processes.

Every loop implements `EventLoop`: `run_once()` does one iteration and says whether it did any work;
`run_forever()` repeats, sleeping on the inbox when idle. The pipeline and disaggregation loops of later
issues implement the same protocol around the same `Scheduler`.

- `NormalLoop`: receive → schedule → prepare → forward → process, each step to completion.
- `OverlapLoop` ("zero-overhead" scheduling, as SGLang's overlap scheduler): the forward runs on a
  `ForwardThread`; after launching batch k+1 the loop processes batch k's results while k+1 computes, so the
  forward never waits for the scheduler. Batch k+1 is planned before k's tokens are known (its inputs are
  read from the worker's token table on the forward side, executor/token_table.py). Its policy decides,
  step by step, whether to keep one batch in flight (overlap) or to process each batch right after
  launching it; in the scheduler process (a `ForwardOnCaller`), a stretch of the latter runs entirely on
  the forward's thread, as the normal loop's steps do.

`make_event_loop(args, scheduler, inbox)` picks the loop for `--overlap-schedule on|off|auto`.
At tp_size > 1 every rank runs the same loop in lockstep: the inbox is a `rank_sync.BroadcastInbox` (one
broadcast per iteration) and the adaptive policy a `BroadcastOverlap` (rank 0 decides); these collectives
run on the scheduling thread's control group, the forward's on the compute group (the forward thread).

Every loop's forwards run through one `StepGuard` (executor/forward_thread.py): the normal loop's inline, the
others' in their executor; with a `watchdog` (the rank's `ForwardWatchdog`, `--watchdog-timeout`) the guard
marks each step's start and end, and under `--cpu-threads-policy adaptive` (the default) it sets the step's
thread count to the cores other processes leave free (executor/cpu_threads.py). Every processed step
(`_finish_step`) also steps the scheduler's `TraceProfiler` (/start_profile, scheduler/profiler.py).
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future

import torch

from tokenloom.config import ServerArgs
from tokenloom.distributed.parallel_state import SINGLE_PROCESS, ParallelContext
from tokenloom.executor.cpu_threads import adaptive_threads
from tokenloom.executor.forward_thread import ForwardOnCaller, ForwardThread, StepGuard, StepMarks
from tokenloom.executor.worker import ForwardOutput
from tokenloom.scheduler.lane import Lane
from tokenloom.scheduler.loop_base import IDLE_POLL_MS, EventLoop, Inbox, LoopBase, serve_with_executor
from tokenloom.scheduler.overlap_policy import AdaptiveOverlap, FixedOverlap
from tokenloom.scheduler.pipeline_loop import PipelineLoop, StageChannels, send_options
from tokenloom.scheduler.rank_sync import BroadcastOverlap
from tokenloom.scheduler.schedule_batch import ScheduleBatch
from tokenloom.scheduler.scheduler import Scheduler
from tokenloom.scheduler.step_profile import StepProfiler, StepTiming, profiling_requested


class NormalLoop(LoopBase):
    """Receive → schedule → run → process, each step to completion (no overlap)."""

    def __init__(self, scheduler: Scheduler, inbox: Inbox, profiler: StepProfiler | None = None,
                 guard: StepGuard | None = None) -> None:
        super().__init__(scheduler, inbox, profiler)
        self.guard = guard or StepGuard.from_env()

    def run_once(self, timeout_ms: int = 0) -> bool:
        return self._step_to_completion(timeout_ms, lambda step: self.guard.run(self.scheduler.worker.execute, step))

    def info(self) -> dict:
        return {"overlap_schedule": "off", "overlap_active": False, **super().info()}


class OverlapLoop(LoopBase):
    """Launch batch k+1 on the forward thread, then process batch k while k+1 computes."""

    def __init__(self, scheduler: Scheduler, inbox: Inbox, policy: FixedOverlap | AdaptiveOverlap | BroadcastOverlap,
                 forward_thread: ForwardThread | ForwardOnCaller, profiler: StepProfiler | None = None) -> None:
        super().__init__(scheduler, inbox, profiler)
        self.policy = policy
        self.forward_thread = forward_thread
        self.inflight: deque[tuple[ScheduleBatch, Future[ForwardOutput], StepTiming]] = deque()

    def run_once(self, timeout_ms: int = 0) -> bool:
        batch, schedule_s = self._receive_and_schedule(0 if self.inflight else timeout_ms)
        overlap = self.policy.overlap_now()
        if batch is not None:
            start = time.perf_counter()
            step = self.scheduler.launch(batch)
            timing = StepTiming(schedule=schedule_s, prepare=time.perf_counter() - start,
                                batch_size=batch.batch_size, is_decode=batch.forward_mode.is_decode(),
                                overlapped=overlap)
            self.inflight.append((batch, self.forward_thread.submit(step), timing))
        elif not self.inflight:
            self._went_idle()
            return False
        keep = 1 if overlap and batch is not None else 0
        while len(self.inflight) > keep:
            self._process_oldest()
        return True

    def _process_oldest(self) -> None:
        batch, future, timing = self.inflight.popleft()
        self._finish_step(batch, future.result(), timing)

    def drain(self) -> None:
        """Process every launched batch (for decisions that need settled requests)."""
        while self.inflight:
            self._process_oldest()

    def settle(self, lane: Lane) -> None:
        """`LoopControl`: retraction needs the (one) lane's requests settled."""
        self.drain()

    def settle_all(self) -> None:
        """`LoopControl`: the scheduler's cache flush and state report need settled requests."""
        self.drain()

    def _on_step(self, timing: StepTiming) -> None:
        self.policy.record(timing)

    def run_forever(self) -> None:
        serve_with_executor(self.forward_thread, self._schedule_forever)

    def _schedule_forever(self) -> None:
        """`run_once` over and over; with a `ForwardOnCaller`, each stretch in which the policy says not to
        overlap runs on the serving thread itself (`_steps_to_completion`): the forward stays on the thread
        that owns the OpenMP team, and the steps pay no hand-off between two threads (two thread wake-ups a
        step; ~1% of a batch-1 step of the default model, inside the noise), so the policy's "normal" is the
        normal loop it is compared with. At tp_size > 1 every rank takes the same branches (the in-flight
        count and the broadcast decision are the same on every rank), so their collectives stay in step."""
        executor = self.forward_thread
        busy = True
        while True:
            if isinstance(executor, ForwardOnCaller) and not self.inflight and not self.policy.overlap_now():
                busy = executor.call(lambda busy=busy: self._steps_to_completion(busy)).result()
            else:
                busy = self.run_once(0 if busy else IDLE_POLL_MS)

    def _steps_to_completion(self, busy: bool) -> bool:
        """On the serving thread: steps run to completion, as the normal loop's, until the policy wants
        overlap again; returns whether the last iteration did work."""
        execute = self.forward_thread.execute_here
        while True:
            busy = self._step_to_completion(0 if busy else IDLE_POLL_MS, execute)
            if self.policy.overlap_now():
                return busy

    def info(self) -> dict:
        wall = time.perf_counter() - self._started
        idle = max(0.0, 1.0 - self.forward_thread.busy_s / wall) if wall > 0 else 0.0
        return {**self.policy.info(), "forward_thread_idle_fraction": idle, **super().info()}


def overlap_mode(args: ServerArgs) -> str:
    """`--disable-overlap-schedule` (SGLang's spelling) wins over `--overlap-schedule`."""
    return "off" if args.disable_overlap_schedule else args.overlap_schedule


def make_event_loop(args: ServerArgs, scheduler: Scheduler, inbox: Inbox, forward_on_caller: bool = False,
                    parallel: ParallelContext = SINGLE_PROCESS, watchdog: StepMarks | None = None) -> EventLoop:
    """`forward_on_caller`: the overlap loop's forwards run on the thread that calls `run_forever()` (the
    scheduler process's main thread) and scheduling on a new thread; otherwise on a dedicated thread, so a
    caller can drive `run_once()` itself (tests). At tp_size > 1 the adaptive policy's decisions are TP
    rank 0's, broadcast (`rank_sync.BroadcastOverlap`); `inbox` must then be a `BroadcastInbox`. At
    pp_size > 1 every stage runs a `PipelineLoop` (scheduler/pipeline_loop.py); only stage 0 has an inbox.
    `watchdog`: the rank's `ForwardWatchdog`, told of every step's start and end."""
    profiler = StepProfiler(profiling_requested(args.enable_step_profile))
    threads = adaptive_threads(args.cpu_threads_policy, args.device.split(":")[0],
                               args.num_threads if args.num_threads is not None else torch.get_num_threads())
    guard = StepGuard.from_env(watchdog, threads)
    if parallel.pp_size > 1:  # the pipeline overlaps by itself: --overlap-schedule does not apply
        executor = (ForwardOnCaller(scheduler.worker, guard) if forward_on_caller
                    else ForwardThread(scheduler.worker, args.num_threads, guard))
        loop: LoopBase = PipelineLoop(scheduler, inbox, StageChannels.build(parallel), parallel, executor,
                                      args.pp_async_batch_depth, profiler=profiler, **send_options())
    elif (mode := overlap_mode(args)) == "off":
        loop = NormalLoop(scheduler, inbox, profiler, guard)
    else:
        loop = _overlap_loop(args, scheduler, inbox, parallel, forward_on_caller, profiler, guard, mode)
    loop.cpu_threads = threads
    return loop


def _overlap_loop(args: ServerArgs, scheduler: Scheduler, inbox: Inbox, parallel: ParallelContext,
                  forward_on_caller: bool, profiler: StepProfiler, guard: StepGuard, mode: str) -> OverlapLoop:
    policy: FixedOverlap | AdaptiveOverlap | BroadcastOverlap = FixedOverlap(True) if mode == "on" \
        else AdaptiveOverlap()
    if mode == "auto" and parallel.tp_size > 1:
        policy = BroadcastOverlap(policy, parallel)
    executor = (ForwardOnCaller(scheduler.worker, guard) if forward_on_caller
                else ForwardThread(scheduler.worker, args.num_threads, guard))
    return OverlapLoop(scheduler, inbox, policy, executor, profiler)
