"""Mooncake's transfer engine over TCP with the P2P handshake (no metadata server) as a `TransferEngine`.

Descriptor: "host:rpc_port" (Mooncake's session name); the writer needs nothing else from the peer.

Why submit + poll rather than `batch_transfer_sync_write` (docs/pd_transfer_research.md):
- each run is one `transfer_submit_write` batch: `transfer_check_status` reads a batch's first entry only, and
  this was also the fastest path over TCP (the sync call spins a core and was slower);
- the TCP transport rejects transfers beyond ~1024 queued per peer, so at most `WINDOW` runs per peer are in
  flight, counted across this engine's writing threads by a per-peer semaphore;
- Mooncake's own timeouts are 30 s (not configurable per call) and the first contact with a frozen peer blocks
  ~60 s inside the handshake, so `timeout_s` is enforced here: the first contact runs in a helper thread the
  caller stops waiting for, and polling stops at the deadline.
- `transfer_check_status` frees a batch at its first non-zero answer; a batch must not be freed earlier (the
  transport still uses it). A failed write first waits (at most `SETTLE_S`) until the runs it left in flight
  resolve (`settle_in_flight`), so none of them lands after the caller was told the write failed: the peer
  then frees that memory for other requests. With the default 60 s transfer timeout Mooncake has resolved
  them by then (its own timeout is 30 s), so this wait only matters for shorter timeouts. Any still
  unresolved go to a reaper thread that polls them until Mooncake does (and only then returns their window
  slots). Left open: a first contact abandoned at its deadline (a frozen peer's handshake) may still
  complete later and land its one run.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any

from tokenloom.disaggregation.transfer.base import Deadline, Regions, Run, TransferError, checked_runs

logger = logging.getLogger(__name__)

WINDOW = 512  # runs in flight per peer (the TCP transport queues 1024 per peer, then rejects)
_POLL_MIN_S = 50e-6
_POLL_MAX_S = 1e-3  # backoff cap while nothing completes (a frozen peer)
_REAP_S = 0.01


def load_mooncake() -> Any:
    """Mooncake's `TransferEngine` class, or an ImportError naming what to install."""
    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:
        raise ImportError(
            f"the mooncake transfer backend needs Mooncake's transfer engine ({e}): pip install "
            "mooncake-transfer-engine-non-cuda (it links libibverbs.so.1: apt-get install --no-install-recommends "
            "libibverbs1)") from e
    return TransferEngine


class _Peer:
    """Per-peer state shared by the writing threads: whether the handshake is done, and the in-flight window."""

    def __init__(self) -> None:
        self.opened = False
        self.open_lock = threading.Lock()
        self.window = threading.Semaphore(WINDOW)


class _FirstContact:
    """The first submit to a peer, run in its own thread because the handshake inside can block for a minute.
    Whoever comes last of the waiter (gave up) and the thread (finished late) hands the batch to the reaper."""

    def __init__(self, submit: Any, reaper: _Reaper, window: threading.Semaphore) -> None:
        self._submit, self._reaper, self._window = submit, reaper, window
        self._lock = threading.Lock()
        self._batch: int | None = None
        self._abandoned = False
        self._thread = threading.Thread(target=self._run, name="mooncake-first-contact", daemon=True)

    def _run(self) -> None:
        batch = self._submit()
        with self._lock:
            self._batch = batch
            if not self._abandoned:
                return
        self._settle_late(batch)

    def _settle_late(self, batch: int) -> None:
        if batch:
            self._reaper.adopt(batch, self._window)
        else:
            self._window.release()

    def wait(self, timeout_s: float) -> int | None:
        """The batch id (0 = refused), or None after `timeout_s` (the thread then cleans up after itself)."""
        self._thread.start()
        self._thread.join(timeout_s)
        with self._lock:
            if self._batch is None:
                self._abandoned = True
            return self._batch


SETTLE_S = 35.0  # how long a failed write waits for its runs in flight (Mooncake's own timeout is 30 s)


def settle_in_flight(check_status: Any, inflight: deque[int], on_resolved: Any, timeout_s: float,
                     poll_s: float = 1e-3) -> None:
    """Poll the batches of `inflight`, oldest first, until each resolves (`check_status` non-zero: Mooncake
    frees it then) or `timeout_s` passes; resolved ones leave `inflight` and call `on_resolved()` (the window
    slot they held)."""
    deadline = time.monotonic() + timeout_s
    while inflight:
        if check_status(inflight[0]) != 0:
            inflight.popleft()
            on_resolved()
        elif time.monotonic() >= deadline:
            return
        else:
            time.sleep(poll_s)


class _Reaper:
    """Polls batches abandoned by failed writes until Mooncake resolves them, then frees their window slot."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self._cond = threading.Condition()
        self._batches: list[tuple[int, threading.Semaphore]] = []
        self._closed = False
        self._thread: threading.Thread | None = None

    def adopt(self, batch: int, window: threading.Semaphore) -> None:
        with self._cond:
            if self._closed:
                return
            self._batches.append((batch, window))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="mooncake-reaper", daemon=True)
                self._thread.start()
            self._cond.notify()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._batches and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                batches, self._batches = self._batches, []
            pending = []
            for batch, window in batches:
                if self._engine.transfer_check_status(batch) == 0:
                    pending.append((batch, window))
                else:
                    window.release()
            with self._cond:
                self._batches = pending + self._batches
            time.sleep(_REAP_S)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=1.0)


class MooncakeEngine:
    """Mooncake over TCP: see the module docstring for the completion and timeout handling."""

    backend = "mooncake"

    def __init__(self, host: str = "127.0.0.1") -> None:
        self._engine = load_mooncake()()
        rc = self._engine.initialize(host, "P2PHANDSHAKE", "tcp", "")
        if rc != 0:
            raise TransferError(f"Mooncake transfer engine failed to initialize on {host} (rc {rc})")
        self._descriptor = f"{host}:{self._engine.get_rpc_port()}"
        self._regions = Regions()
        self._peers: dict[str, _Peer] = {}
        self._peers_lock = threading.Lock()
        self._reaper = _Reaper(self._engine)
        self._closed = False

    def register(self, addr: int, nbytes: int) -> None:
        rc = self._engine.register_memory(addr, nbytes)
        if rc != 0:
            raise TransferError(f"Mooncake could not register [{addr:#x}, +{nbytes}) (rc {rc})")
        self._regions.add(addr, nbytes)

    def descriptor(self) -> str:
        return self._descriptor

    def expect_incoming(self, active: bool) -> None:
        """No-op: Mooncake's receiving threads always run (and block when idle)."""

    def write(self, peer: str, runs: list[Run], timeout_s: float) -> None:
        if self._closed:
            raise TransferError("write on a closed Mooncake engine")
        deadline = Deadline(timeout_s)
        runs = checked_runs(runs)
        bad = self._regions.outside(runs)
        if bad is not None:
            raise TransferError(f"source [{bad[0]:#x}, +{bad[2]}) is outside this engine's registered memory")
        if not runs:
            return
        state = self._peer(peer)
        inflight: deque[int] = deque()
        try:
            first = 0
            if not state.opened:
                batch = self._first_contact(peer, state, runs[0], deadline)
                if batch is not None:
                    inflight.append(batch)
                    first = 1
            self._pump(peer, state, runs, first, inflight, deadline)
        except BaseException:
            # before the caller hears of the failure (and the peer reuses that memory), no run may still land
            settle_in_flight(self._engine.transfer_check_status, inflight, state.window.release, SETTLE_S)
            for batch in inflight:
                self._reaper.adopt(batch, state.window)
            raise

    def _peer(self, peer: str) -> _Peer:
        with self._peers_lock:
            state = self._peers.get(peer)
            if state is None:
                state = self._peers[peer] = _Peer()
            return state

    def _submit(self, peer: str, run: Run) -> int:
        return self._engine.transfer_submit_write(peer, run[0], run[1], run[2])

    def _first_contact(self, peer: str, state: _Peer, run: Run, deadline: Deadline) -> int | None:
        """Submit `run` as the first transfer to `peer` (the handshake happens inside); its batch id, or None
        when another thread completed the handshake meanwhile."""
        if not state.open_lock.acquire(timeout=deadline.remaining()):
            raise TransferError(f"timed out after {deadline.timeout_s} s waiting for the handshake with {peer}")
        try:
            if state.opened:
                return None
            if not state.window.acquire(timeout=deadline.remaining()):
                raise TransferError(f"timed out after {deadline.timeout_s} s: {peer}'s transfer window is full")
            contact = _FirstContact(lambda: self._submit(peer, run), self._reaper, state.window)
            batch = contact.wait(deadline.remaining())
            if batch is None:
                raise TransferError(f"no handshake with Mooncake peer {peer} within {deadline.timeout_s} s")
            if batch == 0:
                state.window.release()
                raise TransferError(f"Mooncake peer {peer} is unreachable or refused the transfer")
            state.opened = True
            return batch
        finally:
            state.open_lock.release()

    def _pump(self, peer: str, state: _Peer, runs: list[Run], i: int, inflight: deque[int],
              deadline: Deadline) -> None:
        """Submit runs[i:] keeping within the peer's window, and poll until every submitted run completed."""
        sleep_s = _POLL_MIN_S
        check = self._engine.transfer_check_status
        while i < len(runs) or inflight:
            while i < len(runs) and state.window.acquire(blocking=False):
                batch = self._submit(peer, runs[i])
                if batch == 0:
                    state.window.release()
                    raise TransferError(f"Mooncake refused a transfer to {peer} (peer gone or address invalid)")
                inflight.append(batch)
                i += 1
            progressed = False
            while inflight:
                status = check(inflight[0])
                if status == 0:
                    break
                inflight.popleft()  # Mooncake freed it (1 / -1); a -2 (timeout) batch is dropped as well
                state.window.release()
                if status != 1:
                    raise TransferError(f"Mooncake transfer to {peer} failed (status {status}): peer dead, "
                                        "frozen, or the destination is outside its registered memory")
                progressed = True
            if (i < len(runs) or inflight) and deadline.passed():
                raise TransferError(f"Mooncake write to {peer} timed out after {deadline.timeout_s} s "
                                    f"({len(inflight)} of {len(runs)} runs in flight, {len(runs) - i} not sent)")
            if progressed:
                sleep_s = _POLL_MIN_S
            else:
                time.sleep(sleep_s)
                sleep_s = min(2 * sleep_s, _POLL_MAX_S)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._reaper.close()
        for addr, _ in self._regions.items():
            rc = self._engine.unregister_memory(addr)
            if rc != 0:
                logger.warning("Mooncake could not unregister %#x (rc %d)", addr, rc)
