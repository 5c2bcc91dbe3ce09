"""The overlap loop as the scheduler process runs it (`run_forever` with a `ForwardOnCaller`): while its policy
says not to overlap, whole steps (scheduling, forward, processing) run on the serving thread, with no
hand-off per step; when the policy flips, the loop goes back to launching on the serving thread from the
scheduling thread. Checked against the fake worker's independent reference (tests/unit/
test_scheduler_fake_runner.py): every token arrives, in order, whatever the policy does between steps."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from tests.unit.test_scheduler_fake_runner import GREEDY, FakeWorker, harness, prompt, reference
from tokenloom.executor.forward_thread import ForwardOnCaller, StepGuard
from tokenloom.scheduler.loops import OverlapLoop
from tokenloom.scheduler.step_profile import StepTiming


class ScriptedPolicy:
    """Overlap on for `on` processed steps, then off for `off` steps, repeating."""

    def __init__(self, on: int, off: int) -> None:
        self.on, self.off = on, off
        self.recorded: list[StepTiming] = []

    def overlap_now(self) -> bool:
        return len(self.recorded) % (self.on + self.off) < self.on

    def record(self, timing: StepTiming) -> None:
        self.recorded.append(timing)

    def info(self) -> dict:
        return {}


class Done(Exception):
    """Raised from the inbox once every request has finished: ends `run_forever`."""


class ThreadRecordingWorker(FakeWorker):
    """The fake worker, noting which thread prepared and executed each step."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.prepared_on: list[int] = []
        self.executed_on: list[int] = []

    def prepare(self, batch: Any, lane_state: None = None) -> Any:
        self.prepared_on.append(threading.get_ident())
        return super().prepare(batch, lane_state)

    def execute(self, step: Any) -> Any:
        self.executed_on.append(threading.get_ident())
        return super().execute(step)


def run_served(policy: ScriptedPolicy, prompts: dict[str, list[int]], lengths: dict[str, int]):
    h, _ = harness(max_running_requests=3, overlap_schedule="on")
    worker = ThreadRecordingWorker(h.memory)
    h.scheduler.worker = worker
    executor = ForwardOnCaller(worker, StepGuard())  # type: ignore[arg-type]
    submitted: list[int] = []
    submit = executor.submit
    executor.submit = lambda *a, **kw: submitted.append(1) or submit(*a, **kw)  # type: ignore[method-assign]

    class Inbox:
        def recv_all(self, timeout_ms: int = 0) -> list[Any]:
            h._collect()
            finished = all(h.results.get(rid) and h.results[rid].finish_reason for rid in prompts)
            if finished and not loop.inflight and h.scheduler.is_idle():
                raise Done
            return h.inbox.recv_all()

    loop = OverlapLoop(h.scheduler, Inbox(), policy, executor)
    for rid, ids in prompts.items():
        h.submit(rid, ids, dict(GREEDY, max_new_tokens=lengths[rid]))
    with pytest.raises(Done):
        loop.run_forever()  # this thread serves the forwards, as the scheduler process's main thread does
    h.assert_pools_full()
    return h, worker, submitted


@pytest.mark.parametrize("on,off", [(0, 1), (2, 3), (1, 2), (4, 3)])
def test_every_token_arrives_whatever_the_policy_does(on, off):
    prompts = {f"r{i}": prompt(i, 4 + 5 * i) for i in range(5)}
    lengths = {f"r{i}": 6 + 3 * i for i in range(5)}
    h, worker, submitted = run_served(ScriptedPolicy(on, off), prompts, lengths)
    for rid, ids in prompts.items():
        assert h.results[rid].output_ids == reference(ids, lengths[rid]), rid
        assert h.results[rid].finish_reason == {"type": "length", "length": lengths[rid]}
    serving = threading.get_ident()
    assert set(worker.executed_on) == {serving}  # every forward on the thread that owns the OpenMP team
    inline = sum(1 for t in worker.prepared_on if t == serving)
    assert inline + len(submitted) == len(worker.prepared_on)  # each step either ran inline or was submitted
    if on == 0:
        assert not submitted and inline == len(worker.prepared_on)  # never overlapping: no hand-off at all
    else:
        assert submitted and inline  # both kinds of step ran


def test_an_error_inside_an_inline_stretch_ends_the_loop_with_it():
    h, _ = harness(max_running_requests=3, overlap_schedule="on")
    executor = ForwardOnCaller(h.scheduler.worker, StepGuard())  # type: ignore[arg-type]

    class Broken(FakeWorker):
        def execute(self, step: Any) -> Any:
            raise RuntimeError("kernel failed")

    h.scheduler.worker = Broken(h.memory)
    executor.worker = h.scheduler.worker
    loop = OverlapLoop(h.scheduler, h.inbox, ScriptedPolicy(0, 1), executor)
    h.submit("a", prompt(1, 5), dict(GREEDY, max_new_tokens=3))
    with pytest.raises(RuntimeError, match="kernel failed"):
        loop.run_forever()


def test_execute_here_refuses_another_thread():
    h, worker = harness()
    executor = ForwardOnCaller(worker, StepGuard())  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="only on the thread serving"):
        executor.execute_here(None)  # type: ignore[arg-type]
