"""`LaneDriver`: a test-only event loop that drives a scheduler's lanes the way a pipeline does, in one process.

Iteration t schedules lane t % L and launches its batch (the worker runs it at once, in launch order, as
every pipeline stage does); the result of lane (t + 1) % L's oldest batch is processed at the end of the
iteration, so each result waits L - 1 iterations, exactly the delay of `PipelineLoop` at
pp_size + depth = L. What it leaves out is only the transport: no processes, no stages.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from tokenloom.scheduler.lane import Lane
from tokenloom.scheduler.scheduler import Scheduler


class LaneDriver:
    def __init__(self, scheduler: Scheduler, inbox: Any) -> None:
        self.scheduler = scheduler
        self.inbox = inbox
        self.iteration = 0
        self.results: dict[int, deque] = {lane.index: deque() for lane in scheduler.lanes}
        self.settles: list[int] = []  # lanes the scheduler asked to settle
        self.max_admitted = 0  # most requests admitted at once, over every lane

    # --- LoopControl --------------------------------------------------------------------------------
    def settle(self, lane: Lane) -> None:
        self.settles.append(lane.index)
        assert not lane.launched, "a lane's results are processed before it is scheduled again"

    def settle_all(self) -> None:
        for lane in self.scheduler.lanes:
            while lane.launched:
                self._process(lane)

    def info(self) -> dict:
        return {"lanes": len(self.scheduler.lanes)}

    # --- the loop -----------------------------------------------------------------------------------
    def _process(self, lane: Lane) -> None:
        batch, out = self.results[lane.index].popleft()
        self.scheduler.process_batch_result(batch, out, lane)

    def run_once(self, timeout_ms: int = 0) -> bool:
        sched, lanes = self.scheduler, self.scheduler.lanes
        for msg in self.inbox.recv_all():
            sched.handle(msg, self)
        lane = lanes[self.iteration % len(lanes)]
        batch = sched.get_next_batch_to_run(self, lane)
        if batch is not None:
            step = sched.launch(batch, lane)
            self.results[lane.index].append((batch, sched.worker.execute(step)))
        self.max_admitted = max(self.max_admitted, sum(each.admitted() for each in lanes))
        nxt = lanes[(self.iteration + 1) % len(lanes)]
        if nxt.launched:
            self._process(nxt)
        self.iteration += 1
        return batch is not None or any(each.launched for each in lanes)
