"""`PrefillAgent`: the transfer agent (agent.py) of a prefill server's rank: its `KVSender` (kv_sender.py: the
threads that write the room's KV into the decode ranks, each room's chunks in order on one of them), the decode
ranks' destinations, and on the entry the room's readiness ("ready" once every decode rank's "dst" is in), its
end ("sent" once every rank wrote its part) and the notices it owes the decode side.

Invariants:
- a notice that lets the decode side free a room's slots (the abort of a room given up on here, a let-go)
  leaves the entry only once no rank of this server can still write into them: the entry's own writes of the
  room are over and every other rank said "over" (or its own "sent"), or the transfer timeout passed (a
  write is bounded by it); a rank other than the entry says "over" once its own writes are over;
- a room this side gave up on (`_ended`, bounded) drops its chunks not written yet, on every rank that hears of
  it, and a destination arriving for it later is answered with an abort;
- a room that fails on the entry drops the entry's own chunks not written yet at once, before the scheduler
  drops the room: a chunk queued in between is not written into slots the decode side may be freeing (a
  single-rank prefill server's notice does not wait for any other rank).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any

from tokenloom.cache.kv_layout import KVLayout
from tokenloom.cache.pool_layout import PoolLayout
from tokenloom.disaggregation.agent import Handler, TransferAgent
from tokenloom.disaggregation.agent_config import AgentConfig
from tokenloom.disaggregation.aux_buffer import AuxBuffer
from tokenloom.disaggregation.kv_poll import KVPoll, RoomPoll
from tokenloom.disaggregation.kv_sender import KVSender
from tokenloom.disaggregation.transfer.base import TransferEngine
from tokenloom.protocol import Bootstrap

ENDED_ROOMS_KEPT = 4096  # rooms given up on, remembered after forget (a late destination gets an abort)


class PrefillAgent(TransferAgent):
    role = "prefill"

    def __init__(self, config: AgentConfig, engine: TransferEngine, layout: KVLayout | PoolLayout,
                 aux: AuxBuffer) -> None:
        super().__init__(config, engine, layout, aux)
        # rooms given up on here (reason, by the client, status): a destination arriving later (the decode half of
        # a request aborted here before its decode server had even seen it) is answered with an abort, else the
        # decode server would wait for KV that never comes
        self._ended: OrderedDict[int, tuple[str, bool, int | None]] = OrderedDict()
        # entry: room -> (peer entry, messages, deadline) sent once every rank's writes of the room are over, so
        # the decode side frees the room's slots only when no write can land in them any more (or at the
        # deadline: a write is bounded by the transfer timeout); held apart from the room's other state, which
        # the scheduler may forget first (a client abort racing the peer's)
        self._after_writes: dict[int, tuple[str, list[dict[str, Any]], float]] = {}
        # entry: room -> the other ranks that said their writes of it are over ("over"; kept after forget, as
        # `_ended`: a rank's "over" may come first, and a second notice of the room needs it again)
        self._writes_over: OrderedDict[int, set[int]] = OrderedDict()
        # not the entry: rooms given up on whose "over" goes to the entry once this rank's writes are
        self._report_over: set[int] = set()
        self._sender = KVSender(config, engine, self.layout, aux, self._send, lambda: self._world_control[0])
        self._start()

    def _handlers(self) -> dict[str, Handler]:
        return {"dst": self._on_dst, "sent": self._on_sent, "abort": self._on_abort, "over": self._on_over}

    # --- what the bootstrap server publishes about this rank -------------------------------------------------
    def registration(self, tp_size: int, pp_size: int) -> dict[str, Any]:
        me = self.config.me
        return {"role": "Prefill", "rank": me.rank, "attn_tp_size": tp_size, "attn_tp_rank": me.tp_rank,
                "attn_dp_size": 1, "attn_dp_rank": 0, "pp_size": pp_size, "pp_rank": me.pp_rank,
                "rank_ip": self.config.host, "rank_port": int(self.control_address.rsplit(":", 1)[1]),
                "page_size": self.config.page_size, "kv_cache_dtype": self.config.kv_dtype,
                "control": self.control_address, "engine": self.engine.descriptor(),
                "transfer_backend": self.engine.backend, "rank_kv": me.to_json(), "layout": self.layout.to_json()}

    # --- scheduler-thread API ----------------------------------------------------------------------------------
    def track_prefill(self, room: int) -> None:
        """The room waits in the bootstrap queue; the entry fails it if no destination comes in time."""
        self.channel.call(lambda: self._watch(room, self.config.bootstrap_timeout_s, "the decode server's "
                                              "destination (bootstrap timeout)"))

    def send_chunk(self, room: int, start: int, slots: list[int], is_last: bool, aux: bytes | None,
                   swa_slots: list[int] | None = None) -> None:
        """Write tokens [start, start + len(slots)) of the room (slots of this rank's pool) to the decode
        ranks; `aux`: the metadata slot's bytes (aux writer, last chunk); `swa_slots`: a sliding-window pool's
        swa slots of the same tokens (0: dropped already)."""
        self._sender.queue_chunk(room, start, slots, is_last, aux, swa_slots)

    def wait_chunks(self, room: int, timeout_s: float | None = None) -> None:
        """Return once every queued chunk of the room was written (or dropped): its source slots may then be
        re-pointed or freed."""
        self._sender.wait_room(room, timeout_s or self.config.transfer_timeout_s + 5)

    def drop_writes(self, room: int) -> None:
        """Any thread: the room failed; its chunks not written yet are dropped, so that `wait_chunks` returns
        once a write already running is over."""
        self._sender.drop(room)

    def _room_tables(self) -> dict[str, int]:
        return {"after_writes": len(self._after_writes), "report_over": len(self._report_over),
                **self._sender.room_records()}

    def close(self) -> None:
        self._sender.close()  # its threads' last notices still go out through the channel
        super().close()

    # --- control thread: giving up on rooms ------------------------------------------------------------------------
    def _remember_ended(self, room: int, reason: str, by_client: bool, status: int | None = None) -> None:
        self._ended[room] = (reason, by_client, status)
        while len(self._ended) > ENDED_ROOMS_KEPT:
            self._ended.popitem(last=False)

    def _fail_room(self, room: int, reason: str, writes_may_run: bool = False) -> None:
        self._remember_ended(room, reason, False)
        self._sender.drop(room)  # before the scheduler drops the room: no chunk queued meanwhile is written
        super()._fail_room(room, reason, writes_may_run)

    def _abort(self, room: int, reason: str, by_client: bool = False) -> None:
        self._remember_ended(room, reason, by_client)
        self._sender.drop(room)
        super()._abort(room, reason, by_client)

    def _refuse(self, room: int, bootstrap: Bootstrap, reason: str, status: int) -> None:
        self._remember_ended(room, reason, False, status)

    def _on_abort(self, room: int, msg: dict[str, Any]) -> None:
        if not self.config.is_entry or msg.get("let_go") is True:
            return
        if room in self._ended:
            return  # given up on here already (both sides aborted at once): the peer was or will be told
        self._failure_event(room, msg)
        self._sender.drop(room)  # the entry's own remaining chunks of the room
        # the decode side keeps the room's slots until it hears this
        self._notify_peer(room, "the prefill server let go of the aborted request", after_writes=True, let_go=True)

    def _notify_peer(self, room: int, reason: str, by_client: bool = False, status: int | None = None,
                     after_writes: bool = False, let_go: bool = False) -> None:
        if after_writes and not self.config.is_entry:
            self._report_over.add(room)
        if not self.config.is_entry:
            return
        peer = self._peer_entry.get(room)
        if peer is None:  # no destination came: the decode side learns of it when one does (`_ended`)
            return
        msg = self._peer_message(room, reason, by_client, status, let_go)
        if after_writes:
            held = self._after_writes.get(room)
            deadline = time.monotonic() + self.config.transfer_timeout_s
            self._after_writes[room] = (peer, [*held[1], msg], held[2]) if held else (peer, [msg], deadline)
            return
        self._send(peer, msg)

    def _tick(self) -> None:
        super()._tick()
        if self._after_writes or self._report_over:
            self._flush_after_writes()

    def _flush_after_writes(self) -> None:
        """A rank other than the entry tells the entry of the rooms whose writes (its own) are over; the entry
        sends the notices it held of rooms whose writes are over on every rank."""
        entry = self._world_control[0]
        for room in self._sender.writes_over(list(self._report_over)):
            self._report_over.discard(room)
            self._send(entry, {"t": "over", "room": room, "rank": self.config.me.rank})
        others = {r.rank for r in self.config.world} - {self.config.me.rank}
        now = time.monotonic()
        for room in self._sender.writes_over(list(self._after_writes)):
            peer, msgs, deadline = self._after_writes[room]
            if others <= self._writes_over.get(room, set()) or now >= deadline:
                del self._after_writes[room]
                for msg in msgs:
                    self._send(peer, msg)

    def _on_over(self, room: int, msg: dict[str, Any]) -> None:
        if not self.config.is_entry or len(self.config.world) == 1:
            return
        self._writes_over.setdefault(room, set()).add(int(msg["rank"]))
        while len(self._writes_over) > ENDED_ROOMS_KEPT:
            self._writes_over.popitem(last=False)

    def _forget(self, room: int) -> None:
        super()._forget(room)
        self._sender.forget(room)

    # --- control thread: a room's transfer -------------------------------------------------------------------------
    def _on_dst(self, room: int, msg: dict[str, Any]) -> None:
        if room in self._ended:
            reason, by_client, status = self._ended[room]
            if self.config.is_entry:
                self._send(msg["entry"], {"t": "abort", "room": room, "detail": reason, "by_client": by_client,
                                          "status": status})
            return
        decode_rank = int(msg["decode_rank"])
        self._sender.add_destination(room, decode_rank, msg)
        if self.config.is_entry:
            self._peer_entry[room] = msg["entry"]
            decode_tp = 1 + max(int(r["tp_rank"]) for r in msg["decode_ranks"])
            wanted = self.config.expected_decode_tp
            if wanted is not None and decode_tp != wanted:
                self._fail_room(room, f"the decode server has --tp-size {decode_tp}, this prefill server was "
                                f"started with --disaggregation-decode-tp {wanted}")
                return
            poll = self._polls.setdefault((room, "dst"), RoomPoll(len(msg["decode_ranks"])))
            before = poll.state()
            if poll.report(decode_rank, KVPoll.WaitingForInput) is KVPoll.WaitingForInput and \
                    before is KVPoll.Bootstrapping and room not in self._reported:
                self._deadlines.cancel(room)
                self._watch(room, self.config.waiting_timeout_s, "the KV transfer to finish")
                self._event(room, "ready")

    def _on_sent(self, room: int, msg: dict[str, Any]) -> None:
        if not self.config.is_entry:
            return
        self._on_over(room, msg)  # a rank's "sent" follows its last write of the room
        if room in self._ended:  # given up here already: a rank's dropped last chunk is not news for the peer
            return  # (failing the room now would tell the decode side at once, while other ranks still write)
        self._conclude(room, "sent", msg)
