"""What every event loop shares (loops.py: normal and overlap; pipeline_loop.py: one pipeline stage).

`EventLoop` is the protocol a scheduler process drives (`run_once`, `run_forever`); `Inbox` is where a loop
receives its messages; `LoopBase` receives and schedules, processes a step's results and accounts its timing,
and runs the scheduler's integrity check once per idle period (its `info()`, /get_server_info's loop part,
also gives the adaptive policy's current `forward_threads` and `forward_thread_changes`);
`serve_with_executor` runs a loop's scheduling side beside an executor that serves forwards on the calling
thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from tokenloom.device import keep_this_thread_single_threaded
from tokenloom.executor.cpu_threads import AdaptiveThreads
from tokenloom.executor.forward_thread import ForwardOnCaller, ForwardThread
from tokenloom.executor.worker import ForwardOutput, PreparedStep
from tokenloom.scheduler.lane import Lane
from tokenloom.scheduler.schedule_batch import ScheduleBatch
from tokenloom.scheduler.scheduler import Scheduler
from tokenloom.scheduler.step_profile import StepProfiler, StepTiming

IDLE_POLL_MS = 100


class Inbox(Protocol):
    def recv_all(self, timeout_ms: int = 0) -> list[Any]: ...


class EventLoop(Protocol):
    def run_once(self, timeout_ms: int = 0) -> bool: ...

    def run_forever(self) -> None: ...


class LoopBase:
    """What every loop shares: receiving and scheduling, processing a step's results with its timing and
    counters, the idle integrity check, and `LoopControl` for a loop with nothing in flight while it plans."""


    def __init__(self, scheduler: Scheduler, inbox: Inbox, profiler: StepProfiler | None = None) -> None:
        self.scheduler = scheduler
        self.inbox = inbox
        self.profiler = profiler or StepProfiler(enabled=False)
        self._last_end: dict[int, float] = {}  # per lane: when its previous result was processed
        self._idle_checked = False  # the integrity check runs once per idle period, not on every idle poll
        self._started = time.perf_counter()
        # Cumulative counters (benchmarks take differences): forward+sample time, scheduler CPU time outside
        # the forward, and decode steps with their summed periods.
        self.totals = {"forward_busy_s": 0.0, "scheduler_cpu_s": 0.0, "decode_steps": 0, "decode_period_s": 0.0,
                       "decode_tokens": 0}
        # the rank's adaptive thread count (`make_event_loop` sets it; None under the fixed policy)
        self.cpu_threads: AdaptiveThreads | None = None

    def _receive_and_schedule(self, timeout_ms: int) -> tuple[ScheduleBatch | None, float]:
        messages = self.inbox.recv_all(timeout_ms)
        if messages:
            self._idle_checked = False
        start = time.perf_counter()  # waiting on an empty inbox is not scheduling work
        for msg in messages:
            self.scheduler.handle(msg, self)
        batch = self.scheduler.get_next_batch_to_run(self)
        return batch, time.perf_counter() - start

    def _step_to_completion(self, timeout_ms: int, execute: Callable[[PreparedStep], ForwardOutput]) -> bool:
        """One iteration that runs its step to completion: receive, schedule, launch, `execute`, process.
        False when there was nothing to run."""
        batch, schedule_s = self._receive_and_schedule(timeout_ms)
        if batch is None:
            self._went_idle()
            return False
        start = time.perf_counter()
        step = self.scheduler.launch(batch)
        timing = StepTiming(schedule=schedule_s, prepare=time.perf_counter() - start, batch_size=batch.batch_size,
                            is_decode=batch.forward_mode.is_decode())
        self._finish_step(batch, execute(step), timing)
        return True

    def _finish_step(self, batch: ScheduleBatch, out: ForwardOutput, timing: StepTiming,
                     lane: Lane | None = None) -> None:
        """Process `batch`'s results (of `lane`, the first by default) and account its timing; a decode step's
        period is the time since the same lane's previous result (one token of its requests)."""
        start = time.perf_counter()
        self._idle_checked = False
        self.scheduler.process_batch_result(batch, out, lane)
        end = time.perf_counter()
        timing.process = end - start
        timing.forward, timing.sample = out.forward_s, out.sample_s
        key = 0 if lane is None else lane.index
        previous = self._last_end.get(key)
        timing.period = end - previous if previous is not None else 0.0
        self._last_end[key] = end
        totals = self.totals
        totals["forward_busy_s"] += timing.forward + timing.sample
        totals["scheduler_cpu_s"] += timing.cpu_outside_forward
        if timing.is_decode and timing.period > 0:
            totals["decode_steps"] += 1
            totals["decode_period_s"] += timing.period
            totals["decode_tokens"] += timing.batch_size
        self.profiler.record(timing)
        self.scheduler.trace_profiler.step_done()
        self._on_step(timing)

    def _on_step(self, timing: StepTiming) -> None:
        pass

    def _went_idle(self) -> None:
        self._last_end.clear()
        if not self._idle_checked:  # walking the tree and the free lists costs ms on a large pool
            self._idle_checked = True
            self.scheduler.check_idle_integrity()

    def settle(self, lane: Lane) -> None:
        """`LoopControl`: nothing is in flight while this loop plans (each step runs to completion)."""

    def settle_all(self) -> None:
        """`LoopControl`: nothing is in flight while this loop plans (each step runs to completion)."""

    def info(self) -> dict:
        threads = self.cpu_threads
        return {"step_profile": self.profiler.summary(), "loop_wall_s": time.perf_counter() - self._started,
                **({"forward_threads": threads.threads, "forward_thread_changes": threads.changes,
                    "forward_threads_bound": threads.placement is not None and threads.placement.bound}
                   if threads is not None else {}),
                **self.totals}

    def run_forever(self) -> None:
        busy = True
        while True:
            busy = self.run_once(0 if busy else IDLE_POLL_MS)


def serve_with_executor(executor: ForwardThread | ForwardOnCaller, schedule_forever: Callable[[], None]) -> None:
    """Run `schedule_forever` (a loop's scheduling side). With a `ForwardOnCaller`, this thread serves the
    forward steps and scheduling runs on a new thread; an error on either side ends both and is raised here."""
    if not isinstance(executor, ForwardOnCaller):
        schedule_forever()
        return
    errors: list[BaseException] = []

    def schedule() -> None:
        keep_this_thread_single_threaded()
        try:
            schedule_forever()
        except BaseException as e:  # noqa: BLE001 - re-raised on the serving thread
            errors.append(e)
        finally:
            executor.stop()

    threading.Thread(target=schedule, name="tokenloom-scheduler", daemon=True).start()
    executor.serve_forever()
    raise errors[0] if errors else RuntimeError("the scheduling thread stopped")
