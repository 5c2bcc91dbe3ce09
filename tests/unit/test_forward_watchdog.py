"""`ForwardWatchdog` (scheduler/watchdog.py) and `StepGuard` (executor/forward_thread.py): a step in progress
longer than the timeout trips the watchdog once, no earlier than the timeout; idle time and short steps never
do; every loop's forwards pass through the guard's marks (normal and overlap loops over a fake worker, both
executors); the hang test hook runs N steps and blocks the next. The whole server path (report, exit,
/health) is tests/e2e/test_watchdog.py."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tests.scheduler_harness import LoopHarness
from tests.unit.test_scheduler_fake_runner import CONTEXT, GREEDY, VOCAB, FakeWorker, prompt, reference
from tokenloom.cache.kv_memory import KVMemory
from tokenloom.config import ServerArgs
from tokenloom.executor.forward_thread import (
    HANG_AFTER_ENV,
    ForwardOnCaller,
    ForwardThread,
    StepGuard,
    hang_after_from_env,
)
from tokenloom.scheduler.loops import make_event_loop
from tokenloom.scheduler.watchdog import ForwardWatchdog


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_hung_for_counts_only_a_step_in_progress_past_the_timeout():
    clock = FakeClock()
    dog = ForwardWatchdog(3.0, lambda reason: None, clock=clock)
    clock.now += 50  # idle far longer than the timeout: not a hang
    assert dog.hung_for() is None
    dog.step_started()
    clock.now += 3.0
    assert dog.hung_for() is None  # exactly the timeout: still allowed
    clock.now += 0.5
    assert dog.hung_for() == pytest.approx(3.5)
    dog.step_finished()
    assert dog.hung_for() is None
    dog.step_started()  # a new step starts its own clock
    clock.now += 2.9
    assert dog.hung_for() is None


def test_a_stuck_step_trips_once_after_the_timeout_with_the_reason():
    tripped: list[tuple[float, str]] = []
    dog = ForwardWatchdog(0.4, lambda reason: tripped.append((time.monotonic(), reason)), poll_s=0.02).start()
    start = time.monotonic()
    dog.step_started()
    deadline = start + 5
    while not tripped and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(tripped) == 1, "the watchdog did not trip"
    at, reason = tripped[0]
    assert 0.4 <= at - start < 0.4 + 1.5
    assert reason == "watchdog: a forward step has not returned for 0.4 s (--watchdog-timeout 0.4)"
    time.sleep(0.1)
    assert len(tripped) == 1 and dog.tripped  # it reports once and stops watching


def test_idle_time_and_steps_shorter_than_the_timeout_never_trip():
    tripped: list[str] = []
    dog = ForwardWatchdog(0.3, tripped.append, poll_s=0.01).start()
    time.sleep(0.5)  # idle, longer than the timeout
    for _ in range(20):  # 20 steps of 50 ms: 1 s of work, each far below the timeout
        dog.step_started()
        time.sleep(0.05)
        dog.step_finished()
    time.sleep(0.4)
    assert not tripped


def test_timeout_must_be_positive():
    with pytest.raises(ValueError, match="> 0"):
        ForwardWatchdog(0, lambda reason: None)


class Marks:
    def __init__(self) -> None:
        self.events: list[str] = []

    def step_started(self) -> None:
        self.events.append("start")

    def step_finished(self) -> None:
        self.events.append("end")


def test_guard_marks_each_step_even_when_it_raises():
    marks = Marks()
    guard = StepGuard(marks)
    assert guard.run(lambda step: step * 2, 21) == 42

    def fail(step: int) -> None:
        raise RuntimeError("kernel error")

    with pytest.raises(RuntimeError, match="kernel error"):
        guard.run(fail, 0)
    assert marks.events == ["start", "end", "start", "end"]


def test_hang_hook_runs_n_steps_then_blocks_the_next_inside_the_marks():
    marks = Marks()
    guard = StepGuard(marks, hang_after=2)
    assert [guard.run(lambda s: s, i) for i in range(2)] == [0, 1]
    result: list[int] = []
    stuck = threading.Thread(target=lambda: result.append(guard.run(lambda s: s, 2)), daemon=True)
    stuck.start()
    stuck.join(0.3)
    assert stuck.is_alive() and not result
    assert marks.events[-1] == "start"  # the hang is inside the watched region
    guard.release_hang.set()
    stuck.join(5)
    assert result == [2] and marks.events[-1] == "end"


def test_hang_hook_env_parsing():
    assert hang_after_from_env({}) is None
    assert hang_after_from_env({HANG_AFTER_ENV: " 40 "}) == 40
    assert hang_after_from_env({HANG_AFTER_ENV: "0"}) == 0
    with pytest.raises(ValueError, match=HANG_AFTER_ENV):
        hang_after_from_env({HANG_AFTER_ENV: "-1"})
    assert StepGuard.from_env().hang_after is None  # unset in the test environment: the hook costs nothing


def test_both_executors_run_their_steps_through_the_guard():
    class Worker:
        device = torch.device("cpu")

        def execute(self, step: int) -> int:
            return step + 1

    marks = Marks()
    thread = ForwardThread(Worker(), 1, StepGuard(marks))  # type: ignore[arg-type]
    assert thread.submit(1).result(timeout=10) == 2
    on_caller = ForwardOnCaller(Worker(), StepGuard(marks))  # type: ignore[arg-type]
    future = on_caller.submit(5)
    on_caller.stop()
    on_caller.serve_forever()
    assert future.result(timeout=0) == 6
    assert marks.events == ["start", "end", "start", "end"]


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_every_forward_of_the_loops_is_marked(overlap):
    """The normal loop runs its steps inline, the overlap loop on its forward thread: both through the guard,
    one start/end pair per forward the worker ran, and the tokens are unchanged."""
    tokens = 512
    args = ServerArgs(max_total_tokens=tokens, max_running_requests=8, overlap_schedule=overlap)
    memory = KVMemory.build(tokens=tokens, request_slots=8, context_len=CONTEXT, page_size=1, num_kv_heads=1,
                            head_dim=1, dtype=torch.float32, device=torch.device("cpu"), start_layer=0, end_layer=1,
                            disable_radix_cache=False)
    worker = FakeWorker(memory)
    marks = Marks()
    h = LoopHarness(args, worker, memory, VOCAB,
                    make_loop=lambda sched, inbox: make_event_loop(args, sched, inbox, watchdog=marks))
    ids = {f"r{i}": prompt(i, 5 + i) for i in range(3)}
    for rid, p in ids.items():
        h.submit(rid, p, dict(GREEDY, max_new_tokens=6))
    results = h.run()
    assert {rid: r.output_ids for rid, r in results.items()} == {rid: reference(p, 6) for rid, p in ids.items()}
    assert marks.events == ["start", "end"] * len(worker.batches)
    assert len(worker.batches) >= 6
