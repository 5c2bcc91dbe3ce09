"""`WorldBoard`: how the launchers of a multi-node world tell each other that a rank died or that node 0 is
shutting down, through the rendezvous store (a TCPStore hosted by global rank 0, `distributed/groups.py`).

Each node's launcher supervises only its own processes; a rank that dies on node 1 shows on node 0 merely as
a collective that fails ("connection closed"), which names no one. So every launcher connects to the store
as one more client once its ranks are up, and:
- a launcher that sees one of its ranks exit writes the reason under `death/<rank>` (the first report of a
  rank wins), and every launcher reads the others' reports (`deaths`) to name the dead rank in its error;
- node 0's launcher writes `shutdown` before it stops its ranks on a clean stop and waits for each node to
  acknowledge it, so the other nodes exit 0 instead of reporting a failure;
- the store disappearing (rank 0's process is gone, and with it node 0's runtime) is itself the signal for the
  other nodes to stop (`BoardUnreachable` from any call).
Invariant: the board only carries notices; no rank reads it, so a slow or lost board never stalls a step.
"""

from __future__ import annotations

import contextlib
import time
from datetime import timedelta

import torch.distributed as dist

from tokenloom.distributed import topology

_PREFIX = "tokenloom/board/"
_DEATH = _PREFIX + "death/"
_SHUTDOWN = _PREFIX + "shutdown"
_SHUTDOWN_SEEN = _PREFIX + "shutdown_seen/"
STORE_TIMEOUT_S = 5.0
SHUTDOWN_ACK_S = 2.0  # more than a worker node's supervision period (entrypoints/worker_node.py)


class BoardUnreachable(RuntimeError):
    """The rendezvous store cannot be reached: rank 0's process (node 0's runtime) is gone."""


class WorldBoard:
    def __init__(self, dist_init_addr: str, world: int, timeout_s: float = STORE_TIMEOUT_S) -> None:
        host, port = topology.parse_dist_init_addr(dist_init_addr)
        self.world = world
        self.where = f"{host}:{port}"
        try:
            self._store = dist.TCPStore(host, port, None, is_master=False, timeout=timedelta(seconds=timeout_s),
                                        wait_for_workers=False)
        except (dist.DistError, RuntimeError) as e:
            raise BoardUnreachable(f"the rendezvous store at {self.where} is unreachable: "
                                   f"{str(e).splitlines()[0]}") from None

    def _call(self, fn, *args):
        try:
            return fn(*args)
        except (dist.DistError, RuntimeError) as e:
            raise BoardUnreachable(f"the rendezvous store at {self.where} went away (node 0 is gone): "
                                   f"{str(e).splitlines()[0]}") from None

    def report_death(self, rank: int, text: str) -> None:
        """Publish why global `rank` is gone (best effort: a board already gone is not an error here)."""
        with contextlib.suppress(BoardUnreachable):
            self._call(self._store.compare_set, f"{_DEATH}{rank}", "", text)

    def deaths(self, ranks: range | list[int] | None = None) -> list[str]:
        """Every published death among `ranks` (default: the whole world), in rank order."""
        found = []
        for rank in range(self.world) if ranks is None else ranks:
            key = f"{_DEATH}{rank}"
            if self._call(self._store.check, [key]):
                found.append(self._call(self._store.get, key).decode())
        return found

    def announce_shutdown(self, nnodes: int, wait_s: float = SHUTDOWN_ACK_S) -> None:
        """Node 0 is stopping on purpose: tell the other nodes, and wait (up to `wait_s`) until each has read
        it, since stopping node 0's ranks takes the board down with rank 0 (best effort)."""
        with contextlib.suppress(BoardUnreachable):
            self._call(self._store.set, _SHUTDOWN, "1")
            seen = [f"{_SHUTDOWN_SEEN}{node}" for node in range(1, nnodes)]
            deadline = time.monotonic() + wait_s
            while seen and not self._call(self._store.check, seen) and time.monotonic() < deadline:
                time.sleep(0.05)

    def shutdown_announced(self) -> bool:
        return bool(self._call(self._store.check, [_SHUTDOWN]))

    def acknowledge_shutdown(self, node_rank: int) -> None:
        with contextlib.suppress(BoardUnreachable):
            self._call(self._store.set, f"{_SHUTDOWN_SEEN}{node_rank}", "1")
