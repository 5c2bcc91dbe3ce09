"""`Heartbeat`: how a rank whose collective failed tells a hung peer from a dead one, and names it.

A collective that times out says only that some peer did not come ("Timed out waiting 300000ms for send
operation to complete"). A peer that died is named by its launcher (launcher.py, world_board.py); a peer that
is alive but stuck (stopped, deadlocked, swapping, holding the GIL in a long native call) is not. So every rank
of a multi-rank world bumps a counter on the rendezvous store from a daemon thread every `period_s`
(`beat/<rank>`, on its own store connection, so it never waits behind the rank's other traffic), and a rank
whose collective failed reads its peers' counters twice, `silence_s` apart: the peers whose counters did not
move are the ones it names ("scheduler rank 1 (tp 1, pp 0) stopped responding").
Invariant: the heartbeat never takes part in a step; losing the store only stops the beating.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterable
from datetime import timedelta

import torch.distributed as dist

from tokenloom.distributed import topology

_BEAT = "tokenloom/board/beat/"
PERIOD_S = 1.0


class Heartbeat:
    def __init__(self, dist_init_addr: str, rank: int, period_s: float = PERIOD_S) -> None:
        host, port = topology.parse_dist_init_addr(dist_init_addr)
        self.rank = rank
        self.period_s = period_s
        self._connect = lambda: dist.TCPStore(host, port, None, is_master=False,
                                              timeout=timedelta(seconds=max(5.0, 3 * period_s)),
                                              wait_for_workers=False)
        self._beat_store = self._connect()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="tokenloom-heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self._beat_store.add(f"{_BEAT}{self.rank}", 1)  # present from the start, so silence is measurable
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _beat(self) -> None:
        key = f"{_BEAT}{self.rank}"
        while not self._stop.wait(self.period_s):
            try:
                self._beat_store.add(key, 1)
            except (dist.DistError, RuntimeError):
                return  # the store is gone with rank 0: nothing left to tell

    def silent_peers(self, peers: Iterable[int], silence_s: float | None = None) -> list[int]:
        """The ranks among `peers` whose heartbeat did not advance over `silence_s` (default: 2.5 periods),
        or [] when the store cannot be read (then nothing can be said)."""
        peers = [p for p in peers if p != self.rank]
        if not peers:
            return []
        try:
            store = self._connect()  # this thread's own connection (the beating thread owns the other)
            before = [store.add(f"{_BEAT}{p}", 0) for p in peers]
            time.sleep(2.5 * self.period_s if silence_s is None else silence_s)
            after = [store.add(f"{_BEAT}{p}", 0) for p in peers]
        except (dist.DistError, RuntimeError):
            return []
        return [p for p, b, a in zip(peers, before, after, strict=True) if a == b]


def name_silent_peers(heartbeat: Heartbeat | None, peers: Iterable[int], label, error: BaseException) -> BaseException:
    """`error`, or, when some of `peers` stopped beating, a RuntimeError naming them (`label(rank)` gives a
    rank's name) with `error` as the detail. Used on the way out of a rank whose loop failed."""
    if heartbeat is None:
        return error
    with contextlib.suppress(Exception):
        silent = heartbeat.silent_peers(peers)
        if silent:
            names = ", ".join(label(p) for p in silent)
            return RuntimeError(f"{names} stopped responding (no heartbeat for "
                                f"{2.5 * heartbeat.period_s:g} s: hung or stopped); "
                                f"then: {type(error).__name__}: {error}")
    return error
