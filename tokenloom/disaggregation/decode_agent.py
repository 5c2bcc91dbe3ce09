"""`DecodeAgent`: the transfer agent (agent.py) of a decode server's rank: it finds each room's prefill server
(its bootstrap answer, checked for compatibility: `PrefillDirectory`), tells the prefill ranks where the room's
KV goes ("dst"), learns from each writer that its part is written ("done"), and on the entry reports the room
"bootstrapped", "arrived" (every rank holds its KV) or "failed", watches the prefill servers' health, and bounds
the wait of a room whose slots are kept for writes that may still run ("draining").

Invariants:
- a room that fails while a prefill rank may still write into its slots (a writer failed while another
  writes, the transfer timed out, the prefill server stopped answering its heartbeats: frozen, it may resume
  mid-write) is reported with `writes_may_run`, so the scheduler keeps the slots until the prefill side lets go;
- "let_go" reaches the scheduler for every notice from the prefill side of a room this side reported already
  (the prefill side sends its notices only once its writes are over), at a drain's bound (the transfer
  timeout + 5 s) if no notice ever comes, and, for a room of a prefill server that missed its heartbeats, as
  soon as every rank of that server is gone (its control socket refuses connections: the process exited, so
  none of its writes can land any more; a frozen one still accepts them);
- a bootstrap answer that comes after the scheduler forgot the room is dropped (the room failed or ended
  already; it must not fail again).
"""

from __future__ import annotations

import logging
from typing import Any

from tokenloom.cache.kv_layout import KVLayout
from tokenloom.cache.pool_layout import PoolLayout
from tokenloom.disaggregation.agent import Handler, TransferAgent
from tokenloom.disaggregation.agent_config import AgentConfig
from tokenloom.disaggregation.aux_buffer import AuxBuffer
from tokenloom.disaggregation.bootstrap_server import check_health
from tokenloom.disaggregation.clocks import Heartbeats, RoomTimers, Target, ranks_gone
from tokenloom.disaggregation.pairing import RankKV, aux_writer, senders_for
from tokenloom.disaggregation.prefill_directory import PREFILL_INFO_FRESH_S, PrefillDirectory
from tokenloom.disaggregation.transfer.base import TransferEngine
from tokenloom.protocol import Bootstrap, TransferEvent

logger = logging.getLogger(__name__)

DRAIN_MARGIN_S = 5.0  # a drain's bound past the transfer timeout (no write of the room runs longer than that)


class DecodeAgent(TransferAgent):
    role = "decode"

    def __init__(self, config: AgentConfig, engine: TransferEngine, layout: KVLayout | PoolLayout,
                 aux: AuxBuffer) -> None:
        super().__init__(config, engine, layout, aux)
        self._prefill_servers = PrefillDirectory(config.page_size, config.kv_dtype, engine.backend, config.world,
                                                 self.layout, config.bootstrap_timeout_s)
        self._expected: dict[int, set[int]] = {}  # room -> prefill ranks that must say "done"
        self._done: dict[int, set[int]] = {}  # room -> prefill ranks that said "done"
        self._room_prefill: dict[int, Target] = {}  # entry: room -> its prefill's bootstrap
        self._heartbeats = Heartbeats(config.heartbeat_interval_s, config.heartbeat_max_failure)  # entry
        self._drain_bounds: RoomTimers[None] = RoomTimers()  # entry: failed rooms whose slots wait for a let-go
        self._lost: set[Target] = set()  # entry: prefill servers that missed their heartbeats (until one answers)
        self._writers: dict[int, list[str]] = {}  # entry: room -> control addresses of its prefill server's ranks
        self._gone_checks: RoomTimers[None] = RoomTimers()  # entry: draining rooms of a lost prefill server
        self._start()

    def _handlers(self) -> dict[str, Handler]:
        return {"done": self._on_done, "arrived": self._on_arrived, "abort": self._on_abort}

    # --- scheduler-thread API ----------------------------------------------------------------------------------
    def track_decode(self, room: int, bootstrap: Bootstrap) -> None:
        """The room waits for pre-allocation; the entry looks the prefill server up and reports "bootstrapped"
        (or "failed": unreachable, incompatible)."""
        self.channel.call(lambda: self._bootstrap_decode(room, bootstrap))

    def send_metadata(self, room: int, prefill_info: dict[str, Any], slots: list[int], aux_index: int,
                      swa_slots: list[int] | None = None) -> None:
        """The room's KV was pre-allocated at `slots` (this rank's pool; `swa_slots`: their swa slots in a
        sliding-window pool) and its metadata slot at `aux_index`; tell the prefill ranks (`prefill_info`: the
        "bootstrapped" event's layout) where to write."""
        self.channel.call(lambda: self._send_dst(room, prefill_info, slots, aux_index, swa_slots))

    def bound_drain(self, room: int) -> None:
        """The scheduler keeps a failed room's slots until the prefill side lets go; if it never does, a "let_go"
        comes at the bound (the transfer timeout + 5 s: no write runs longer)."""
        if self.config.is_entry:  # the entry's clock; every rank ends the drain on the same let-go event
            self.channel.call(lambda: self._bound_drain(room))

    def _bound_drain(self, room: int) -> None:
        self._drain_bounds.set(room, self.config.transfer_timeout_s + DRAIN_MARGIN_S, None)
        if self._room_prefill.get(room) in self._lost and self._writers.get(room):
            self._gone_checks.set(room, 0.0, None)  # a dead prefill server lets go of nothing: look at its ranks

    def _room_tables(self) -> dict[str, int]:
        return {"expected": len(self._expected), "done": len(self._done), "room_prefill": len(self._room_prefill),
                "drain_bounds": len(self._drain_bounds), "writers": len(self._writers),
                "gone_checks": len(self._gone_checks)}

    # --- control thread: clocks and health -------------------------------------------------------------------
    def _check_clocks(self, now: float) -> None:
        super()._check_clocks(now)
        for room, _ in self._drain_bounds.expired(now):  # no write of the room can still run
            self.channel.event(TransferEvent(room, "let_go"))
        for target in self._heartbeats.due(now):
            self.channel.probe(self._probe, target)
        for room, _ in self._gone_checks.expired(now):
            self.channel.probe(self._check_gone, room, self._writers.get(room, []))

    def _probe(self, target: Target) -> None:
        healthy = check_health(target[0], target[1], timeout_s=min(2.0, self.config.heartbeat_interval_s))
        self.channel.call(lambda: self._on_probe(target, healthy))

    def _on_probe(self, target: Target, healthy: bool) -> None:
        misses = self._heartbeats.record(target, healthy)
        if misses is None:
            return
        rooms = [r for r, t in self._room_prefill.items() if t == target and r not in self._reported]
        logger.warning("prefill server %s:%d missed %d heartbeats: failing %d rooms", *target, misses, len(rooms))
        self._lost.add(target)
        for room in rooms:  # a frozen prefill server may resume mid-write: rooms in transfer keep their slots
            self._fail_room(room, f"the prefill server at {target[0]}:{target[1]} stopped responding",
                            writes_may_run=True)
        self._prefill_servers.forget(target)

    def _check_gone(self, room: int, writers: list[str]) -> None:
        gone = bool(writers) and ranks_gone(writers, timeout_s=min(2.0, self.config.heartbeat_interval_s))
        self.channel.call(lambda: self._on_gone_check(room, gone))

    def _on_gone_check(self, room: int, gone: bool) -> None:
        if room not in self._drain_bounds:  # the drain ended meanwhile
            return
        if gone:  # no process of that server is left to write into the room's slots
            self._drain_bounds.cancel(room)
            self.channel.event(TransferEvent(room, "let_go"))
        else:
            self._gone_checks.set(room, self.config.heartbeat_interval_s, None)

    # --- control thread: giving up on rooms ------------------------------------------------------------------------
    def _fail_room(self, room: int, reason: str, writes_may_run: bool = False) -> None:
        target = self._room_prefill.get(room)
        if target is not None:  # its layout is looked up again next time (the prefill server may have restarted)
            self._prefill_servers.forget(target)
        super()._fail_room(room, reason, writes_may_run)

    def _abort(self, room: int, reason: str, by_client: bool = False) -> None:
        super()._abort(room, reason, by_client)
        # its slots stay reserved until the room's final event: bound the wait (at the bound no write of the
        # room can still run, so the failure it ends in lets the slots go)
        self._watch(room, self.config.transfer_timeout_s + DRAIN_MARGIN_S,
                    "the prefill server to let go of the aborted room", writes_may_run=False)

    def _refuse(self, room: int, bootstrap: Bootstrap, reason: str, status: int) -> None:
        if self.config.is_entry:
            self._room_prefill.setdefault(room, (bootstrap.host, bootstrap.port))
            self._notify_peer(room, reason, status=status)
            self._room_prefill.pop(room, None)

    def _on_abort(self, room: int, msg: dict[str, Any]) -> None:
        if not self.config.is_entry:
            return
        if msg.get("let_go") is True:  # a room given up on here mid-transfer may free its slots now
            self.channel.event(TransferEvent(room, "let_go"))
            return
        if room in self._reported:
            if msg.get("by_client") is True:  # its KV arrived (the request may be decoding): still the client's abort
                self.channel.event(TransferEvent(room, "client_abort", "Aborted by the client (on the peer "
                                                 "server)."))
            # this side failed the room first, or its KV arrived: the prefill side sends its notices only once its
            # writes are over, whether its own client's abort or the answer to this side's, so a drain may end
            self.channel.event(TransferEvent(room, "let_go"))
            return
        self._failure_event(room, msg)

    def _notify_peer(self, room: int, reason: str, by_client: bool = False, status: int | None = None,
                     after_writes: bool = False, let_go: bool = False) -> None:
        """A decode entry that has not sent the room's destination yet finds the prefill entry from the room's
        bootstrap (a look-up off this thread); nothing is held for writes (none land on the prefill side)."""
        if not self.config.is_entry:
            return
        msg = self._peer_message(room, reason, by_client, status, let_go)
        peer = self._peer_entry.get(room)
        if peer is not None:
            self._send(peer, msg)
            return
        target = self._room_prefill.get(room)
        if target is None:
            return

        def resolve() -> None:
            try:
                info = self._prefill_servers.layout(target)
                entry = min(info["ranks"], key=lambda r: int(r["rank_kv"]["rank"]))["control"]
            except Exception:  # noqa: BLE001 - an unreachable prefill times the room out by itself
                return
            self._send(entry, msg)

        self.channel.submit(resolve)

    def _forget(self, room: int) -> None:
        super()._forget(room)
        for table in (self._expected, self._done, self._room_prefill, self._writers):
            table.pop(room, None)
        self._drain_bounds.cancel(room)
        self._gone_checks.cancel(room)

    # --- control thread: a room's transfer -------------------------------------------------------------------------
    def _bootstrap_decode(self, room: int, bootstrap: Bootstrap) -> None:
        if not self.config.is_entry:
            return
        target = (bootstrap.host, bootstrap.port)
        self._room_prefill[room] = target
        self._heartbeats.track(target)
        self._watch(room, self.config.bootstrap_timeout_s, f"the prefill server's bootstrap at {target[0]}:"
                    f"{target[1]}")

        def fetch() -> None:
            info = None
            try:
                info = self._prefill_servers.layout(target, PREFILL_INFO_FRESH_S)
                problem = self._prefill_servers.incompatibility(info)
            except Exception as e:  # noqa: BLE001 - reported as the room's failure
                problem = f"cannot reach the prefill server's bootstrap at {target[0]}:{target[1]}: {e}"
            self.channel.call(lambda: self._on_bootstrapped(room, problem, info))

        self.channel.submit(fetch)

    def _on_bootstrapped(self, room: int, problem: str | None, info: dict[str, Any] | None) -> None:
        if room in self._reported or room not in self._room_prefill:  # failed (and maybe forgotten) meanwhile
            return
        if problem is not None:
            self._fail_room(room, problem)
            return
        self._lost.discard(self._room_prefill[room])  # it answers again (restarted)
        self._deadlines.cancel(room)
        self.channel.event(TransferEvent(room, "bootstrapped", data=info))

    def _send_dst(self, room: int, info: dict[str, Any], slots: list[int], aux_index: int,
                  swa_slots: list[int] | None = None) -> None:
        ranks = info["ranks"]
        prefill_world = [RankKV.from_json(r["rank_kv"]) for r in ranks]
        control = {int(r["rank_kv"]["rank"]): r["control"] for r in ranks}
        me = self.config.me
        writer_of_aux = aux_writer(prefill_world).rank
        self._expected[room] = set(senders_for(me, prefill_world))
        self._done[room] = set()
        self._peer_entry[room] = control[min(control)]
        msg = {"t": "dst", "room": room, "decode_rank": me.rank,
               "decode_ranks": [r.to_json() for r in self.config.world], "engine": self.engine.descriptor(),
               "layout": self.layout.to_json(), "slots": slots, "swa_slots": swa_slots,
               "status": self.control_address,
               "entry": self._world_control[0]}
        for rank in sorted(control):  # every prefill rank, so each knows at once whether it writes anything
            self._send(control[rank], {**msg, "aux_addr": self.aux.slot_addr(aux_index) if rank == writer_of_aux
                                       else None})
        if self.config.is_entry:
            self._writers[room] = [control[rank] for rank in sorted(control)]
            self._watch(room, self.config.waiting_timeout_s, "the KV transfer from the prefill server")
        self.engine.expect_incoming(True)

    def _on_done(self, room: int, msg: dict[str, Any]) -> None:
        if room not in self._expected:
            return
        if not msg.get("ok"):
            self._report_arrived(room, False, msg.get("detail") or "the KV transfer failed")
            return
        self._done[room].add(int(msg["rank"]))
        if self._expected[room] <= self._done[room]:
            self._report_arrived(room, True, "")

    def _report_arrived(self, room: int, ok: bool, detail: str) -> None:
        self._expected.pop(room, None)
        if not self._expected:
            self.engine.expect_incoming(False)
        self._send(self._world_control[0], {"t": "arrived", "room": room, "rank": self.config.me.rank, "ok": ok,
                                            "detail": detail})

    def _on_arrived(self, room: int, msg: dict[str, Any]) -> None:
        if not self.config.is_entry:
            return
        self._conclude(room, "arrived", msg)
