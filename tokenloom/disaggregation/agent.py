"""`TransferAgent`: one per scheduler rank of a prefill or decode server; moves this rank's KV and talks to the
peer server's ranks, so the scheduler never blocks on the network.

What it owns: the transfer engine (transfer/) with this rank's KV pool and metadata buffer registered, a
ZMQ PULL control socket on `tcp://host:port` (JSON messages only: nothing a peer sends is unpickled), PUSH
sockets to peers, a control thread (every message and every room's bookkeeping), and on the prefill side a `KVSender`
(kv_sender.py: the threads that perform the KV writes, each room's in order on one of them).

Protocol (room = the router's bootstrap room):
- decode rank d, once the scheduler pre-allocated the room: "dst" (its engine, KV layout, slots, metadata
  slot address, status address, the decode world's layout) → every prefill rank that writes part of d's KV
  (pairing.writers_for), the aux writer and the prefill entry;
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
server the way requests do, so all ranks act on them at the same iteration (no collective needed).

Clocks are read only here, by the entry: bootstrap timeout (prefill: no "dst" in time), waiting timeout
(decode: no "arrived" in time), heartbeats (decode: the prefill's bootstrap /health), each ending as a
"failed" event. Environment: TOKENLOOM_DISAGGREGATION_{BOOTSTRAP_TIMEOUT, WAITING_TIMEOUT, HEARTBEAT_INTERVAL,
HEARTBEAT_MAX_FAILURE, TRANSFER_TIMEOUT, TEST_FAILURE_PROB} (SGLang's SGLANG_DISAGGREGATION_* names and
DISAGGREGATION_TEST_FAILURE_PROB are read too).
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import zmq

from tokenloom.cache.kv_layout import KVLayout
from tokenloom.disaggregation.agent_config import AgentConfig
from tokenloom.disaggregation.aux_buffer import AuxBuffer
from tokenloom.disaggregation.bootstrap_server import check_health
from tokenloom.disaggregation.kv_poll import KVPoll, RoomPoll
from tokenloom.disaggregation.kv_sender import KVSender
from tokenloom.disaggregation.pairing import RankKV, aux_writer, senders_for
from tokenloom.disaggregation.prefill_directory import PREFILL_INFO_FRESH_S, PrefillDirectory
from tokenloom.disaggregation.transfer.base import TransferEngine
from tokenloom.protocol import Bootstrap, TransferEvent

logger = logging.getLogger(__name__)


ENDED_ROOMS_KEPT = 4096  # prefill: rooms given up on, remembered after forget (a late destination gets an abort)


class TransferAgent:
    def __init__(self, config: AgentConfig, engine: TransferEngine, layout: KVLayout, aux: AuxBuffer) -> None:
        self.config = config
        self.engine = engine
        self.layout = layout
        self.aux = aux
        engine.register(layout.base_addr, layout.nbytes)
        engine.register(aux.base_addr, aux.nbytes)
        self._ctx = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        port = self._pull.bind_to_random_port(f"tcp://{config.host}")
        self.control_address = f"tcp://{config.host}:{port}"
        self._world_control: list[str] = [self.control_address]  # every rank's, by rank (set_world_control)
        self._push: dict[str, zmq.Socket] = {}
        self._push_lock = threading.Lock()
        self._calls: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._stopped = threading.Event()
        self._fetches = ThreadPoolExecutor(max_workers=4, thread_name_prefix="tokenloom-pd-fetch")
        self._prefill_servers = PrefillDirectory(config.page_size, config.kv_dtype, engine.backend, config.world,
                                                 layout, config.bootstrap_timeout_s)  # decode side
        self._events = None
        if config.is_entry:
            self._events = self._ctx.socket(zmq.PUSH)
            self._events.connect(config.events_address)
        # --- room state, control thread only (the sender keeps its own, under its lock) ---
        self._deadlines: dict[int, tuple[float, str]] = {}  # entry: room -> (deadline, what it waits for)
        # rooms this side gave up on (reason, by the client): a destination arriving later (the decode half of a
        # request aborted here before its decode server had even seen it) is answered with an abort, else the
        # decode server would wait for KV that never comes
        self._ended: OrderedDict[int, tuple[str, bool, int | None]] = OrderedDict()
        self._reported: set[int] = set()  # entry: rooms whose final event went out
        # entry: room -> the room's KVPoll on each rank that reports to it (prefill: the decode ranks' "dst", then
        # this server's ranks' "sent"; decode: this server's ranks' "arrived"); the room moves on when all agree
        self._polls: dict[tuple[int, str], RoomPoll] = {}
        self._expected: dict[int, set[int]] = {}  # decode: room -> prefill ranks that must say "done"
        self._done: dict[int, set[int]] = {}  # decode: room -> prefill ranks that said "done"
        self._peer_entry: dict[int, str] = {}  # room -> the peer server's entry control address
        self._room_prefill: dict[int, tuple[str, int]] = {}  # decode entry: room -> its prefill's bootstrap
        self._heartbeat: dict[tuple[str, int], tuple[float, int]] = {}  # bootstrap -> (next check, misses)
        self._drain_bounds: dict[int, float] = {}  # decode entry: failed room whose slots wait for a let-go -> bound
        # prefill entry: room -> (peer entry, messages, deadline) sent once every rank's writes of the room are
        # over, so the decode side frees the room's slots only when no write can land in them any more (or at the
        # deadline: a write is bounded by the transfer timeout); held apart from the room's other state, which
        # the scheduler may forget first (a client abort racing the peer's)
        self._after_writes: dict[int, tuple[str, list[dict[str, Any]], float]] = {}
        # prefill entry: room -> the other ranks that said their writes of it are over ("over"; kept after
        # forget, as `_ended`: a rank's "over" may come first, and a second notice of the room needs it again)
        self._writes_over: OrderedDict[int, set[int]] = OrderedDict()
        # prefill, not the entry: rooms given up on whose "over" goes to the entry once this rank's writes are
        self._report_over: set[int] = set()
        self._sender = KVSender(config, engine, layout, aux, self._send, lambda: self._world_control[0]) \
            if config.role == "prefill" else None
        self._control = threading.Thread(target=self._control_loop, name="tokenloom-pd-control", daemon=True)
        self._control.start()

    # --- what the bootstrap server publishes about this (prefill) rank -----------------------------------
    def registration(self, tp_size: int, pp_size: int) -> dict[str, Any]:
        me = self.config.me
        return {"role": "Prefill", "rank": me.rank, "attn_tp_size": tp_size, "attn_tp_rank": me.tp_rank,
                "attn_dp_size": 1, "attn_dp_rank": 0, "pp_size": pp_size, "pp_rank": me.pp_rank,
                "rank_ip": self.config.host, "rank_port": int(self.control_address.rsplit(":", 1)[1]),
                "page_size": self.config.page_size, "kv_cache_dtype": self.config.kv_dtype,
                "control": self.control_address, "engine": self.engine.descriptor(),
                "transfer_backend": self.engine.backend, "rank_kv": me.to_json(), "layout": self.layout.to_json()}

    # --- scheduler-thread API (never blocks on the network) ------------------------------------------------
    def track_prefill(self, room: int) -> None:
        """Prefill: the room waits in the bootstrap queue; the entry fails it if no destination comes in time."""
        self._calls.put(lambda: self._watch(room, self.config.bootstrap_timeout_s, "the decode server's "
                                            "destination (bootstrap timeout)"))

    def send_chunk(self, room: int, start: int, slots: list[int], is_last: bool, aux: bytes | None) -> None:
        """Prefill: write tokens [start, start + len(slots)) of the room (slots of this rank's pool) to the
        decode ranks; `aux`: the metadata slot's bytes (aux writer, last chunk)."""
        assert self._sender is not None
        self._sender.queue_chunk(room, start, slots, is_last, aux)

    def wait_chunks(self, room: int, timeout_s: float | None = None) -> None:
        """Prefill: return once every queued chunk of the room was written (or dropped): its source slots may
        then be re-pointed or freed."""
        assert self._sender is not None
        self._sender.wait_room(room, timeout_s or self.config.transfer_timeout_s + 5)

    def track_decode(self, room: int, bootstrap: Bootstrap) -> None:
        """Decode: the room waits for pre-allocation; the entry looks the prefill server up and reports
        "bootstrapped" (or "failed": unreachable, incompatible)."""
        self._calls.put(lambda: self._bootstrap_decode(room, bootstrap))

    def send_metadata(self, room: int, prefill_info: dict[str, Any], slots: list[int], aux_index: int) -> None:
        """Decode: the room's KV was pre-allocated at `slots` (this rank's pool) and its metadata slot at
        `aux_index`; tell the prefill ranks (`prefill_info`: the "bootstrapped" event's layout) where to write."""
        self._calls.put(lambda: self._send_dst(room, prefill_info, slots, aux_index))

    def abort(self, room: int, reason: str, by_client: bool = False) -> None:
        """Either side: the scheduler gave up on the room (client abort, failure): drop its remaining work and
        tell the peer server's entry (`by_client`: the client asked, so the peer ends its half as an abort, not
        as an error)."""
        self._calls.put(lambda: self._abort(room, reason, by_client))

    def bound_drain(self, room: int) -> None:
        """Decode: the scheduler keeps a failed room's slots until the prefill side lets go; if it never does,
        a "let_go" comes at the bound (the transfer timeout + 5 s: no write runs longer)."""
        if self.config.is_entry:  # the entry's clock; every rank ends the drain on the same let-go event
            self._calls.put(lambda: self._drain_bounds.__setitem__(room, time.monotonic()
                                                                   + self.config.transfer_timeout_s + 5))

    def refuse(self, room: int, bootstrap: Bootstrap, reason: str, status: int) -> None:
        """Either side: a request of the room was refused at the door (a full queue, a bad request): its peer
        half is told to end too, instead of waiting for this side until a timeout (a decode entry reaches the
        prefill entry through the request's bootstrap address; a prefill server answers the decode's
        destination with an abort when it comes)."""
        self._calls.put(lambda: self._refuse(room, bootstrap, reason, status))

    def _refuse(self, room: int, bootstrap: Bootstrap, reason: str, status: int) -> None:
        self._remember_ended(room, reason, False, status)
        if self.config.role == "decode" and self.config.is_entry:
            self._room_prefill.setdefault(room, (bootstrap.host, bootstrap.port))
            self._notify_peer(room, reason, status=status)
            self._room_prefill.pop(room, None)

    def forget(self, room: int) -> None:
        """The scheduler is done with the room (its final event was handled): drop its bookkeeping."""
        self._calls.put(lambda: self._forget(room))

    def room_records(self) -> dict[str, int]:
        """The per-room records this rank's agent holds for rooms in progress, by table, the empty ones left out
        (any thread; a snapshot): empty once every room ended and the scheduler forgot it. Not counted: the
        bounded memories of rooms given up on (`_ended`, `_writes_over`), kept on purpose for late messages."""
        tables = {"deadlines": self._deadlines, "reported": self._reported, "polls": self._polls,
                  "expected": self._expected, "done": self._done, "peer_entry": self._peer_entry,
                  "room_prefill": self._room_prefill, "after_writes": self._after_writes,
                  "report_over": self._report_over, "drain_bounds": self._drain_bounds}
        held = {name: len(table) for name, table in tables.items()}
        if self._sender is not None:
            held.update(self._sender.room_records())
        return {name: n for name, n in held.items() if n}

    def close(self) -> None:
        self._stopped.set()
        if self._sender is not None:
            self._sender.close()
        self._control.join(timeout=2)
        self._fetches.shutdown(wait=False, cancel_futures=True)
        self.engine.close()
        self._ctx.destroy(linger=0)

    # --- control thread ------------------------------------------------------------------------------------
    def _control_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        while not self._stopped.is_set():
            try:
                if poller.poll(20):
                    while True:
                        try:
                            raw = self._pull.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._on_message(raw)
                while True:
                    try:
                        call = self._calls.get_nowait()
                    except queue.Empty:
                        break
                    call()
                if self.config.is_entry:
                    self._check_clocks()
                if self._after_writes or self._report_over:
                    self._flush_after_writes()
            except Exception:  # noqa: BLE001 - a bad message or peer must not stop the agent
                logger.exception("transfer agent control loop error")

    def _on_message(self, raw: bytes) -> None:
        try:
            msg = json.loads(raw)
            kind, room = msg["t"], int(msg["room"])
        except (ValueError, KeyError, TypeError):
            logger.warning("transfer agent: dropped a malformed control message (%d bytes)", len(raw))
            return
        handler = {"dst": self._on_dst, "sent": self._on_sent, "done": self._on_done, "arrived": self._on_arrived,
                   "abort": self._on_abort, "over": self._on_over}.get(kind)
        if handler is None:
            logger.warning("transfer agent: unknown control message %r", kind)
            return
        handler(room, msg)

    def _send(self, address: str, msg: dict[str, Any]) -> None:
        with self._push_lock:
            sock = self._push.get(address)
            if sock is None:
                sock = self._ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDHWM, 100000)
                sock.connect(address)
                self._push[address] = sock
            sock.send(json.dumps(msg).encode())

    def _event(self, room: int, kind: str, detail: str = "", data: Any = None) -> None:
        """Entry: push the room's event into this rank's scheduler inbox (once per final outcome)."""
        if kind in ("sent", "arrived", "failed"):
            if room in self._reported:
                return
            self._reported.add(room)
            self._deadlines.pop(room, None)
        assert self._events is not None
        self._events.send_pyobj(TransferEvent(room, kind, detail, data))

    def _watch(self, room: int, timeout_s: float, what: str) -> None:
        if self.config.is_entry and room not in self._reported:
            self._deadlines[room] = (time.monotonic() + timeout_s, what)

    def _check_clocks(self) -> None:
        now = time.monotonic()
        for room, (deadline, what) in list(self._deadlines.items()):
            if now >= deadline:
                self._fail_room(room, f"timed out waiting for {what}", writes_may_run=True)
        for room, due in list(self._drain_bounds.items()):
            if now >= due:  # no write of the room can still run: each is bounded by the transfer timeout
                del self._drain_bounds[room]
                assert self._events is not None
                self._events.send_pyobj(TransferEvent(room, "let_go"))
        for target, (due, misses) in list(self._heartbeat.items()):
            if now >= due:
                self._heartbeat[target] = (now + self.config.heartbeat_interval_s, misses)
                self._fetches.submit(self._probe, target)

    def _probe(self, target: tuple[str, int]) -> None:
        healthy = check_health(target[0], target[1], timeout_s=min(2.0, self.config.heartbeat_interval_s))
        self._calls.put(lambda: self._on_probe(target, healthy))

    def _on_probe(self, target: tuple[str, int], healthy: bool) -> None:
        if target not in self._heartbeat:
            return
        due, misses = self._heartbeat[target]
        misses = 0 if healthy else misses + 1
        self._heartbeat[target] = (due, misses)
        if misses >= self.config.heartbeat_max_failure:
            rooms = [r for r, t in self._room_prefill.items() if t == target and r not in self._reported]
            logger.warning("prefill server %s:%d missed %d heartbeats: failing %d rooms", *target, misses,
                           len(rooms))
            for room in rooms:
                self._fail_room(room, f"the prefill server at {target[0]}:{target[1]} stopped responding")
            del self._heartbeat[target]
            self._prefill_servers.forget(target)

    def _remember_ended(self, room: int, reason: str, by_client: bool, status: int | None = None) -> None:
        if self.config.role == "prefill":
            self._ended[room] = (reason, by_client, status)
            while len(self._ended) > ENDED_ROOMS_KEPT:
                self._ended.popitem(last=False)

    def _fail_room(self, room: int, reason: str, writes_may_run: bool = False) -> None:
        """Entry: the room failed on this side; tell the peer entry (a prefill entry once no rank of this server
        writes the room any more: a rank's write may still run when another's failed or timed out) and the
        scheduler (`writes_may_run`: a prefill rank may still be writing the room's KV, as when a decode rank
        saw one writer fail or the transfer timed out; the decode scheduler then keeps the slots until let go)."""
        self._remember_ended(room, reason, False)
        target = self._room_prefill.get(room)
        if target is not None:  # its layout is looked up again next time (the prefill server may have restarted)
            self._prefill_servers.forget(target)
        self._notify_peer(room, reason, after_writes=True)
        self._event(room, "failed", reason, {"writes_may_run": True} if writes_may_run else None)

    def _notify_peer(self, room: int, reason: str, by_client: bool = False, status: int | None = None,
                     after_writes: bool = False, let_go: bool = False) -> None:
        """Entry: tell the peer server's entry that this side gave up on (or is done failing) the room. A decode
        entry that has not sent the room's destination yet finds the prefill entry from its bootstrap.
        `after_writes` (prefill): only once every rank's writes of the room are over (`_flush_after_writes`).
        `let_go`: not news of a failure (the peer knows, it told this side or was told) but that this side is
        done with the room: the peer frees what it kept for it, and counts nothing."""
        if after_writes and self.config.role == "prefill" and not self.config.is_entry:
            self._report_over.add(room)
        if not self.config.is_entry:
            return
        msg = {"t": "abort", "room": room, "detail": reason, "by_client": by_client, "status": status,
               "let_go": let_go}
        peer = self._peer_entry.get(room)
        if peer is not None and after_writes and self.config.role == "prefill":
            held = self._after_writes.get(room)
            deadline = time.monotonic() + self.config.transfer_timeout_s
            self._after_writes[room] = (peer, [*held[1], msg], held[2]) if held else (peer, [msg], deadline)
            return
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

        self._fetches.submit(resolve)

    def _flush_after_writes(self) -> None:
        """Control thread (prefill): a rank other than the entry tells the entry of the rooms whose writes (its
        own) are over; the entry sends the notices it held of rooms whose writes are over on every rank."""
        assert self._sender is not None  # only prefill ranks hold anything back
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
        if self.config.role != "prefill" or not self.config.is_entry or len(self.config.world) == 1:
            return
        self._writes_over.setdefault(room, set()).add(int(msg["rank"]))
        while len(self._writes_over) > ENDED_ROOMS_KEPT:
            self._writes_over.popitem(last=False)

    def drop_writes(self, room: int) -> None:
        """Prefill, any thread: the room failed; its chunks not written yet are dropped, so that `wait_chunks`
        returns once a write already running is over."""
        if self._sender is not None:
            self._sender.drop(room)

    def finished_failed(self, room: int, reason: str) -> None:
        """The scheduler let go of a failed or aborted room (no transfer reads or writes its KV any more):
        the peer entry may free its side of it once no rank of this server writes it any more."""
        self._calls.put(lambda: self._notify_peer(room, reason, after_writes=True, let_go=True))

    def _abort(self, room: int, reason: str, by_client: bool = False) -> None:
        self._remember_ended(room, reason, by_client)
        if self._sender is not None:
            self._sender.drop(room)
        if room not in self._reported:
            self._notify_peer(room, reason, by_client, after_writes=True)
        self._deadlines.pop(room, None)
        if self.config.role == "decode":  # its slots stay reserved until the room's final event: bound the wait
            self._watch(room, self.config.transfer_timeout_s + 5, "the prefill server to let go of the aborted room")

    def _on_abort(self, room: int, msg: dict[str, Any]) -> None:
        if self.config.is_entry and msg.get("let_go") is True:
            if self.config.role == "decode":  # a room aborted here mid-transfer may free its slots now
                assert self._events is not None
                self._events.send_pyobj(TransferEvent(room, "let_go"))
            return
        if self.config.role == "prefill" and room in self._ended:
            return  # given up on here already (both sides aborted at once): the peer was or will be told
        if self.config.is_entry:
            status = msg.get("status")
            if self.config.role == "decode" and room in self._reported and msg.get("by_client") is not True:
                # this side failed the room first; the prefill side sends its abort once its writes are over
                assert self._events is not None
                self._events.send_pyobj(TransferEvent(room, "let_go"))
            if msg.get("by_client") is True and room in self._reported and self.config.role == "decode":
                # the KV arrived already (the request may be decoding): still the client's abort, not a final event
                assert self._events is not None
                self._events.send_pyobj(TransferEvent(room, "client_abort", "Aborted by the client (on the peer "
                                                      "server)."))
            elif msg.get("by_client") is True:  # not a failure: this side's answer is an abort too, without error
                self._event(room, "failed", "Aborted by the client (on the peer server).", {"by_client": True})
            elif isinstance(status, int) and 400 <= status < 600:  # the peer refused it: same status here
                self._event(room, "failed", f"the peer server refused the request: {msg.get('detail', '')}",
                            {"status": status})
            else:
                self._event(room, "failed", f"the peer server gave up on the request: {msg.get('detail', '')}")
            if self._sender is not None:  # a prefill entry's own sender drops the room's remaining chunks
                self._sender.drop(room)
            if self.config.role == "prefill":  # the decode side keeps the room's slots until it hears this
                self._notify_peer(room, "the prefill server let go of the aborted request", after_writes=True,
                                  let_go=True)

    def _forget(self, room: int) -> None:
        for phase in ("dst", "sent", "arrived"):
            self._polls.pop((room, phase), None)
        for table in (self._deadlines, self._expected, self._done, self._peer_entry,
                      self._room_prefill, self._drain_bounds):
            table.pop(room, None)
        self._reported.discard(room)
        if self._sender is not None:
            self._sender.forget(room)

    # --- prefill side ----------------------------------------------------------------------------------------
    def _on_dst(self, room: int, msg: dict[str, Any]) -> None:
        if self.config.role != "prefill":
            return
        if room in self._ended:
            reason, by_client, status = self._ended[room]
            if self.config.is_entry:
                self._send(msg["entry"], {"t": "abort", "room": room, "detail": reason, "by_client": by_client,
                                          "status": status})
            return
        decode_rank = int(msg["decode_rank"])
        assert self._sender is not None
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
                self._deadlines.pop(room, None)
                self._watch(room, self.config.waiting_timeout_s, "the KV transfer to finish")
                self._event(room, "ready")

    def _on_sent(self, room: int, msg: dict[str, Any]) -> None:
        if not self.config.is_entry or self.config.role != "prefill":
            return
        self._on_over(room, msg)  # a rank's "sent" follows its last write of the room
        if room in self._ended:  # given up here already: a rank's dropped last chunk is not news for the peer
            return  # (failing the room now would tell the decode side at once, while other ranks still write)
        self._conclude(room, "sent", msg)

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

    # --- decode side ------------------------------------------------------------------------------------------
    def _bootstrap_decode(self, room: int, bootstrap: Bootstrap) -> None:
        if not self.config.is_entry:
            return
        target = (bootstrap.host, bootstrap.port)
        self._room_prefill[room] = target
        self._heartbeat.setdefault(target, (time.monotonic() + self.config.heartbeat_interval_s, 0))
        self._watch(room, self.config.bootstrap_timeout_s, f"the prefill server's bootstrap at {target[0]}:"
                    f"{target[1]}")

        def fetch() -> None:
            info = None
            try:
                info = self._prefill_servers.layout(target, PREFILL_INFO_FRESH_S)
                problem = self._prefill_servers.incompatibility(info)
            except Exception as e:  # noqa: BLE001 - reported as the room's failure
                problem = f"cannot reach the prefill server's bootstrap at {target[0]}:{target[1]}: {e}"
            self._calls.put(lambda: self._on_bootstrapped(room, problem, info))

        self._fetches.submit(fetch)

    def _on_bootstrapped(self, room: int, problem: str | None, info: dict[str, Any] | None) -> None:
        if room in self._reported:
            return
        if problem is not None:
            self._fail_room(room, problem)
            return
        self._deadlines.pop(room, None)
        assert self._events is not None
        self._events.send_pyobj(TransferEvent(room, "bootstrapped", data=info))


    def _send_dst(self, room: int, info: dict[str, Any], slots: list[int], aux_index: int) -> None:
        ranks = info["ranks"]
        prefill_world = [RankKV.from_json(r["rank_kv"]) for r in ranks]
        control = {int(r["rank_kv"]["rank"]): r["control"] for r in ranks}
        me = self.config.me
        writer_of_aux = aux_writer(prefill_world).rank
        self._expected[room] = set(senders_for(me, prefill_world))
        self._done[room] = set()
        prefill_entry = control[min(control)]
        self._peer_entry[room] = prefill_entry
        msg = {"t": "dst", "room": room, "decode_rank": me.rank,
               "decode_ranks": [r.to_json() for r in self.config.world], "engine": self.engine.descriptor(),
               "layout": self.layout.to_json(), "slots": slots, "status": self.control_address,
               "entry": self._world_control[0]}
        for rank in sorted(control):  # every prefill rank, so each knows at once whether it writes anything
            self._send(control[rank], {**msg, "aux_addr": self.aux.slot_addr(aux_index) if rank == writer_of_aux
                                       else None})
        if self.config.is_entry:
            self._watch(room, self.config.waiting_timeout_s, "the KV transfer from the prefill server")
        self.engine.expect_incoming(True)

    def _on_done(self, room: int, msg: dict[str, Any]) -> None:
        if self.config.role != "decode" or room not in self._expected:
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
        if not self.config.is_entry or self.config.role != "decode":
            return
        self._conclude(room, "arrived", msg)

    # --- world addresses -----------------------------------------------------------------------------------------
    def set_world_control(self, addresses: list[str]) -> None:
        """The control address of every rank of this server, by rank (exchanged at start-up)."""
        self._world_control = list(addresses)
