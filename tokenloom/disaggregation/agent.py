"""`TransferAgent`: what both roles' agents share (prefill_agent.py's `PrefillAgent`, decode_agent.py's
`DecodeAgent`). One agent per scheduler rank of a prefill or decode server; it moves this rank's KV and talks
to the peer server's ranks, so the scheduler never blocks on the network.

What an agent owns: the transfer engine (transfer/) with this rank's KV pool and metadata buffer registered, its
`ControlChannel` (control_channel.py: sockets, the control thread, the look-up pool), and the rooms'
bookkeeping, touched only on the control thread. The scheduler's side (prefill.py, decode.py) calls the public
methods, which never block on the network: each hands its work to the control thread.

Protocol (room = the router's bootstrap room):
- decode rank d, once the scheduler pre-allocated the room: "dst" (its engine, KV layout, slots — and their swa
  slots in a sliding-window pool, cache/pool_layout.py — metadata slot address, status address, the decode
  world's layout) → every prefill rank that writes part of d's KV (pairing.writers_for), the aux writer and the
  prefill entry;
- prefill entry: once every decode rank's "dst" is in → event "ready" (the request may be prefilled);
- prefill rank p, after each KV chunk of the room (sender thread): writes its pieces into every decode rank
  it serves; after the last chunk (and the metadata slot, for the aux writer) → "done" to each of them and
  "sent" to the prefill entry;
- decode rank d: once every expected writer said "done" → "arrived" to the decode entry;
- entries: "sent" from every prefill rank → event "sent" (the KV may be released); "arrived" from every
  decode rank → event "arrived" (the request may decode); any failure → event "failed" (and "abort" to the
  peer entry, so the other side frees the room at once rather than at its timeout).
- a room the prefill side gives up on: a prefill rank other than the entry says "over" to its entry once its
  own writes of the room are over (a rank's "sent" counts as that too); the entry holds its notices to the
  decode side (the abort, the let-go) until every rank's writes are over (or the transfer timeout passed),
  so the decode side frees the room's slots only when no prefill rank can still write into them.
Events are `TransferEvent`s pushed into the entry rank's own scheduler inbox; they reach every rank of the
server the way requests do, so all ranks act on them at the same iteration (no collective needed). A room's
final event ("sent", "arrived", "failed") goes out at most once while the scheduler has not forgotten the
room.

Clocks are read only by the entry (clocks.py): bootstrap timeout (prefill: no "dst" in time), waiting timeout
(decode: no "arrived" in time), heartbeats (decode: the prefill's bootstrap /health), each ending as a "failed"
event; the decode side's drain bounds, each ending as a "let_go" event. Environment:
TOKENLOOM_DISAGGREGATION_{BOOTSTRAP_TIMEOUT, WAITING_TIMEOUT, HEARTBEAT_INTERVAL, HEARTBEAT_MAX_FAILURE,
TRANSFER_TIMEOUT, TEST_FAILURE_PROB} (SGLang's SGLANG_DISAGGREGATION_* names and
DISAGGREGATION_TEST_FAILURE_PROB are read too).
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from tokenloom.cache.kv_layout import KVLayout
from tokenloom.cache.pool_layout import PoolLayout
from tokenloom.disaggregation.agent_config import AgentConfig
from tokenloom.disaggregation.aux_buffer import AuxBuffer
from tokenloom.disaggregation.clocks import RoomTimers
from tokenloom.disaggregation.control_channel import ControlChannel
from tokenloom.disaggregation.kv_poll import KVPoll, RoomPoll
from tokenloom.disaggregation.transfer.base import TransferEngine
from tokenloom.protocol import Bootstrap, TransferEvent

logger = logging.getLogger(__name__)

MESSAGE_KINDS = ("dst", "sent", "done", "arrived", "abort", "over")  # what peers may send; each role handles some

Handler = Callable[[int, dict[str, Any]], None]


class TransferAgent(ABC):
    role = ""

    def __init__(self, config: AgentConfig, engine: TransferEngine, layout: KVLayout | PoolLayout,
                 aux: AuxBuffer) -> None:
        """A role's agent calls `_start()` last in its constructor (its state exists before messages come).
        `layout`: this rank's KV memory (a sliding-window pool's is two buffers, both registered)."""
        self.config = config
        self.engine = engine
        self.layout = PoolLayout.of(layout)
        self.aux = aux
        for addr, nbytes in self.layout.regions():
            engine.register(addr, nbytes)
        engine.register(aux.base_addr, aux.nbytes)
        self.channel = ControlChannel(config.host, config.events_address)
        self.control_address = self.channel.address
        self._world_control: list[str] = [self.control_address]  # every rank's, by rank (set_world_control)
        # --- room state, control thread only ---
        # entry: room -> (what it waits for, whether writes into its slots may still run when that times out)
        self._deadlines: RoomTimers[tuple[str, bool]] = RoomTimers()
        self._reported: set[int] = set()  # entry: rooms whose final event went out
        # entry: room -> the room's KVPoll on each rank that reports to it (prefill: the decode ranks' "dst", then
        # this server's ranks' "sent"; decode: this server's ranks' "arrived"); the room moves on when all agree
        self._polls: dict[tuple[int, str], RoomPoll] = {}
        self._peer_entry: dict[int, str] = {}  # room -> the peer server's entry control address

    def _start(self) -> None:
        self.channel.start(self._on_message, self._tick)

    @abstractmethod
    def _handlers(self) -> dict[str, Handler]:
        """The control messages this role handles (those of the other role are ignored)."""

    # --- scheduler-thread API (never blocks on the network) ------------------------------------------------
    def abort(self, room: int, reason: str, by_client: bool = False) -> None:
        """Either side: the scheduler gave up on the room (client abort, failure): drop its remaining work and
        tell the peer server's entry (`by_client`: the client asked, so the peer ends its half as an abort, not
        as an error)."""
        self.channel.call(lambda: self._abort(room, reason, by_client))

    def refuse(self, room: int, bootstrap: Bootstrap, reason: str, status: int) -> None:
        """Either side: a request of the room was refused at the door (a full queue, a bad request): its peer
        half is told to end too, instead of waiting for this side until a timeout (a decode entry reaches the
        prefill entry through the request's bootstrap address; a prefill server answers the decode's
        destination with an abort when it comes)."""
        self.channel.call(lambda: self._refuse(room, bootstrap, reason, status))

    def finished_failed(self, room: int, reason: str) -> None:
        """The scheduler let go of a failed or aborted room (no transfer reads or writes its KV any more):
        the peer entry may free its side of it once no rank of this server writes it any more."""
        self.channel.call(lambda: self._notify_peer(room, reason, after_writes=True, let_go=True))

    def forget(self, room: int) -> None:
        """The scheduler is done with the room (its final event was handled): drop its bookkeeping."""
        self.channel.call(lambda: self._forget(room))

    def room_records(self) -> dict[str, int]:
        """The per-room records this rank's agent holds for rooms in progress, by table, the empty ones left out
        (any thread; a snapshot): empty once every room ended and the scheduler forgot it. Not counted: the
        bounded memories of rooms given up on, kept on purpose for late messages."""
        held = {"deadlines": len(self._deadlines), "reported": len(self._reported), "polls": len(self._polls),
                "peer_entry": len(self._peer_entry), **self._room_tables()}
        return {name: n for name, n in held.items() if n}

    def _room_tables(self) -> dict[str, int]:
        """The role's own per-room tables, by name, for `room_records`."""
        return {}

    def set_world_control(self, addresses: list[str]) -> None:
        """The control address of every rank of this server, by rank (exchanged at start-up)."""
        self._world_control = list(addresses)

    def close(self) -> None:
        self.channel.stop()
        self.engine.close()
        self.channel.close()

    # --- control thread --------------------------------------------------------------------------------------
    def _on_message(self, kind: str, room: int, msg: dict[str, Any]) -> None:
        handler = self._handlers().get(kind)
        if handler is not None:
            handler(room, msg)
        elif kind not in MESSAGE_KINDS:
            logger.warning("transfer agent: unknown control message %r", kind)

    def _send(self, address: str, msg: dict[str, Any]) -> None:
        self.channel.send(address, msg)

    def _tick(self) -> None:
        if self.config.is_entry:
            self._check_clocks(time.monotonic())

    def _check_clocks(self, now: float) -> None:
        for room, (what, writes_may_run) in self._deadlines.expired(now):
            self._fail_room(room, f"timed out waiting for {what}", writes_may_run=writes_may_run)

    def _watch(self, room: int, timeout_s: float, what: str, writes_may_run: bool = True) -> None:
        """Entry: fail the room if it is still unreported in `timeout_s` (`writes_may_run`: whether a prefill
        rank may then still be writing into its slots)."""
        if self.config.is_entry and room not in self._reported:
            self._deadlines.set(room, timeout_s, (what, writes_may_run))

    def _event(self, room: int, kind: str, detail: str = "", data: Any = None) -> None:
        """Entry: push the room's event into this rank's scheduler inbox (once per final outcome)."""
        if kind in ("sent", "arrived", "failed"):
            if room in self._reported:
                return
            self._reported.add(room)
            self._deadlines.cancel(room)
        self.channel.event(TransferEvent(room, kind, detail, data))

    def _fail_room(self, room: int, reason: str, writes_may_run: bool = False) -> None:
        """Entry: the room failed on this side; tell the peer entry (a prefill entry once no rank of this server
        writes the room any more: a rank's write may still run when another's failed or timed out) and the
        scheduler (`writes_may_run`: a prefill rank may still be writing the room's KV, as when a decode rank
        saw one writer fail or the transfer timed out; the decode scheduler then keeps the slots until let go)."""
        self._notify_peer(room, reason, after_writes=True)
        self._event(room, "failed", reason, {"writes_may_run": True} if writes_may_run else None)

    def _peer_message(self, room: int, reason: str, by_client: bool, status: int | None,
                      let_go: bool) -> dict[str, Any]:
        return {"t": "abort", "room": room, "detail": reason, "by_client": by_client, "status": status,
                "let_go": let_go}

    @abstractmethod
    def _notify_peer(self, room: int, reason: str, by_client: bool = False, status: int | None = None,
                     after_writes: bool = False, let_go: bool = False) -> None:
        """Entry: tell the peer server's entry that this side gave up on (or is done failing) the room.
        `after_writes` (prefill): only once every rank's writes of the room are over. `let_go`: not news of a
        failure (the peer knows, it told this side or was told) but that this side is done with the room: the
        peer frees what it kept for it, and counts nothing."""

    def _abort(self, room: int, reason: str, by_client: bool = False) -> None:
        if room not in self._reported:
            self._notify_peer(room, reason, by_client, after_writes=True)
        self._deadlines.cancel(room)

    @abstractmethod
    def _refuse(self, room: int, bootstrap: Bootstrap, reason: str, status: int) -> None:
        """A request of the room was refused at this server's door (control thread)."""

    def _failure_event(self, room: int, msg: dict[str, Any]) -> None:
        """Entry: the peer's abort of a room this side has not reported, as the room's "failed" event."""
        status = msg.get("status")
        if msg.get("by_client") is True:  # not a failure: this side's answer is an abort too, without error
            self._event(room, "failed", "Aborted by the client (on the peer server).", {"by_client": True})
        elif isinstance(status, int) and 400 <= status < 600:  # the peer refused it: same status here
            self._event(room, "failed", f"the peer server refused the request: {msg.get('detail', '')}",
                        {"status": status})
        else:
            self._event(room, "failed", f"the peer server gave up on the request: {msg.get('detail', '')}")

    def _conclude(self, room: int, phase: str, msg: dict[str, Any]) -> None:
        """Entry: a rank of this server finished its part of the room (`phase` "sent" or "arrived"); the room
        succeeds once every rank did, fails as soon as one failed."""
        poll = self._polls.setdefault((room, phase), RoomPoll(len(self.config.world)))
        ok = bool(msg.get("ok"))
        state = poll.report(int(msg["rank"]), KVPoll.Success if ok else KVPoll.Failed, msg.get("detail") or "")
        if state is KVPoll.Failed:  # other ranks' writes may still run (decode: into the room's slots)
            self._fail_room(room, poll.detail or "the KV transfer failed", writes_may_run=True)
        elif state is KVPoll.Success:
            self._event(room, phase)

    def _forget(self, room: int) -> None:
        for phase in ("dst", "sent", "arrived"):
            self._polls.pop((room, phase), None)
        self._deadlines.cancel(room)
        self._peer_entry.pop(room, None)
        self._reported.discard(room)
