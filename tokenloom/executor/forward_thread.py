"""Forward executors: run prepared steps one after another, off the scheduler's critical path.

- `ForwardThread`: a dedicated worker thread (tests and in-process harnesses drive the loop themselves).
- `ForwardOnCaller`: steps queue up for the thread that calls `serve_forever()` — in the scheduler process
  the main thread, while the scheduling loop moves to a second thread. On the CPU this matters: the main
  thread owns the OpenMP team the model was loaded and warmed up with; a forward on another thread starts
  a second team, and with more OpenMP threads than cores libgomp throttles its spin-waits, which made every
  forward 10-25% slower in bench/overlap.py.

torch releases the GIL inside its ops, so while this thread computes batch k the scheduler thread plans
batch k+1 and processes batch k-1's results. Steps run strictly in submission order (one worker), which is
what makes reading decode inputs from the token table (executor/token_table.py) safe. On CUDA the steps
run on a dedicated stream that waits for the scheduler's preparation (`device.ForwardStream`). The thread's
intra-op thread count is set once, in the thread. `busy_s` accumulates the time spent executing steps (for
idle-fraction reporting).

`StepGuard` wraps every step these executors run, and the normal loop's inline steps, so it is the one place
a forward runs through: it applies `--cpu-threads-policy adaptive` (executor/cpu_threads.py: the thread count
for the next steps, on the thread that runs them, and the threads' binding to cores around each step), marks
the step's start and end for the rank's `ForwardWatchdog` (scheduler/watchdog.py) and carries the test hook
`TOKENLOOM_TEST_HANG_FORWARD_AFTER=N` (for tests only: the first N steps run, every later one blocks forever, as
a hung kernel would; read once, costs one `is None` test per step when unset).
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import torch

from tokenloom.device import ForwardStream, configure_threads
from tokenloom.executor.cpu_threads import AdaptiveThreads
from tokenloom.executor.worker import ForwardOutput, ModelWorker, PreparedStep

HANG_AFTER_ENV = "TOKENLOOM_TEST_HANG_FORWARD_AFTER"  # test hook: steps after the N-th never return


def hang_after_from_env(environ: dict[str, str] | None = None) -> int | None:
    """The test hook's N (`TOKENLOOM_TEST_HANG_FORWARD_AFTER`), None when unset."""
    value = (os.environ if environ is None else environ).get(HANG_AFTER_ENV, "").strip()
    if not value:
        return None
    if not value.isdigit():
        raise ValueError(f"{HANG_AFTER_ENV} must be a number of steps (>= 0); got {value!r}")
    return int(value)


class StepMarks(Protocol):
    """What a step's guard tells the rank's watchdog (scheduler/watchdog.py `ForwardWatchdog`)."""

    def step_started(self) -> None: ...

    def step_finished(self) -> None: ...


class StepGuard:
    """Runs one step between the watchdog's start and end marks (no watchdog: no marks), and applies the
    hang test hook (`hang_after`: run that many steps, then hang). One guard per executor, used by one thread
    at a time."""

    def __init__(self, watchdog: StepMarks | None = None, hang_after: int | None = None,
                 threads: AdaptiveThreads | None = None) -> None:
        self.watchdog = watchdog
        self.hang_after = hang_after
        self.threads = threads  # --cpu-threads-policy adaptive: sets the step's thread count on its thread
        self.steps = 0
        self.release_hang = threading.Event()  # the hook's hang ends only when a test sets this

    @classmethod
    def from_env(cls, watchdog: StepMarks | None = None, threads: AdaptiveThreads | None = None) -> StepGuard:
        """A guard with the test hook as `TOKENLOOM_TEST_HANG_FORWARD_AFTER` sets it (off when unset)."""
        return cls(watchdog, hang_after_from_env(), threads)

    def run(self, run: Callable[[PreparedStep], Any], step: PreparedStep) -> Any:
        if self.threads is not None:
            self.threads.before_step()
        watchdog = self.watchdog
        if watchdog is not None:
            watchdog.step_started()
        try:
            if self.hang_after is not None:
                self._test_hook()
            return run(step)
        finally:
            if self.threads is not None:
                self.threads.after_step()
            if watchdog is not None:
                watchdog.step_finished()

    def _test_hook(self) -> None:
        self.steps += 1
        if self.steps > self.hang_after:
            self.release_hang.wait()  # the step hangs with the GIL released, as a stuck kernel does


class _GuardedSteps:
    """What both executors share: a step runs on the forward stream, through the guard, with its time
    added to `busy_s`."""

    def __init__(self, worker: ModelWorker, guard: StepGuard | None) -> None:
        self.worker = worker
        self.guard = guard or StepGuard.from_env()
        self.stream = ForwardStream(worker.device)
        self.busy_s = 0.0

    def _execute(self, step: PreparedStep, mark: object | None, run: Callable[[PreparedStep], Any]) -> Any:
        start = time.perf_counter()
        try:
            with self.stream.context(mark):
                out = self.guard.run(run, step)
            self.stream.finish()
            return out
        finally:
            self.busy_s += time.perf_counter() - start


class ForwardThread(_GuardedSteps):
    def __init__(self, worker: ModelWorker, num_threads: int | None = None, guard: StepGuard | None = None) -> None:
        super().__init__(worker, guard)
        threads = num_threads if num_threads is not None else torch.get_num_threads()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tokenloom-forward",
                                        initializer=configure_threads, initargs=(threads,))

    def submit(self, step: PreparedStep, run: Callable[[PreparedStep], Any] | None = None) -> Future[ForwardOutput]:
        """Queue `run(step)` (default `worker.execute`: forward and sample; a pipeline stage that does not
        sample passes its forward)."""
        return self._pool.submit(self._execute, step, self.stream.handoff(), run or self.worker.execute)


class ForwardOnCaller(_GuardedSteps):
    """Executes submitted steps on the thread running `serve_forever()`, in submission order.

    `call(fn)` hands that thread a whole stretch of work instead (the overlap loop's steps run to completion
    while its policy says not to overlap: scheduling, the forward through `execute_here` and processing all
    on the serving thread, with no hand-off between two threads per step); the submitting thread waits on
    the future, so the two never touch the scheduler at once."""

    def __init__(self, worker: ModelWorker, guard: StepGuard | None = None) -> None:
        super().__init__(worker, guard)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._serving_thread: int | None = None

    def submit(self, step: PreparedStep, run: Callable[[PreparedStep], Any] | None = None) -> Future[ForwardOutput]:
        """Queue `run(step)` (default `worker.execute`) for the serving thread."""
        future: Future[ForwardOutput] = Future()
        self._queue.put((step, self.stream.handoff(), future, run or self.worker.execute))
        return future

    def call(self, fn: Callable[[], Any]) -> Future:
        """Queue `fn()` for the serving thread, outside the step guard (the steps it runs go through
        `execute_here`, which applies it); its result or error comes back in the future."""
        future: Future = Future()
        self._queue.put((None, None, future, fn))
        return future

    def execute_here(self, step: PreparedStep) -> ForwardOutput:
        """Run `worker.execute(step)` now, on the serving thread (from inside a `call`): what a submitted
        step gets, without the queue."""
        if threading.get_ident() != self._serving_thread:
            raise RuntimeError("execute_here runs only on the thread serving the forwards")
        return self._execute(step, self.stream.handoff(), self.worker.execute)

    def serve_forever(self) -> None:
        """Run steps (and `call`ed work) until `stop()`; a failing one fails its future (the scheduler sees
        the error)."""
        self._serving_thread = threading.get_ident()
        while True:
            item = self._queue.get()
            if item is None:
                return
            step, mark, future, run = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                out = run() if step is None else self._execute(step, mark, run)
            except BaseException as e:  # noqa: BLE001 - handed to the scheduler thread
                future.set_exception(e)
            else:
                future.set_result(out)

    def stop(self) -> None:
        self._queue.put(None)
