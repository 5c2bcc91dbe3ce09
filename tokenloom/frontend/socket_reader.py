"""`SocketReader`: who reads the server's incoming socket (the scheduler's token outputs, control replies): the
TokenizerManager's receiver thread, or an asyncio event loop that took it over (`move_to_loop`: the HTTP server
does, for its lifetime).

Why a loop reads it: each streamed token otherwise wakes ZMQ's I/O thread, then the receiver thread, which
wakes the event loop through its self-pipe (`call_soon_threadsafe`); on the loop the token is delivered to
its request's queue directly, one wake-up and a thread switch fewer. Right after a decode step every wake-up
runs from cold caches on the cores the next step needs.

Invariants: exactly one of the two reads the socket at any time (a ZMQ socket is not thread-safe); the
thread reads and hands out its messages under `lock`, so a move waits until the thread's batch is handed on and
nothing is delivered out of order; after a move to the loop the socket is drained once on the loop (its FD
signals edges: messages queued before the reader was in place would not wake it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any

import zmq

from tokenloom.ipc import Receiver, drain
from tokenloom.wire import decode

logger = logging.getLogger(__name__)
Handler = Callable[[Any], None]


class SocketReader:
    def __init__(self, receiver: Receiver) -> None:
        self.receiver = receiver
        self.lock = threading.Lock()
        self.loop: asyncio.AbstractEventLoop | None = None  # set while a loop reads
        self._thread_may_read = threading.Event()
        self._thread_may_read.set()

    def read_on_thread(self, timeout_ms: int, handle: Handler) -> None:
        """The receiver thread's turn: wait up to `timeout_ms` for messages and `handle` each, unless a loop
        reads (then wait up to `timeout_ms` for the socket to come back, and return)."""
        if not self._thread_may_read.wait(timeout_ms / 1000):
            return
        with self.lock:
            socket = self.receiver.socket
            if self.loop is not None or not socket.poll(timeout_ms):
                return
            for raw in drain(socket):
                _handle_one(handle, raw)

    def move_to_loop(self, loop: asyncio.AbstractEventLoop, handle: Handler) -> None:
        """From now on `loop` (the running one; this call comes from it) reads the socket and calls `handle`
        on it. Blocks until the thread's current wait (up to its timeout) ends."""
        self._thread_may_read.clear()
        with self.lock:
            self.loop = loop
            loop.add_reader(self.receiver.socket.getsockopt(zmq.FD), self._read, handle)
        loop.call_soon(self._read, handle)  # after what the thread scheduled on the loop before the move

    def move_to_thread(self) -> None:
        """The receiver thread reads again (the loop is stopping); idempotent."""
        with self.lock:
            if self.loop is not None:
                with contextlib.suppress(zmq.ZMQError, RuntimeError):  # the socket or the loop is already closed
                    self.loop.remove_reader(self.receiver.socket.getsockopt(zmq.FD))
                self.loop = None
        self._thread_may_read.set()

    def _read(self, handle: Handler) -> None:
        if self.loop is None:
            return
        try:
            messages = drain(self.receiver.socket)
        except zmq.ZMQError:  # closed at shutdown
            return
        for raw in messages:
            _handle_one(handle, raw)


def _handle_one(handle: Handler, raw: bytes) -> None:
    """`handle` the message in `raw`; a failure (decoding it, or handling it) is logged and the reader goes on
    with the next message (`handle` answers its own requests' failures; this is the net under it, so one bad
    message cannot stop every other request)."""
    try:
        msg = decode(raw)
    except Exception:  # noqa: BLE001 - logged; the reader must keep reading
        logger.exception("a message from the runtime (%d bytes) could not be decoded", len(raw))
        return
    try:
        handle(msg)
    except Exception:  # noqa: BLE001 - logged; the reader must keep reading
        logger.exception("handling a %s from the runtime failed", type(msg).__name__)
