"""`ControlChannel`: a transfer agent's sockets and its control thread (one per scheduler rank of a PD server).

What it owns: a ZMQ context; a PULL socket bound on a random port of the rank's host (`address`; JSON messages
only: nothing a peer sends is unpickled); a PUSH socket per peer address, made on first use (`send`, any
thread); on the entry rank, a PUSH socket into its own scheduler's inbox (`event`: `TransferEvent`s, which
reach every rank of the server the way requests do); the queue of calls other threads hand to the control
thread (`call`); a small pool for the blocking look-ups (`submit`: HTTP to a bootstrap server, which may retry
for as long as the bootstrap timeout), another for the health probes (`probe`: each bounded by its own short
timeout, so look-ups waiting on a dead server never delay them); and the control thread itself.

The control thread, every 20 ms or as soon as a message comes: hands every message received to `on_message(kind,
room, msg)` (a malformed one is logged and dropped), runs the queued calls in order, then `on_tick()` (the
agent's clocks and held notices). An exception in any of them is logged and the thread goes on. Everything an
agent keeps about its rooms is touched only from these, hence only on this thread.

Lifecycle: construct (binds the PULL socket) → `start(on_message, on_tick)` once the agent's state exists →
`stop()` (the thread ends, look-ups and probes not started are dropped) → `close()` (sockets closed, unsent messages
dropped).
"""

from __future__ import annotations

import json
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import zmq

from tokenloom.protocol import TransferEvent

logger = logging.getLogger(__name__)

POLL_MS = 20  # how long the control thread waits for a message before it runs the calls and clocks again


class ControlChannel:
    def __init__(self, host: str, events_address: str | None) -> None:
        """`host`: the address peers reach this rank at; `events_address`: the entry rank's own scheduler inbox
        (None on every other rank)."""
        self._ctx = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        port = self._pull.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self._push: dict[str, zmq.Socket] = {}
        self._push_lock = threading.Lock()
        self._calls: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._stopped = threading.Event()
        self._fetches = ThreadPoolExecutor(max_workers=4, thread_name_prefix="tokenloom-pd-fetch")
        self._probes = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenloom-pd-probe")
        self._events: zmq.Socket | None = None
        if events_address is not None:
            self._events = self._ctx.socket(zmq.PUSH)
            self._events.connect(events_address)
        self._thread: threading.Thread | None = None

    def start(self, on_message: Callable[[str, int, dict[str, Any]], None], on_tick: Callable[[], None]) -> None:
        self._thread = threading.Thread(target=self._loop, args=(on_message, on_tick), name="tokenloom-pd-control",
                                        daemon=True)
        self._thread.start()

    # --- any thread ------------------------------------------------------------------------------------------
    def call(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the control thread (in the order of the calls)."""
        self._calls.put(fn)

    def send(self, address: str, msg: dict[str, Any]) -> None:
        """Send a control message (JSON) to the agent at `address`."""
        with self._push_lock:
            sock = self._push.get(address)
            if sock is None:
                sock = self._ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDHWM, 100000)
                sock.connect(address)
                self._push[address] = sock
            sock.send(json.dumps(msg).encode())

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run `fn(*args)` on the look-up pool (it hands any result back with `call`)."""
        self._fetches.submit(fn, *args)

    def probe(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run `fn(*args)`, a health probe with its own short timeout, on the probe pool (results via `call`)."""
        self._probes.submit(fn, *args)

    # --- control thread ----------------------------------------------------------------------------------------
    def event(self, event: TransferEvent) -> None:
        """Entry rank: push `event` into this rank's scheduler inbox."""
        assert self._events is not None, "only the entry rank reports events to its scheduler"
        self._events.send_pyobj(event)

    def _loop(self, on_message: Callable[[str, int, dict[str, Any]], None], on_tick: Callable[[], None]) -> None:
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        while not self._stopped.is_set():
            try:
                if poller.poll(POLL_MS):
                    while True:
                        try:
                            raw = self._pull.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._dispatch(raw, on_message)
                while True:
                    try:
                        call = self._calls.get_nowait()
                    except queue.Empty:
                        break
                    call()
                on_tick()
            except Exception:  # noqa: BLE001 - a bad message or peer must not stop the agent
                logger.exception("transfer agent control loop error")

    @staticmethod
    def _dispatch(raw: bytes, on_message: Callable[[str, int, dict[str, Any]], None]) -> None:
        try:
            msg = json.loads(raw)
            kind, room = msg["t"], int(msg["room"])
        except (ValueError, KeyError, TypeError):
            logger.warning("transfer agent: dropped a malformed control message (%d bytes)", len(raw))
            return
        on_message(kind, room, msg)

    # --- shutdown ------------------------------------------------------------------------------------------------
    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        self._fetches.shutdown(wait=False, cancel_futures=True)
        self._probes.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        self._ctx.destroy(linger=0)
