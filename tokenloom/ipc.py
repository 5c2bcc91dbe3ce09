"""Inter-process messaging: pickled objects over ZMQ PUSH/PULL sockets on `ipc://` paths, plus an
in-process twin (`LocalChannel`) with the same interface for unit tests.

Each receiver binds its PULL socket; senders connect (ZMQ queues messages until the peer is up). Addresses
live in a per-engine temporary folder, so several engines on one machine never collide.
"""

from __future__ import annotations

import os
import queue
import tempfile
from dataclasses import dataclass
from typing import Any

import zmq


@dataclass(frozen=True)
class IpcAddresses:
    scheduler: str  # engine -> scheduler
    detokenizer: str  # scheduler -> detokenizer (the engine's own address when the engine detokenizes)
    engine: str  # detokenizer -> engine

    @classmethod
    def fresh(cls, detokenizer_process: bool = True) -> IpcAddresses:
        """New addresses in a new folder; without `detokenizer_process` the scheduler sends to the engine."""
        folder = tempfile.mkdtemp(prefix="tokenloom-ipc-")
        scheduler, detokenizer, engine = (f"ipc://{os.path.join(folder, name)}"
                                          for name in ("scheduler", "detokenizer", "engine"))
        return cls(scheduler, detokenizer if detokenizer_process else engine, engine)


class Receiver:
    """A bound PULL socket: `recv_all` drains what is queued, waiting up to `timeout_ms` for the first."""

    def __init__(self, ctx: zmq.Context, address: str) -> None:
        self.socket = ctx.socket(zmq.PULL)
        self.socket.bind(address)

    def recv_all(self, timeout_ms: int = 0) -> list[Any]:
        messages = []
        if timeout_ms and not self.socket.poll(timeout_ms):
            return messages
        while True:
            try:
                messages.append(self.socket.recv_pyobj(zmq.NOBLOCK))
            except zmq.Again:
                return messages

    def close(self) -> None:
        self.socket.close(linger=0)


class Sender:
    """A connected PUSH socket."""

    def __init__(self, ctx: zmq.Context, address: str) -> None:
        self.socket = ctx.socket(zmq.PUSH)
        self.socket.connect(address)

    def send(self, obj: Any) -> None:
        self.socket.send_pyobj(obj)

    def close(self) -> None:
        self.socket.close(linger=0)


class LocalChannel:
    """In-process stand-in for a Sender/Receiver pair (tests)."""

    def __init__(self) -> None:
        self._queue: queue.Queue = queue.Queue()

    def send(self, obj: Any) -> None:
        self._queue.put(obj)

    def recv_all(self, timeout_ms: int = 0) -> list[Any]:
        messages = []
        try:
            messages.append(self._queue.get(timeout=timeout_ms / 1000) if timeout_ms else self._queue.get_nowait())
            while True:
                messages.append(self._queue.get_nowait())
        except queue.Empty:
            return messages

    def close(self) -> None:
        pass
