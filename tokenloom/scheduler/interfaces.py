"""What the `Scheduler` (scheduler.py) asks of those around it, as protocols: `LoopControl`, the event loop
driving it (passed with each call; `NO_LOOP` when a test steps it by hand), and `SchedulerWorker`, the worker
it plans steps for (`executor.worker.ModelWorker`, or a fake in unit tests). Nothing here holds state."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from tokenloom.executor.worker import ForwardOutput
from tokenloom.scheduler.lane import Lane
from tokenloom.scheduler.schedule_batch import ScheduleBatch


class LoopControl(Protocol):
    """What the scheduler may ask of the event loop driving it (loops.py), passed with each call."""

    def settle(self, lane: Lane) -> None:
        """Process every launched batch of `lane` whose result is pending (a no-op when none can be)."""

    def settle_all(self) -> None:
        """Process every launched batch whose result is pending (a no-op when none can be)."""

    def info(self) -> dict[str, Any]:
        """The loop's own state for `internal_state` (overlap mode, step profile, counters)."""


class NoLoop:
    """The control of a scheduler driven without a loop (tests stepping it by hand): nothing is in flight."""

    def settle(self, lane: Lane) -> None:
        pass

    def settle_all(self) -> None:
        pass

    def info(self) -> dict[str, Any]:
        return {}


NO_LOOP = NoLoop()


class PreparedStepLike(Protocol):
    """What `prepare` returns and `execute` takes; opaque to the scheduler."""


class SchedulerWorker(Protocol):
    """What the scheduler and its event loops use of the worker (`executor.worker.ModelWorker`, or a fake).

    `prepare(batch, lane_state)` runs on the scheduler's thread: it records the batch's KV slots in the request
    table (`lane_state`: the lane's `new_lane_state()`, its sampling state); `execute(step)` runs on the forward
    side, reads a decode step's inputs from its token table by request row and returns the sampled tokens.
    Neither allocates or frees KV memory. `device` is where the forwards run (the overlap loop's forward thread
    makes its stream for it). `write_tokens` (only for requests a request port starts: `start_running`) makes
    tokens that came from elsewhere the newest of their rows, without a forward.
    """

    eos_token_ids: tuple[int, ...]
    device: torch.device

    def new_lane_state(self) -> Any: ...

    def prepare(self, batch: ScheduleBatch, lane_state: Any) -> PreparedStepLike: ...

    def execute(self, step: Any) -> ForwardOutput: ...

    def write_tokens(self, rows: list[int], token_ids: list[int]) -> None: ...
