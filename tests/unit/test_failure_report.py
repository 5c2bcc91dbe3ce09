"""A rank that fails reports why (a `ProcessFailed`) and then exits: the engine must name the report's reason,
not the bare exit code its child watch sees, even when the HTTP server's loop holds the report unread while the
receiver thread notices the exit (the race that made a hung stage read as "rank 0 died (exit code 1)")."""

from __future__ import annotations

import asyncio
import threading
import time

import zmq

from tokenloom.config import ServerArgs
from tokenloom.frontend.tokenizer_manager import CHILD_CHECK_S, TokenizerManager
from tokenloom.ipc import IpcAddresses, Sender
from tokenloom.models.loader import resolve_model_source
from tokenloom.protocol import ProcessFailed

RANK0 = "scheduler rank 0 (tp 0, pp 0)"


class ExitedAfterReporting:
    """Two ranks; rank 0 "exits with code 1" once `exited` is set (after it sent its report)."""

    def __init__(self) -> None:
        self.processes: dict = {}
        self.exited = threading.Event()
        self.stopped = False

    def start(self) -> dict:
        return {}

    def dead(self) -> str | None:
        return f"{RANK0} died (exit code 1)" if self.exited.is_set() else None

    def dead_besides(self, name: str) -> list[str]:
        return [] if name == RANK0 or not self.exited.is_set() else [self.dead()]

    def stop_all(self, clean: bool = False) -> None:
        self.stopped = True


def test_the_report_names_the_failure_while_the_loop_holds_it_unread(tiny_runtime_model):
    args = ServerArgs(model_path=tiny_runtime_model, pp_size=2)
    addresses = IpcAddresses.fresh(detokenizer_process=False)
    runtime = ExitedAfterReporting()
    manager = TokenizerManager(args, resolve_model_source(args), addresses, runtime)
    reasons: list[str] = []
    manager.on_dead = reasons.append
    ctx = zmq.Context()
    rank0 = Sender(ctx, addresses.engine)

    async def report_then_exit_while_the_loop_is_busy() -> None:
        manager.receive_on_loop()
        await asyncio.sleep(0.05)
        rank0.send(ProcessFailed(RANK0, "RuntimeError: scheduler rank 1 (tp 0, pp 1) stopped responding"))
        runtime.exited.set()
        time.sleep(CHILD_CHECK_S + 0.4)  # the loop is busy past the receiver thread's next child check
        deadline = time.monotonic() + 10
        while not reasons and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        manager.receive_on_thread()

    try:
        asyncio.run(report_then_exit_while_the_loop_is_busy())
    finally:
        rank0.close()
        ctx.term()
        manager.shutdown()
    assert len(reasons) == 1, reasons
    assert "scheduler rank 1 (tp 0, pp 1) stopped responding" in reasons[0], reasons
    assert manager.dead_error == reasons[0] and runtime.stopped
