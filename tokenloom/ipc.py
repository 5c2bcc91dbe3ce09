"""Inter-process messaging: messages (encoded by wire.py: the per-token outputs as plain tuples, all pickled)
over ZMQ PUSH/PULL sockets on `ipc://` paths, plus an in-process twin (`LocalChannel`) with the same interface
for unit tests.

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

from tokenloom.wire import decode, encode

_EVENTS, _POLLIN, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)


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
        socket = self.socket
        if timeout_ms and not socket.poll(timeout_ms):
            return []
        return [decode(raw) for raw in drain(socket)]

    def close(self) -> None:
        self.socket.close(linger=0)


class Sender:
    """A connected PUSH socket."""

    def __init__(self, ctx: zmq.Context, address: str) -> None:
        self.socket = ctx.socket(zmq.PUSH)
        self.socket.connect(address)

    def send(self, obj: Any) -> None:
        self.socket.send(encode(obj))

    def close(self) -> None:
        self.socket.close(linger=0)


def drain(socket: zmq.Socket) -> list[bytes]:
    """Every message queued on `socket`, without waiting. Asks the socket's EVENTS between messages instead of
    receiving until `zmq.Again`: right after a decode step a raised Again cost ~85 us, the EVENTS call ~50. The
    constants are plain ints: pyzmq's are enum members, and `&` on two of them runs enum.Flag's Python code.
    Also what a caller watching the socket's FD (edge-triggered) must do on each wake-up: drain until EVENTS
    says nothing is left, which re-arms the FD."""
    messages = []
    while socket.getsockopt(_EVENTS) & _POLLIN:
        messages.append(socket.recv(_NOBLOCK))
    return messages


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
