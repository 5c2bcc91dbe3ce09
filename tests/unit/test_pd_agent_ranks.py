"""The PD control protocol between a multi-rank prefill server and a decode server, at the agents' level: real
`PrefillAgent`s and a `DecodeAgent` (ZMQ control, sender threads) for the two stages of a PP=2 prefill server
and one decode rank, a real bootstrap server, and tests/pd_harness.py's `MemmoveEngine` per rank (one of them can hold a
write back). No scheduler: the test makes the calls each rank's scheduler makes.

What is checked: when a room is given up on, the prefill side's notice (which lets the decode side free the
room's KV slots) leaves only once no rank of the prefill server writes into those slots any more — not
when the entry rank's own writes are over while another rank's write is still running."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import pytest
import torch
import zmq

import tokenloom.disaggregation.decode_agent as decode_agent_module
from tests.pd_harness import MemmoveEngine
from tokenloom.cache.kv_memory import KVMemory
from tokenloom.disaggregation.agent_config import SENDER_THREADS, AgentConfig
from tokenloom.disaggregation.aux_buffer import AuxBuffer
from tokenloom.disaggregation.bootstrap_server import BootstrapServer, register_rank
from tokenloom.disaggregation.decode_agent import DecodeAgent
from tokenloom.disaggregation.pairing import topology_ranks
from tokenloom.disaggregation.prefill_agent import PrefillAgent
from tokenloom.ipc import IpcAddresses, Receiver
from tokenloom.protocol import Bootstrap, TransferEvent

LAYERS, TOKENS, SLOTS = 2, 64, list(range(8))


def memory(start_layer: int, end_layer: int) -> KVMemory:
    return KVMemory.build(tokens=TOKENS, request_slots=4, context_len=64, page_size=1, num_kv_heads=1, head_dim=1,
                          dtype=torch.float32, device=torch.device("cpu"), start_layer=start_layer,
                          end_layer=end_layer, disable_radix_cache=True)


class Ranks:
    """A PP=2 prefill server (ranks 0 and 1, one layer each; `prefill_pp=1`: one rank) and a one-rank decode
    server; `prefill_config` / `decode_config`: each side's `AgentConfig` clocks."""

    def __init__(self, prefill_pp: int = 2, prefill_config: dict[str, Any] | None = None,
                 decode_config: dict[str, Any] | None = None) -> None:
        self.ctx = zmq.Context()
        self.bootstrap = BootstrapServer("127.0.0.1", 0, expected_ranks=prefill_pp)
        self.bootstrap.start()
        self.configs = {"prefill": prefill_config or {}, "decode": decode_config or {}}
        prefill_world, decode_world = topology_ranks(LAYERS, 1, 1, prefill_pp), topology_ranks(LAYERS, 1, 1, 1)
        self.events: dict[str, Receiver] = {}
        self.queued: dict[str, list[TransferEvent]] = {}  # received, not yet taken by `next_event`
        self.engines: list[MemmoveEngine] = []
        self.memories: list[KVMemory] = []
        self.prefill: list[PrefillAgent] = []
        for rank in prefill_world:
            self.prefill.append(self._agent("prefill", rank, prefill_world, entry=rank.rank == 0))
        for agent in self.prefill:
            agent.set_world_control([a.control_address for a in self.prefill])
            register_rank("127.0.0.1", self.bootstrap.port, agent.registration(1, prefill_pp))
        self.decode = self._agent("decode", decode_world[0], decode_world, entry=True)
        self.decode.set_world_control([self.decode.control_address])

    def _agent(self, role: str, rank: Any, world: list, entry: bool) -> Any:
        address = IpcAddresses.fresh().scheduler if entry else None
        if entry:
            self.events[role] = Receiver(self.ctx, address)
        config = AgentConfig(role=role, me=rank, world=world, host="127.0.0.1", page_size=1, kv_dtype="float32",
                             events_address=address, **self.configs[role])
        mem = memory(rank.start_layer, rank.end_layer)
        engine = MemmoveEngine()
        self.engines.append(engine)
        self.memories.append(mem)
        aux = AuxBuffer(4 if role == "decode" else SENDER_THREADS)
        return (PrefillAgent if role == "prefill" else DecodeAgent)(config, engine, mem.kv_pool.layout(0), aux)

    def next_event(self, role: str, timeout_s: float) -> TransferEvent | None:
        queued = self.queued.setdefault(role, [])
        deadline = time.monotonic() + timeout_s
        while not queued and time.monotonic() < deadline:
            queued += self.events[role].recv_all(50)
        return queued.pop(0) if queued else None

    def close(self) -> None:
        for agent in [*self.prefill, self.decode]:
            agent.close()
        self.bootstrap.stop()
        self.ctx.destroy(linger=0)


@pytest.fixture
def ranks():
    r = Ranks()
    yield r
    r.close()


@pytest.fixture
def make_ranks():
    made: list[Ranks] = []

    def make(**kw: Any) -> Ranks:
        made.append(Ranks(**kw))
        return made[-1]

    yield make
    for r in made:
        r.close()


def start_transfer(ranks: Ranks, room: int, slots: list[int] = SLOTS) -> None:
    """What the two schedulers do up to the prefill side's first KV chunk: the decode entry bootstraps and
    sends its destination (the room's KV at `slots` of the decode pool); the prefill entry reports the room
    ready."""
    ranks.decode.track_decode(room, Bootstrap("127.0.0.1", ranks.bootstrap.port, room))
    event = ranks.next_event("decode", 10)
    assert event is not None and event.kind == "bootstrapped", event
    ranks.decode.send_metadata(room, event.data, slots, aux_index=0)
    event = ranks.next_event("prefill", 10)
    assert event is not None and event.kind == "ready", event


def test_an_abort_is_told_to_the_decode_side_only_once_every_prefill_rank_stopped_writing(ranks):
    room = 12345
    start_transfer(ranks, room)
    held = ranks.engines[1]  # prefill rank 1 (stage 1): its write of the room hangs until the gate opens
    held.hold_when = lambda runs: True
    for agent in ranks.prefill:
        agent.send_chunk(room, 0, SLOTS, is_last=True, aux=None)
    deadline = time.monotonic() + 5
    while ranks.engines[0].writes == 0 and time.monotonic() < deadline:  # rank 0's write is over
        time.sleep(0.01)
    assert ranks.engines[0].writes == 1 and held.writes == 0
    # rank 1's write is running (held at the gate), not still queued: a queued chunk would be dropped by the abort
    # and nothing would be left to wait for (a loaded machine starts rank 1's write late)
    assert held.holding.wait(5), "rank 1 never started its write"
    for agent in ranks.prefill:  # the client aborts: every rank's scheduler gives the room up
        agent.abort(room, "Aborted by the client.", by_client=True)
    ranks.prefill[0].wait_chunks(room, timeout_s=5)  # the entry's own writes are over
    assert ranks.next_event("decode", 1.0) is None, "the decode side was told while rank 1 still wrote its slots"
    held.gate.set()
    # rank 1's write, already running, completes (its "done" may make the room "arrived" first); then the abort
    # reaches the decode side: as the room's failure, or as the client's abort of a room that arrived
    events = []
    while not events or events[-1].kind == "arrived":
        event = ranks.next_event("decode", 5)
        assert event is not None, events
        events.append(event)
    assert [e.kind for e in events] in (["failed"], ["arrived", "client_abort"]), events
    assert events[0].kind != "failed" or events[0].data == {"by_client": True}, events
    assert held.writes == 1


def test_a_completed_transfer_then_a_let_go_is_not_held_back(ranks):
    # every rank said "sent" (its last write is over): the prefill side's let-go goes out at once
    room = 777
    start_transfer(ranks, room)
    for agent in ranks.prefill:
        agent.send_chunk(room, 0, SLOTS, is_last=True, aux=None)
    event = ranks.next_event("prefill", 5)
    assert event is not None and event.kind == "sent", event
    event = ranks.next_event("decode", 5)  # the decode rank saw every writer's "done"
    assert event is not None and event.kind == "arrived", event
    started = time.monotonic()
    ranks.prefill[0].finished_failed(room, "the decode side aborted the request")
    event = ranks.next_event("decode", 5)
    assert event is not None and event.kind == "let_go", event
    assert time.monotonic() - started < 2


def events_of(ranks: Ranks, role: str, room: int, timeout_s: float) -> list[TransferEvent]:
    """The events of `room` that reach `role`'s entry within `timeout_s` (other rooms' are dropped)."""
    found, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        event = ranks.next_event(role, 0.05)
        if event is not None and event.room == room:
            found.append(event)
    return found


def test_a_rank_whose_queued_chunk_was_dropped_does_not_let_the_decode_side_free_slots_another_rank_writes(ranks):
    # Rooms a and b share a sender thread on each rank (room % 4). Rank 1 is busy writing a (held), so b's
    # chunk waits behind it; rank 0 is writing b (held). The client aborts b: rank 1's queued chunk of b is
    # dropped and it says "sent" (failed) at once; the decode side must not hear of b while rank 0 still
    # writes b's slots (it used to: the entry failed the room on that "sent" and told the peer at once).
    a, b = 100, 104
    start_transfer(ranks, a)
    start_transfer(ranks, b, [s + 8 for s in SLOTS])
    entry_engine, other_engine = ranks.engines[0], ranks.engines[1]
    entry_engine.hold_when = lambda runs: entry_engine.writes >= 1  # its first write (a) passes, b's is held
    other_engine.hold_when = lambda runs: other_engine.writes == 0  # a's write is held, b waits behind it
    for room in (a, b):
        for agent in ranks.prefill:
            agent.send_chunk(room, 0, SLOTS, is_last=True, aux=None)
    # rank 0 holds b's write (its first, a's, is over); rank 1 holds a's, b's chunk queued behind it
    assert entry_engine.holding.wait(5) and other_engine.holding.wait(5), "a held write never started"
    assert entry_engine.writes == 1 and other_engine.writes == 0
    for agent in ranks.prefill:
        agent.abort(b, "Aborted by the client.", by_client=True)
    time.sleep(0.2)  # each rank's control thread has dropped b's chunks not started yet
    other_engine.gate.set()  # rank 1 writes a, then drops b's chunk and reports it
    got = events_of(ranks, "decode", b, 1.5)
    assert got == [], f"the decode side heard of b while rank 0 still wrote its slots: {got}"
    entry_engine.gate.set()
    got = events_of(ranks, "decode", b, 3)
    assert [e.kind for e in got] == ["failed"] and got[0].data == {"by_client": True}, got


def test_a_rank_whose_write_failed_does_not_let_the_decode_side_free_slots_another_rank_writes(ranks):
    # The entry's own write of the room fails (its peer looks gone) while rank 1 still writes. Both servers fail
    # the room at once (the decode rank saw the failed writer's "done"), but the decode side must keep the
    # room's slots (told so by the event) until it is let go, and that only once rank 1's write is over.
    room = 4321
    start_transfer(ranks, room)
    entry_engine, other_engine = ranks.engines[0], ranks.engines[1]
    entry_engine.fail_next = 1
    other_engine.hold_when = lambda runs: True
    for agent in ranks.prefill:
        agent.send_chunk(room, 0, SLOTS, is_last=True, aux=None)
    event = ranks.next_event("prefill", 5)
    assert event is not None and event.kind == "failed", event
    # rank 1's write is running (held at the gate), not still queued: a queued chunk would be dropped below and
    # nothing would be left to wait for (a loaded machine starts rank 1's write late)
    assert other_engine.holding.wait(5), "rank 1 never started its write"
    for agent in ranks.prefill:  # what every prefill rank's scheduler does with the "failed" event
        agent.drop_writes(room)
        agent.finished_failed(room, event.detail)
    got = events_of(ranks, "decode", room, 1.5)
    assert [(e.kind, e.data) for e in got] == [("failed", {"writes_may_run": True})], got
    ranks.decode.bound_drain(room)  # what the decode scheduler does with it: the slots wait for a let-go
    ranks.decode.finished_failed(room, got[0].detail)
    assert events_of(ranks, "decode", room, 1.0) == [], "the decode side was let go while rank 1 still wrote"
    other_engine.gate.set()
    got = events_of(ranks, "decode", room, 3)
    assert "let_go" in [e.kind for e in got], got
    assert other_engine.writes == 1
    for agent in [*ranks.prefill, ranks.decode]:  # every scheduler is done with the room
        agent.forget(room)
    deadline = time.monotonic() + 5
    while any(a.room_records() for a in [*ranks.prefill, ranks.decode]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [a.room_records() for a in [*ranks.prefill, ranks.decode]] == [{}, {}, {}]


def test_a_failed_room_left_draining_is_let_go_at_the_bound(ranks):
    # a decode room failed while writes may run, and no let-go ever comes (the prefill side lost the room)
    ranks.decode.config.transfer_timeout_s = -4.5  # the bound (transfer timeout + 5 s) is half a second away
    ranks.decode.bound_drain(99)
    got = events_of(ranks, "decode", 99, 2)
    assert [e.kind for e in got] == ["let_go"], got
    assert ranks.decode.room_records() == {}


def test_a_decode_failure_crossed_by_a_prefill_client_abort_is_let_go_without_waiting_for_the_bound(make_ranks):
    # The decode side fails a room while writes may run (its waiting timeout) and keeps its slots; the prefill
    # side's client abort crosses it, so the prefill entry ignores the decode side's abort (the room ended there
    # already) and its own notice, sent once its writes are over, is a client's abort: that notice must let the
    # decode side's drain go (it used to wait for the bound: the transfer timeout + 5 s)
    ranks = make_ranks(decode_config={"waiting_timeout_s": 1.5})
    room = 2468
    start_transfer(ranks, room)
    held, writing = ranks.engines[1], threading.Event()  # prefill rank 1's write hangs until the gate opens

    def hold(runs: list[tuple[int, int, int]]) -> bool:
        writing.set()
        return True
    held.hold_when = hold
    for agent in ranks.prefill:
        agent.send_chunk(room, 0, SLOTS, is_last=True, aux=None)
    assert writing.wait(5)
    for agent in ranks.prefill:  # the client aborts on the prefill server while rank 1 writes
        agent.abort(room, "Aborted by the client.", by_client=True)
    got = events_of(ranks, "decode", room, 3)
    assert [(e.kind, e.data) for e in got] == [("failed", {"writes_may_run": True})], got
    ranks.decode.bound_drain(room)  # what the decode scheduler does with it
    ranks.decode.finished_failed(room, got[0].detail)
    held.gate.set()  # rank 1's write is over: the prefill entry's held notice goes out
    got = events_of(ranks, "decode", room, 3)
    assert "let_go" in [e.kind for e in got], got


def test_a_single_rank_prefill_room_failed_by_its_clock_writes_no_chunk_queued_later(make_ranks):
    # A one-rank prefill server's entry fails a room (waiting timeout): its notice to the decode side leaves at
    # once (no other rank writes), so a chunk its scheduler queues before handling the failure must not be written
    # into slots the decode side is freeing
    ranks = make_ranks(prefill_pp=1, prefill_config={"waiting_timeout_s": 0.5})
    room = 1357
    start_transfer(ranks, room)
    event = ranks.next_event("prefill", 5)
    assert event is not None and event.kind == "failed" and "timed out" in event.detail, event
    ranks.prefill[0].send_chunk(room, 0, SLOTS, is_last=True, aux=None)  # its scheduler has not seen the failure
    ranks.prefill[0].wait_chunks(room, timeout_s=5)
    assert ranks.engines[0].writes == 0, "a chunk of a failed room was written"


def test_a_lost_prefill_servers_rooms_fail_while_writes_may_run_and_drain_until_its_ranks_are_gone(make_ranks,
                                                                                                  monkeypatch):
    # A prefill server that stops answering its heartbeats may be frozen mid-write and resume: its rooms keep
    # their decode slots (drain), bounded; once every rank of it is gone (its control socket refuses
    # connections), nothing of it can write any more and the drain ends
    ranks = make_ranks(decode_config={"heartbeat_interval_s": 0.2, "heartbeat_max_failure": 1})
    room = 9753
    start_transfer(ranks, room)
    monkeypatch.setattr(decode_agent_module, "check_health", lambda host, port, timeout_s=3.0: False)
    got = events_of(ranks, "decode", room, 3)
    assert [(e.kind, e.data) for e in got] == [("failed", {"writes_may_run": True})], got
    assert "stopped responding" in got[0].detail
    ranks.decode.bound_drain(room)  # the decode scheduler keeps the room's slots
    ranks.decode.finished_failed(room, got[0].detail)
    assert events_of(ranks, "decode", room, 1.0) == [], "let go while the (frozen) prefill ranks still exist"
    for agent in ranks.prefill:  # the prefill server's processes exit
        agent.close()
    ranks.prefill = []
    got = events_of(ranks, "decode", room, 3)
    assert [e.kind for e in got] == ["let_go"], got
    ranks.decode.forget(room)
    deadline = time.monotonic() + 5
    while ranks.decode.room_records() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ranks.decode.room_records() == {}


def test_a_bootstrap_answer_for_a_room_already_forgotten_reports_nothing(make_ranks):
    # The decode scheduler aborted (and forgot) a room in pre-allocation while the prefill server's bootstrap
    # was still being looked up; the look-up's late failure must not report the room failed a second time
    ranks = make_ranks(decode_config={"bootstrap_timeout_s": 1.0})
    silent = socket.socket()  # accepts connections (its backlog) and never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    try:
        room = 8642
        ranks.decode.track_decode(room, Bootstrap("127.0.0.1", silent.getsockname()[1], room))
        ranks.decode.abort(room, "Aborted by the client.", by_client=True)
        ranks.decode.forget(room)
        assert events_of(ranks, "decode", room, 2.5) == []  # the look-up gave up after about 1 s
        assert ranks.decode.room_records() == {}
    finally:
        silent.close()
