"""`PPChannel` between real processes over gloo on loopback (`init_distributed`'s `world_cpu_group`).

Two worlds are spawned once each (module fixtures) and run every scenario in sequence; the tests then check
what each rank reported against references built independently of the channel (payloads regenerated from
their seed in the parent, ring contents from the stage/iteration formula):
- 2 ranks: mixed round trips (bit-exact, fresh buffers), tag parking out of order, one send in flight, send
  buffers kept alive, separate wire tags, payload and peer validation, a receive timeout;
- 3 ranks (a ring): send-first exchanges with multi-MB tensors, the alternating order under blocking sends,
  the blocking send-first ring deadlocking (so the ring tests can fail), and a stage that dies.
"""

from __future__ import annotations

import gc
import math
import os
import pickle
import queue
import socket
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tokenloom.distributed.groups import init_distributed
from tokenloom.distributed.pp_channel import PPChannel, PPChannelError, PPChannelTimeout, recv_first_for_stage

RING_ITERATIONS = 60
RING_INTS = 1 << 20  # 4 MiB of int32 per message, plus a 1 MiB bf16 tensor
IN_FLIGHT_DELAY_S = 0.8
RECV_TIMEOUT_S = 0.5
DEADLOCK_TIMEOUT_S = 1.5
JOIN_S = 90


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _payloads() -> list[tuple[str, dict]]:
    """Mixed payloads, regenerated identically from a seed wherever they are needed."""
    g = torch.Generator().manual_seed(1234)
    bf16 = torch.randn(7, 33, generator=g).to(torch.bfloat16)
    bf16[0, :4] = torch.tensor([math.nan, math.inf, -math.inf, -0.0])
    f32 = torch.randn(3, 5, 2, generator=g)
    f32[1, 1, 1] = math.nan
    return [
        ("proxy", {"hidden_states": bf16, "residual": f32, "positions": torch.arange(-5, 40, dtype=torch.int64)}),
        ("output", {"next_token_ids": torch.tensor([3, 1, 4, 1, 5], dtype=torch.int32), "logprobs": None,
                    "top": [[(1, -0.5), (2, -1.25)], []], "meta": {"rids": ["a", "é"], "n": (1, 2.5)}}),
        ("requests", {"reqs": [], "empty": torch.empty(0, 4096), "empty3": torch.empty(2, 0, 3, dtype=torch.int16),
                      "scalar": torch.tensor(2.75, dtype=torch.float64), "mask": torch.tensor([True, False]),
                      "bytes": bytes(range(256)), "u8": torch.randint(0, 256, (300,), generator=g,
                                                                           dtype=torch.uint8)}),
        ("proxy", {"transposed": torch.randn(6, 4, generator=g).t(), "big": torch.randn(1 << 20, generator=g),
                   "c": torch.randn(3, generator=g, dtype=torch.complex64)}),
        ("objects-only", {"x": None, 7: [1, [2, [3]]], ("t", 1): {"nested": {"deep": None}}}),
    ]


def _same(a, b) -> bool:
    """Bit-exact equality: tensors by dtype, shape and bytes (NaN == NaN), everything else by ==."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))
    if isinstance(a, dict) and isinstance(b, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _ring_message(stage: int, k: int) -> dict:
    ints = torch.arange(RING_INTS, dtype=torch.int32) * (k + 1) + stage
    hidden = torch.full((256, 2048), float(stage * 100 + k % 50), dtype=torch.bfloat16)
    return {"ints": ints, "hidden": hidden, "stage": stage, "k": k}


def _ring_ok(got: dict, stage: int, k: int) -> bool:
    want = _ring_message(stage, k)
    return got["stage"] == stage and got["k"] == k and torch.equal(got["ints"], want["ints"]) \
        and torch.equal(got["hidden"], want["hidden"])


# --- the 2-rank world ---------------------------------------------------------------------------------------

def _two_rank_scenarios(ctx, peer_done) -> dict:
    rank, peer = ctx.rank, 1 - ctx.rank
    group = ctx.world_cpu_group
    ch = PPChannel(group, peer, peer)
    out: dict = {}

    # mixed round trips: rank 0 sends, rank 1 echoes what it received; both report what they received
    if rank == 0:
        for tag, payload in _payloads():
            ch.isend(tag, payload)
            out.setdefault("echoed", []).append(ch.recv(tag))
    else:
        received = []
        for tag, _ in _payloads():
            got = ch.recv(tag)
            received.append(got)
            ch.isend(tag, got)
        out["received"] = received
        first, second = received[0], received[3]
        out["fresh"] = len({t.untyped_storage().data_ptr() for p in received for t in p.values()
                            if isinstance(t, torch.Tensor) and t.numel()}) == \
            sum(1 for p in received for t in p.values() if isinstance(t, torch.Tensor) and t.numel())
        positions = first["positions"]  # writable memory (no read-only wire buffer): a round trip in place
        out["writable"] = bool(torch.equal(positions.add_(1).sub_(1), torch.arange(-5, 40))) \
            and second["big"].is_contiguous()
    ch.wait_send()

    # tag parking: five messages in one order, asked for in another
    sequence = [("a", 1), ("b", 1), ("a", 2), ("c", 1), ("b", 2)]
    if rank == 0:
        for tag, n in sequence:
            ch.isend(tag, {"n": n, "t": torch.full((1000,), n, dtype=torch.int64)})
        ch.wait_send()
    else:
        order = []
        got = ch.recv("c")
        order.append(("c", got["n"], int(got["t"][0])))
        out["parked_after_c"] = {t: ch.parked(t) for t in "abc"}
        for tag in ("b", "a", "a", "b"):
            got = ch.recv(tag)
            order.append((tag, got["n"], int(got["t"][0])))
        out["parking_order"] = order
        out["parked_at_end"] = {t: ch.parked(t) for t in "abc"}

    # one send in flight: the second isend waits until the peer received the first
    dist.barrier(group=group)
    if rank == 0:
        big = {"x": torch.ones(2 << 20, dtype=torch.float32)}  # 8 MiB, contiguous: no copy in isend
        t0 = time.monotonic()
        h1 = ch.isend("first", big)
        t1 = time.monotonic()
        h2 = ch.isend("second", {"y": 1})
        t2 = time.monotonic()
        out["in_flight"] = {"first_isend_s": t1 - t0, "second_isend_s": t2 - t0, "first_done": h1.completed,
                            "second_done_before_wait": h2.completed}
        ch.wait_send()
        out["in_flight"]["second_done_after_wait"] = h2.completed
    else:
        time.sleep(IN_FLIGHT_DELAY_S)
        out["in_flight_recv"] = (float(ch.recv("first")["x"].sum()), ch.recv("second"))

    # the send buffers stay alive until sent: the sender drops its tensors (one a non-contiguous view, whose
    # contiguous copy exists only inside the channel) and churns the allocator before the receiver posts
    dist.barrier(group=group)
    if rank == 0:
        payload = {"x": torch.arange(1 << 18, dtype=torch.float32), "nc": torch.arange(4096.0).reshape(64, 64).t()}
        ch.isend("kept", payload)
        del payload
        gc.collect()
        junk = [torch.full((1 << 18,), -1.0) for _ in range(8)] + [torch.full((64, 64), -1.0) for _ in range(8)]
        del junk
        ch.wait_send()
    else:
        time.sleep(0.3)
        got = ch.recv("kept")
        out["kept"] = torch.equal(got["x"], torch.arange(1 << 18, dtype=torch.float32)) and \
            torch.equal(got["nc"], torch.arange(4096.0).reshape(64, 64).t())

    # two channels on separate wire tags are matched independently: sent B then A, received A then B
    other = PPChannel(group, peer, peer, wire_tag=7)
    if rank == 0:
        other.isend("on7", {"v": torch.tensor([7])})
        ch.isend("on0", {"v": torch.tensor([0])})
        ch.wait_send()
        other.wait_send()
    else:
        out["wire_tags"] = (int(ch.recv("on0")["v"]), int(other.recv("on7")["v"]))

    # validation, before anything is sent
    errors = {}
    for name, call in {
        "tag": lambda: ch.isend(3, {}),
        "payload": lambda: ch.isend("t", [1]),
        "sparse": lambda: ch.isend("t", {"s": torch.eye(2).to_sparse()}),
        "unpicklable": lambda: ch.isend("t", {"f": lambda: 0}),
        "self": lambda: PPChannel(group, rank, peer),
        "outsider": lambda: PPChannel(group, 5, peer),
        "no_send_peer": lambda: PPChannel(group, None, peer).isend("t", {}),
    }.items():
        try:
            call()
            errors[name] = None
        except (TypeError, ValueError) as e:
            errors[name] = f"{type(e).__name__}: {e}"
    out["validation"] = errors
    dist.barrier(group=group)

    # last: a receive timeout (fatal: gloo closes the pair). Rank 0 stays up until rank 1 has timed out,
    # so that the failure is the timeout and not the peer's exit.
    if rank == 1:
        t0 = time.monotonic()
        try:
            ch.recv("never", timeout_s=RECV_TIMEOUT_S)
            out["timeout"] = "returned"
        except PPChannelTimeout as e:
            out["timeout"] = ("PPChannelTimeout", time.monotonic() - t0, str(e))
        try:
            ch.recv("after")
            out["after_timeout"] = "returned"
        except PPChannelError as e:
            out["after_timeout"] = f"{type(e).__name__}: {e}"
        peer_done.set()
    else:
        peer_done.wait(30)
    return out


# --- the 3-rank world ---------------------------------------------------------------------------------------

def _ring(ch: PPChannel, stage: int, prev: int, iterations: int, recv_first: bool) -> tuple[int, float]:
    ok = 0
    t0 = time.monotonic()
    for k in range(iterations):
        got = ch.exchange("proxy", _ring_message(stage, k), "proxy", recv_first=recv_first)
        ok += _ring_ok(got, prev, k)
    ch.wait_send()
    return ok, time.monotonic() - t0


def _three_rank_scenarios(ctx) -> dict:
    stage, prev, nxt = ctx.pp_rank, (ctx.pp_rank - 1) % 3, (ctx.pp_rank + 1) % 3
    group = ctx.world_cpu_group
    out: dict = {}
    # every group is created on every rank in the same order, before any of them is used; the deadlock gets a
    # group of its own because a timed-out wait closes gloo's connections on its group
    deadlock_group = dist.new_group([0, 1, 2], backend="gloo")

    ch = PPChannel(group, ctx.pp_next_rank, ctx.pp_prev_rank)
    out["send_first"] = _ring(ch, stage, prev, RING_ITERATIONS, recv_first=False)

    blocking = PPChannel(group, ctx.pp_next_rank, ctx.pp_prev_rank, wire_tag=1, blocking_send=True)
    out["alternating"] = _ring(blocking, stage, prev, RING_ITERATIONS // 2, recv_first=recv_first_for_stage(stage))
    dist.barrier(group=group)

    # blocking sends, every stage sending first (what `blocking_send` does, with a bound on the wait): each
    # stage's send waits for a receiver held in its own send, so no receive is posted and no send completes.
    # Stages 0 and 1 take their bounded waits one after the other, in the order the barriers fix, never at once:
    # a wait that times out makes gloo close every connection of that rank on the group, and a neighbour whose
    # send to it is pending then fails with "connection closed" instead of its own timeout (which of two
    # simultaneous bounds fires first is up to the scheduler: the flake this order removes). While stage 0
    # waits, stages 1 and 2 sit in a barrier on `group`'s own connections: they post no receive and close
    # nothing, so only stage 0's bound can end its wait. While stage 1 waits, stage 2 still posts no receive
    # (its own send failed when stage 0's timeout closed their connection, and a failure, unlike a timeout,
    # closes no other connection), so only stage 1's bound can end its wait.
    doomed = PPChannel(deadlock_group, nxt, prev)
    handle = doomed.isend("proxy", {"x": torch.zeros(1 << 16)})  # posted on every stage; received nowhere
    for turn in (0, 1):
        if stage == turn:
            t0 = time.monotonic()
            try:
                handle.wait(timeout_s=DEADLOCK_TIMEOUT_S)
                doomed.recv("proxy", timeout_s=DEADLOCK_TIMEOUT_S)
                out["deadlock"] = "completed"
            except PPChannelError as e:
                out["deadlock"] = (type(e).__name__, time.monotonic() - t0, str(e))
            try:
                doomed.isend("proxy", {})
                out["after_deadlock"] = "sent"
            except PPChannelError as e:
                out["after_deadlock"] = f"{type(e).__name__}: {e}"
        dist.barrier(group=group)  # world_cpu_group has its own connections: still usable

    # a stage that dies: stage 2 exits while stage 0 waits for its message
    if stage == 2:
        time.sleep(0.3)
        os._exit(0)
    if stage == 0:
        t0 = time.monotonic()
        try:
            ch.recv("from-the-dead")
            out["dead_peer"] = "returned"
        except PPChannelError as e:
            out["dead_peer"] = (type(e).__name__, time.monotonic() - t0, str(e))
    return out


# --- harness ------------------------------------------------------------------------------------------------

def _worker(rank: int, world: int, port: int, results, peer_done) -> None:
    torch.set_num_threads(1)
    try:
        ctx = init_distributed(1, world, rank, f"127.0.0.1:{port}", "cpu", init_timeout_s=30, op_timeout_s=30)
        out = _two_rank_scenarios(ctx, peer_done) if world == 2 else _three_rank_scenarios(ctx)
        # plain pickle: tensors travel by value, not as shared-memory handles that die with this process
        results.put(pickle.dumps((rank, out)))
    except BaseException:
        results.put(pickle.dumps((rank, {"error": traceback.format_exc()})))
    results.close()
    results.join_thread()  # flush the queue's feeder thread before the hard exit
    # no destroy_distributed: a timed-out pair or a dead peer can make a clean teardown block
    os._exit(0)


def _run_world(world: int) -> dict[int, dict]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    peer_done = ctx.Event()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, results, peer_done), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    expected = world - 1 if world == 3 else world  # stage 2 of the ring dies without reporting
    out: dict[int, dict] = {}
    deadline = time.monotonic() + JOIN_S
    try:
        while len(out) < expected:
            rank, value = pickle.loads(results.get(timeout=max(0.1, deadline - time.monotonic())))
            out[rank] = value
    except queue.Empty:
        pytest.fail(f"world of {world}: only ranks {sorted(out)} reported within {JOIN_S}s (a hang?)")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    for rank, value in out.items():
        assert "error" not in value, f"rank {rank}:\n{value['error']}"
    return out


@pytest.fixture(scope="module")
def two():
    return _run_world(2)


@pytest.fixture(scope="module")
def three():
    return _run_world(3)


def test_round_trip_is_bit_exact(two):
    sent = _payloads()
    received, echoed = two[1]["received"], two[0]["echoed"]
    assert len(received) == len(echoed) == len(sent)
    for (tag, payload), got, back in zip(sent, received, echoed, strict=True):
        assert _same(got, payload), tag
        assert _same(back, payload), tag
    # the contiguous copy of a transposed tensor arrives contiguous, with the same values
    assert received[3]["transposed"].is_contiguous() and received[3]["transposed"].shape == (4, 6)
    assert not _same(received[0], sent[1][1])  # the comparison can fail


def test_received_tensors_are_fresh(two):
    assert two[1]["fresh"] is True  # every non-empty tensor received in its own storage
    assert two[1]["writable"] is True


def test_tags_park_and_come_back_fifo(two):
    assert two[1]["parking_order"] == [("c", 1, 1), ("b", 1, 1), ("a", 1, 1), ("a", 2, 2), ("b", 2, 2)]
    assert two[1]["parked_after_c"] == {"a": 2, "b": 1, "c": 0}
    assert two[1]["parked_at_end"] == {"a": 0, "b": 0, "c": 0}


def test_one_send_in_flight(two):
    stats = two[0]["in_flight"]
    assert stats["first_isend_s"] < 0.3, stats  # posting 8 MiB does not wait for the receiver
    assert stats["second_isend_s"] >= IN_FLIGHT_DELAY_S - 0.2, stats  # the second waited for the first
    assert stats["first_done"] is True and stats["second_done_before_wait"] is False
    assert stats["second_done_after_wait"] is True
    assert two[1]["in_flight_recv"] == (float(2 << 20), {"y": 1})


def test_send_buffers_live_until_sent(two):
    assert two[1]["kept"] is True


def test_wire_tags_are_separate_channels(two):
    assert two[1]["wire_tags"] == (0, 7)


def test_validation(two):
    for rank in (0, 1):
        errors = two[rank]["validation"]
        assert errors["tag"].startswith("TypeError: a message tag is a str"), errors
        assert errors["payload"].startswith("TypeError: a payload is a dict"), errors
        assert errors["sparse"].startswith("ValueError: payload['s']: only dense CPU tensors"), errors
        assert errors["unpicklable"].startswith("TypeError: payload of 't' cannot be pickled"), errors
        assert errors["self"] == f"ValueError: peer_rank_send {rank} is this rank: a channel joins two " \
                                 f"different ranks", errors
        assert errors["outsider"] == "ValueError: peer_rank_send 5 is not in the group (ranks [0, 1])", errors
        assert errors["no_send_peer"] == "ValueError: this channel has no send peer", errors


def test_receive_timeout_is_bounded_and_fatal(two):
    kind, elapsed, text = two[1]["timeout"]
    assert kind == "PPChannelTimeout" and "'never' from rank 0" in text
    assert RECV_TIMEOUT_S - 0.05 <= elapsed < RECV_TIMEOUT_S + 2.0
    assert two[1]["after_timeout"].startswith("PPChannelError: the channel failed earlier")


def test_ring_send_first_many_iterations(three):
    for stage in (0, 1):
        ok, _ = three[stage]["send_first"]
        assert ok == RING_ITERATIONS, (stage, three[stage]["send_first"])


def test_ring_alternating_order_with_blocking_sends(three):
    for stage in (0, 1):
        ok, _ = three[stage]["alternating"]
        assert ok == RING_ITERATIONS // 2, (stage, three[stage]["alternating"])


def test_ring_blocking_send_first_deadlocks(three):
    """The negative control: with sends that block, every stage sending first is a cycle of waits. Each
    stage's bounded wait is the only thing that can end it (the scenario orders them), so each must end in
    its own timeout, after the full bound; a send that completed ("completed") or a failure of any other kind
    fails the test."""
    for stage in (0, 1):
        outcome = three[stage]["deadlock"]
        assert isinstance(outcome, tuple), (stage, outcome)  # "completed": a send went through, no deadlock
        kind, elapsed, text = outcome
        assert kind == "PPChannelTimeout" and elapsed >= DEADLOCK_TIMEOUT_S - 0.1, three[stage]["deadlock"]
        assert text.startswith(f"send of 'proxy' to rank {stage + 1}:"), text
        assert three[stage]["after_deadlock"].startswith("PPChannelTimeout: send of 'proxy'"), three[stage]


def test_dead_peer_fails_instead_of_hanging(three):
    kind, elapsed, text = three[0]["dead_peer"]
    assert kind == "PPChannelError" and "'from-the-dead' from rank 2" in text, text
    assert elapsed < 10, elapsed
