"""Event loops: the order in which a scheduler receives, schedules, runs and processes.

Every loop implements `EventLoop`: `run_once()` does one iteration and says whether it ran a batch;
`run_forever()` repeats, sleeping on the inbox when idle. The overlap, pipeline and disaggregation loops
of later issues implement the same protocol around the same `Scheduler`.
"""

from __future__ import annotations

from typing import Any, Protocol

from tokenloom.scheduler.scheduler import Scheduler

IDLE_POLL_MS = 100


class Inbox(Protocol):
    def recv_all(self, timeout_ms: int = 0) -> list[Any]: ...


class EventLoop(Protocol):
    def run_once(self) -> bool: ...

    def run_forever(self) -> None: ...


class NormalLoop:
    """Receive → schedule → run → process, each step to completion (no overlap)."""

    def __init__(self, scheduler: Scheduler, inbox: Inbox) -> None:
        self.scheduler = scheduler
        self.inbox = inbox

    def run_once(self, timeout_ms: int = 0) -> bool:
        for msg in self.inbox.recv_all(timeout_ms):
            self.scheduler.handle(msg)
        batch = self.scheduler.get_next_batch_to_run()
        if batch is None:
            self.scheduler.check_idle_integrity()
            return False
        out = self.scheduler.run_batch(batch)
        self.scheduler.process_batch_result(batch, out)
        return True

    def run_forever(self) -> None:
        busy = True
        while True:
            busy = self.run_once(0 if busy else IDLE_POLL_MS)
