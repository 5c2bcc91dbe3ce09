"""`KVSender`: a prefill rank's KV writes into the decode ranks, on sender threads (one part of `TransferAgent`).

What it owns: the sender threads and their job queues, each room's destinations (the decode ranks' "dst"
messages), the rooms whose remaining jobs are dropped, and the count of each room's queued or running jobs;
all of it under one condition variable, shared by the agent's control thread (destinations, aborts) and the
scheduler thread (new chunks, waits).

Invariants: a room's chunks all go to the same thread, in the order the scheduler queued them, so a slow or
frozen peer holds up only the rooms that share its thread; a room's job count reaches 0 only once no write of
it can land in a decode pool any more (written, failed or dropped), which is what `writes_over` and
`wait_room` report. After a room's last chunk (or its first failure) the thread tells every decode rank it
wrote to ("done") and the prefill entry ("sent"), through the agent's `send`.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tokenloom.cache.pool_layout import PoolLayout
from tokenloom.disaggregation.agent_config import SENDER_THREADS, AgentConfig, test_failure_prob
from tokenloom.disaggregation.aux_buffer import AuxBuffer
from tokenloom.disaggregation.pairing import RankKV, write_targets
from tokenloom.disaggregation.transfer.base import TransferEngine, TransferError

logger = logging.getLogger(__name__)

Targets = list[tuple[dict[str, Any], list[tuple[range, range]]]]  # (a decode rank's "dst", its (layers, heads))


@dataclass
class _Job:
    """One KV chunk of a room for the sender thread: tokens [start, start + len(slots)) at `slots`."""

    room: int
    start: int
    slots: list[int]
    is_last: bool
    aux: bytes | None
    swa_slots: list[int] | None = None  # a sliding-window pool's swa slots of the same tokens


class KVSender:
    def __init__(self, config: AgentConfig, engine: TransferEngine, layout: PoolLayout, aux: AuxBuffer,
                 send: Callable[[str, dict[str, Any]], None], entry_address: Callable[[], str]) -> None:
        """`send(address, msg)`: the agent's control-message send (thread-safe); `entry_address()`: the prefill
        entry rank's control address (known only once the server's ranks exchanged theirs)."""
        self.config = config
        self.engine = engine
        self.layout = layout
        self.aux = aux
        self._send = send
        self._entry_address = entry_address
        self._cond = threading.Condition()
        self._dst: dict[int, dict[int, dict[str, Any]]] = {}  # room -> decode rank -> its "dst" message
        self._dropped: set[int] = set()  # rooms whose remaining jobs are dropped
        self._pending: dict[int, int] = {}  # room -> jobs queued or running
        self._queues: list[queue.SimpleQueue[_Job | None]] = [queue.SimpleQueue() for _ in range(SENDER_THREADS)]
        self._threads = [threading.Thread(target=self._loop, args=(jobs, i), name=f"tokenloom-pd-sender{i}",
                                          daemon=True) for i, jobs in enumerate(self._queues)]
        for thread in self._threads:
            thread.start()

    # --- scheduler thread ----------------------------------------------------------------------------------
    def queue_chunk(self, room: int, start: int, slots: list[int], is_last: bool, aux: bytes | None,
                    swa_slots: list[int] | None = None) -> None:
        with self._cond:
            self._pending[room] = self._pending.get(room, 0) + 1
        self._queues[room % len(self._queues)].put(_Job(room, start, slots, is_last, aux, swa_slots))

    def wait_room(self, room: int, timeout_s: float) -> None:
        """Return once every queued chunk of the room was written or dropped (or after `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._pending.get(room, 0) > 0 and time.monotonic() < deadline:
                self._cond.wait(0.05)

    # --- control thread --------------------------------------------------------------------------------------
    def add_destination(self, room: int, decode_rank: int, msg: dict[str, Any]) -> None:
        with self._cond:
            self._dst.setdefault(room, {})[decode_rank] = msg
            self._cond.notify_all()

    def drop(self, room: int) -> None:
        """The room was given up on: its jobs not started yet are dropped, a job waiting for destinations
        stops waiting."""
        with self._cond:
            self._dropped.add(room)
            self._cond.notify_all()

    def forget(self, room: int) -> None:
        with self._cond:
            self._dst.pop(room, None)
            self._dropped.discard(room)

    def room_records(self) -> dict[str, int]:
        """Per-room records held (destinations, dropped marks, pending job counts), by table: 0s once idle and
        forgotten."""
        with self._cond:
            return {"sender_dst": len(self._dst), "sender_dropped": len(self._dropped),
                    "sender_pending": len(self._pending)}

    def writes_over(self, rooms: list[int]) -> list[int]:
        """Those of `rooms` with no job queued or running."""
        with self._cond:
            return [room for room in rooms if self._pending.get(room, 0) == 0]

    def close(self) -> None:
        for jobs in self._queues:
            jobs.put(None)
        for thread in self._threads:
            thread.join(timeout=2)

    # --- sender threads --------------------------------------------------------------------------------------
    def _loop(self, jobs: queue.SimpleQueue[_Job | None], staging: int) -> None:
        """One sender thread; `staging`: its own slot of the (prefill) metadata buffer, where it places a
        room's metadata before writing it to the decode ranks."""
        while True:
            job = jobs.get()
            if job is None:
                return
            try:
                self._run(job, staging % self.aux.num_slots)
            except Exception:  # noqa: BLE001 - reported as the room's failure below
                logger.exception("KV sender: room %d failed", job.room)
                self.drop(job.room)  # its later chunks are not written: "sent" is this rank's last word on it
                self._send(self._entry_address(), {"t": "sent", "room": job.room, "rank": self.config.me.rank,
                                                   "ok": False, "detail": "the KV sender failed"})
            finally:
                with self._cond:
                    self._pending[job.room] -= 1
                    if self._pending[job.room] <= 0:
                        del self._pending[job.room]
                    self._cond.notify_all()

    def _run(self, job: _Job, staging: int) -> None:
        me = self.config.me
        targets = self._wait_targets(job.room)
        if targets is None:  # dropped or timed out: the entry fails the room (or already did)
            if job.is_last:
                self._send(self._entry_address(), {"t": "sent", "room": job.room, "rank": me.rank, "ok": False,
                                                   "detail": "no destination for the KV (aborted or timed out)"})
            return
        failure = None
        try:
            if random.random() < test_failure_prob():
                raise TransferError("injected transfer failure (TEST_FAILURE_PROB)")
            for msg, pieces in targets:
                dst_layout = PoolLayout.from_json(msg["layout"])
                span = slice(job.start, job.start + len(job.slots))
                dst_slots = msg["slots"][span]
                dst_swa = msg["swa_slots"][span] if msg.get("swa_slots") is not None else None
                runs: list[tuple[int, int, int]] = []
                for layers, heads in pieces:
                    runs += self.layout.runs(dst_layout, job.slots, dst_slots, job.swa_slots, dst_swa, layers=layers,
                                             heads=heads)
                if job.is_last and job.aux is not None and msg.get("aux_addr") is not None:
                    self.aux.write(staging, job.aux)
                    runs.append((self.aux.slot_addr(staging), int(msg["aux_addr"]), len(job.aux)))
                if runs:
                    self.engine.write(msg["engine"], runs, self.config.transfer_timeout_s)
        except (TransferError, ValueError) as e:
            failure = f"KV transfer from prefill rank {me.rank} failed: {e}"
            logger.warning("room %d: %s", job.room, failure)
        if failure is None and not job.is_last:
            return
        for msg, _ in targets:
            self._send(msg["status"], {"t": "done", "room": job.room, "rank": me.rank, "ok": failure is None,
                                       "detail": failure or ""})
        self._send(self._entry_address(), {"t": "sent", "room": job.room, "rank": me.rank, "ok": failure is None,
                                           "detail": failure or ""})
        if failure is not None:
            self.drop(job.room)

    def _wait_targets(self, room: int) -> Targets | None:
        """The decode ranks this rank writes into for `room` and the (layers, heads) pieces of each, once
        every one of them sent its destination; None if the room was dropped or the wait timed out."""
        me = self.config.me
        deadline = time.monotonic() + self.config.waiting_timeout_s
        with self._cond:
            while True:
                if room in self._dropped:
                    return None
                got = self._dst.get(room, {})
                if got:
                    decode_world = [RankKV.from_json(r) for r in next(iter(got.values()))["decode_ranks"]]
                    targets = write_targets(me, self.config.world, decode_world)
                    if all(rank in got for rank, _ in targets):
                        return [(got[rank], pieces) for rank, pieces in targets]
                if time.monotonic() >= deadline:
                    return None
                self._cond.wait(0.05)
