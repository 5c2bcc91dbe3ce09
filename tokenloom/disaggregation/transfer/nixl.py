"""NIXL (`nixl_cu12`, UCX backend) as a `TransferEngine`, with NIXL's progress and listen threads off.

Descriptor: the agent's metadata (worker address and registered memory), base64; call it after `register`.
A writer loads a peer's metadata once per distinct descriptor (`add_remote_agent` also updates a known
agent's metadata); after a failure it forgets the peer, so the next write reloads it and reconnects.

Progress (docs/pd_transfer_research.md): with the progress thread off (on, it burns a core per agent) UCX moves
only inside NIXL calls. The writer polls its own handles; a receiver must call into NIXL too (connection
set-up with a new writer completes only then), so while `expect_incoming(True)` a thread polls
`get_new_notifs()` every ~1 ms, and while inactive it blocks on an event (no idle CPU). The agent is created in
STRICT thread-sync mode, so that thread and several writing threads may share it.

Timeouts: NIXL has none for a frozen peer (a handle stays "PROC"), so `write` enforces `timeout_s`; a handle it
gives up on is released (NIXL cancels it) or, if NIXL refuses, kept until `close`. On loopback the data moves
over CMA (the writer copies into the peer's memory inside `transfer()`), so a write into a peer that froze
after the connection was set up still completes.

`UCX_NET_DEVICES=lo`: UCX otherwise probes every network device, and on this kind of host loopback is the
only route between the agents. It is set (in this process's environment, before the first agent's UCX
backend is created) only when the engine's host is a loopback address and the variable is unset, so a
deployment across hosts, or one that chose its devices, keeps UCX's own choice.
"""

from __future__ import annotations

import base64
import logging
import os
import threading
import time
import uuid
from typing import Any

import numpy as np

from tokenloom.disaggregation.transfer.base import Deadline, Run, TransferError, checked_runs, is_loopback

logger = logging.getLogger(__name__)

BATCH_DESCS = 16384  # descriptors per NIXL transfer request; a write of more runs posts several
POLL_S = 1e-3  # receiver's notification poll interval while incoming transfers are expected
_POLL_MIN_S = 20e-6
_POLL_MAX_S = 1e-3


def load_nixl() -> Any:
    """The `nixl_cu12` module, or an ImportError naming what to install."""
    try:
        import nixl_cu12
    except ImportError as e:
        raise ImportError(f"the nixl transfer backend needs NIXL ({e}): pip install nixl-cu12") from e
    return nixl_cu12


def _is_not_found(error: BaseException) -> bool:
    """NIXL's exceptions share no base class; NOT_FOUND means an address outside registered memory."""
    return "NOT_FOUND" in str(error) or type(error).__name__ == "nixlNotFoundError"


class _Poller:
    """Calls `get_new_notifs()` every `POLL_S` while active; blocks while inactive."""

    def __init__(self, agent: Any) -> None:
        self._agent = agent
        self._active = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def set_active(self, active: bool) -> None:
        with self._lock:
            if self._closed:
                return
            if active:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._loop, name="nixl-incoming-poll", daemon=True)
                    self._thread.start()
                self._active.set()
            else:
                self._active.clear()

    def _loop(self) -> None:
        while True:
            self._active.wait()
            if self._closed:
                return
            try:
                self._agent.get_new_notifs()
            except Exception:  # a failed poll must not end the thread
                logger.exception("NIXL notification poll failed")
            time.sleep(POLL_S)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._active.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)


class NixlEngine:
    """NIXL over UCX: see the module docstring for progress, timeouts and the loopback device choice."""

    backend = "nixl"

    def __init__(self, host: str = "127.0.0.1") -> None:
        if is_loopback(host) and "UCX_NET_DEVICES" not in os.environ:
            os.environ["UCX_NET_DEVICES"] = "lo"
        nixl = load_nixl()
        name = f"tokenloom-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        config = nixl.nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=["UCX"],
                                        sync_mode=nixl.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
        try:
            self._agent = nixl.nixl_agent(name, config)
        except Exception as e:
            raise TransferError(f"NIXL agent creation failed: {type(e).__name__}: {e}") from e
        if "UCX" not in self._agent.backends:
            raise TransferError("NIXL has no UCX backend (its UCX plugin did not load)")
        self._regs: list[Any] = []
        self._remotes: dict[str, str] = {}  # descriptor -> remote agent name
        self._remotes_lock = threading.Lock()
        self._stuck: list[Any] = []  # handles NIXL would not release yet
        self._poller = _Poller(self._agent)
        self._closed = False

    def register(self, addr: int, nbytes: int) -> None:
        try:
            self._regs.append(self._agent.register_memory([(addr, nbytes, 0, "")], "DRAM"))
        except Exception as e:
            raise TransferError(f"NIXL could not register [{addr:#x}, +{nbytes}): {type(e).__name__}: {e}") from e

    def descriptor(self) -> str:
        return base64.b64encode(self._agent.get_agent_metadata()).decode("ascii")

    def expect_incoming(self, active: bool) -> None:
        self._poller.set_active(active)

    def write(self, peer: str, runs: list[Run], timeout_s: float) -> None:
        if self._closed:
            raise TransferError("write on a closed NIXL engine")
        deadline = Deadline(timeout_s)
        runs = checked_runs(runs)
        if not runs:
            return
        arr = np.array(runs, dtype=np.uint64)
        name = self._remote(peer)
        handles: list[Any] = []
        try:
            self._post(name, arr, handles, deadline)
            self._wait(name, handles, deadline)
            for h in handles:
                h.release()
        except TransferError:
            self._give_up(handles)
            self._forget(peer, name)
            raise
        except Exception as e:  # NIXL's own exceptions (no common base class)
            self._give_up(handles)
            if not _is_not_found(e):  # an address outside registered memory says nothing about the peer
                self._forget(peer, name)
            raise TransferError(f"NIXL write to {name} failed: {type(e).__name__}: {e}") from e
        except BaseException:
            self._give_up(handles)
            raise

    def _remote(self, peer: str) -> str:
        with self._remotes_lock:
            name = self._remotes.get(peer)
            if name is None:
                try:
                    name = self._agent.add_remote_agent(base64.b64decode(peer, validate=True))
                except Exception as e:
                    raise TransferError(f"NIXL could not load the peer's metadata: {type(e).__name__}: {e}") from e
                name = name.decode() if isinstance(name, bytes) else name
                self._remotes[peer] = name
            return name

    def _forget(self, peer: str, name: str) -> None:
        with self._remotes_lock:
            if self._remotes.get(peer) != name:
                return
            del self._remotes[peer]
            try:
                self._agent.remove_remote_agent(name)
            except Exception as e:  # forgetting is best effort; the next write reloads it
                logger.warning("NIXL remove_remote_agent(%s) failed: %s", name, e)

    def _post(self, name: str, arr: np.ndarray, handles: list[Any], deadline: Deadline) -> None:
        """One transfer request per `BATCH_DESCS` runs, each posted (on loopback: copied) at once."""
        for start in range(0, len(arr), BATCH_DESCS):
            chunk = arr[start: start + BATCH_DESCS]
            local = np.zeros((len(chunk), 3), dtype=np.uint64)
            remote = np.zeros((len(chunk), 3), dtype=np.uint64)
            local[:, 0], local[:, 1] = chunk[:, 0], chunk[:, 2]
            remote[:, 0], remote[:, 1] = chunk[:, 1], chunk[:, 2]
            handle = self._agent.initialize_xfer("WRITE", self._agent.get_xfer_descs(local, "DRAM"),
                                                 self._agent.get_xfer_descs(remote, "DRAM"), name, b"")
            handles.append(handle)
            if self._agent.transfer(handle) == "ERR":
                raise TransferError(f"NIXL refused to post a transfer to {name}")
            if start + BATCH_DESCS < len(arr) and deadline.passed():
                raise TransferError(f"NIXL write to {name} timed out after {deadline.timeout_s} s (posting)")

    def _wait(self, name: str, handles: list[Any], deadline: Deadline) -> None:
        pending = list(handles)
        sleep_s = _POLL_MIN_S
        while pending:
            still = []
            for h in pending:
                state = self._agent.check_xfer_state(h)
                if state == "ERR":
                    raise TransferError(f"NIXL transfer to {name} failed (peer disconnected or invalidated)")
                if state != "DONE":
                    still.append(h)
            if not still:
                return
            if deadline.passed():
                raise TransferError(f"NIXL write to {name} timed out after {deadline.timeout_s} s "
                                    f"({len(still)} of {len(handles)} requests unfinished)")
            progressed = len(still) < len(pending)
            pending = still
            if progressed:
                sleep_s = _POLL_MIN_S
            else:
                time.sleep(sleep_s)
                sleep_s = min(2 * sleep_s, _POLL_MAX_S)

    def _give_up(self, handles: list[Any]) -> None:
        for h in handles:
            try:
                h.release()
            except Exception:  # NIXL could not cancel it yet; retried at close
                self._stuck.append(h)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._poller.close()
        with self._remotes_lock:
            for name in self._remotes.values():
                try:
                    self._agent.remove_remote_agent(name)
                except Exception as e:  # closing is best effort
                    logger.warning("NIXL remove_remote_agent(%s) failed at close: %s", name, e)
            self._remotes.clear()
        stuck, self._stuck = self._stuck, []
        self._give_up(stuck)
        for reg in self._regs:
            try:
                self._agent.deregister_memory(reg)
            except Exception as e:
                logger.warning("NIXL deregister_memory failed at close: %s", e)
        self._regs.clear()
