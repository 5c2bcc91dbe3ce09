"""The PD control protocol between a multi-rank prefill server and a decode server, at the agents' level: real
`PrefillAgent`s and a `DecodeAgent` (ZMQ control, sender threads) for the two stages of a PP=2 prefill server
and one decode rank, a real bootstrap server, and tests/pd_harness.py's `MemmoveEngine` per rank (one of them can hold a
write back). No scheduler: the test makes the calls each rank's scheduler makes.

What is checked: when a room is given up on, the prefill side's notice (which lets the decode side free the
room's KV slots) leaves only once no rank of the prefill server writes into those slots any more — not
when the entry rank's own writes are over while another rank's write is still running."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import zmq

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
    """A PP=2 prefill server (ranks 0 and 1, one layer each) and a one-rank decode server."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.bootstrap = BootstrapServer("127.0.0.1", 0, expected_ranks=2)
        self.bootstrap.start()
        prefill_world, decode_world = topology_ranks(LAYERS, 1, 1, 2), topology_ranks(LAYERS, 1, 1, 1)
        self.events: dict[str, Receiver] = {}
        self.queued: dict[str, list[TransferEvent]] = {}  # received, not yet taken by `next_event`
        self.engines: list[MemmoveEngine] = []
        self.memories: list[KVMemory] = []
        self.prefill: list[PrefillAgent] = []
        for rank in prefill_world:
            self.prefill.append(self._agent("prefill", rank, prefill_world, entry=rank.rank == 0))
        for agent in self.prefill:
            agent.set_world_control([a.control_address for a in self.prefill])
            register_rank("127.0.0.1", self.bootstrap.port, agent.registration(1, 2))
        self.decode = self._agent("decode", decode_world[0], decode_world, entry=True)
        self.decode.set_world_control([self.decode.control_address])

    def _agent(self, role: str, rank: Any, world: list, entry: bool) -> Any:
        address = IpcAddresses.fresh().scheduler if entry else None
        if entry:
            self.events[role] = Receiver(self.ctx, address)
        config = AgentConfig(role=role, me=rank, world=world, host="127.0.0.1", page_size=1, kv_dtype="float32",
                             events_address=address)
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
    deadline = time.monotonic() + 5
    while entry_engine.writes == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # rank 0 now holds b's write; rank 1 holds a's, b's chunk queued behind it
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
