"""The distributed layer with real processes over gloo on loopback: `init_distributed` builds the groups of a
tp 2 and a tp 2 × pp 2 world, the control collectives deliver what they promise, the compute and control
groups can be driven from two threads at once (the overlap scheduler's situation), and a rendezvous that
cannot complete fails within its bound with an error naming the missing ranks and the address."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch
import torch.distributed as dist

from tests.rank_processes import free_port, report_from_world, run_ranks
from tokenloom.distributed.comm import all_equal, broadcast_pyobj, min_reduce_ints
from tokenloom.distributed.groups import DistributedInitError, init_distributed
from tokenloom.protocol import AbortRequest, TokenizedRequest
from tokenloom.sampling.sampling_params import SamplingParams

OVERLAP_STEPS = 150
JOIN_S = 60


def _payload(pp_rank: int) -> dict:
    """What TP rank 0 of stage `pp_rank` broadcasts: nested containers and protocol dataclasses."""
    request = TokenizedRequest(rid=f"r{pp_rank}", input_text="héllo", input_ids=list(range(300)),
                               sampling_params=SamplingParams(max_new_tokens=7, temperature=0.5, stop=["\n"],
                                                              sampling_seed=11 + pp_rank),
                               return_logprob=True, logprob_start_len=2, token_ids_logprob=[3, 4])
    return {"stage": pp_rank, "reqs": [request], "aborts": [AbortRequest(rid="x")],
            "nested": {"a": {"b": [1, (2, 3)], "c": None}}, "blob": bytes(range(256)) * 40}


def _value(rank: int) -> float:
    return float(rank + 1)


def _overlap(ctx) -> list[str]:
    """Compute all-reduces on one thread and control broadcasts on another, concurrently; return mismatches."""
    errors: list[str] = []
    start = threading.Barrier(2)
    stage_sum = sum(_value(r) for r in ctx.tp_ranks)

    def forward() -> None:
        start.wait()
        for i in range(OVERLAP_STEPS):
            x = torch.full((64 + i % 5,), _value(ctx.rank) * (i + 1))
            ctx.all_reduce(x)
            if not torch.equal(x, torch.full_like(x, stage_sum * (i + 1))):
                errors.append(f"all_reduce step {i}: {x[:3].tolist()}")

    def schedule() -> None:
        start.wait()
        for i in range(OVERLAP_STEPS):
            sent = {"step": i, "src": ctx.tp_src_rank, "ids": list(range(i % 9 * 50))}
            got = broadcast_pyobj(sent if ctx.tp_rank == 0 else None, ctx)
            if got != sent:
                errors.append(f"broadcast step {i}: {str(got)[:80]}")

    def guarded(body):
        def run() -> None:
            try:
                body()
            except BaseException as e:  # noqa: BLE001 - a collective that fails is a finding, not a crash
                errors.append(f"{body.__name__}: {type(e).__name__}: {str(e)[:200]}")
        return run

    threads = [threading.Thread(target=guarded(f), name=f.__name__, daemon=True) for f in (forward, schedule)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=JOIN_S / 2)
    errors += [f"thread {t.name} still running (deadlock)" for t in threads if t.is_alive()]
    return errors


def _worker(rank: int, tp: int, pp: int, port: int, results) -> None:
    def body(ctx) -> dict:
        return {
            "coords": (ctx.tp_rank, ctx.pp_rank, ctx.rank, ctx.is_entry, ctx.is_output),
            "backends": (dist.get_backend(ctx.tp_group), dist.get_backend(ctx.tp_cpu_group),
                         dist.get_backend(ctx.world_cpu_group)),
            "distinct_groups": ctx.tp_group is not ctx.tp_cpu_group,
            "bcast": broadcast_pyobj(_payload(ctx.pp_rank) if ctx.tp_rank == 0 else None, ctx),
            "min": min_reduce_ints([1000 - 7 * rank, 50 + rank, (rank - 1) ** 2], ctx),
            "tp_equal": all_equal(("batch", 3, [1, 2]), ctx),
            "tp_differ": all_equal(("batch", ctx.tp_rank), ctx),
            "world_equal": all_equal(("stage?", ctx.tp_rank), ctx, across="world") if tp == 1 else
            all_equal("same", ctx, across="world"),
            "world_differ": all_equal(ctx.pp_rank, ctx, across="world"),
            "gather": ctx.all_gather_last_dim(torch.full((2, 3), _value(ctx.rank))),
            "overlap_errors": _overlap(ctx),
        }

    report_from_world(rank, tp, pp, port, results, body)


def _run_world(tp: int, pp: int) -> dict[int, dict]:
    got, exit_codes = run_ranks(_worker, tp * pp, tp, pp, join_s=JOIN_S)
    assert exit_codes == [0] * (tp * pp)
    return got


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (2, 2)])
def test_groups_and_control_collectives(tp, pp):
    got = _run_world(tp, pp)
    world = tp * pp
    for rank, out in got.items():
        tp_rank, pp_rank = rank % tp, rank // tp
        assert out["coords"] == (tp_rank, pp_rank, rank, rank == 0, pp_rank == pp - 1)
        assert out["backends"] == ("gloo", "gloo", "gloo") and out["distinct_groups"]
        # Each stage's TP rank 0 is its own source: stage 1 receives stage 1's object, not stage 0's.
        assert out["bcast"] == _payload(pp_rank)
        assert out["min"] == [1000 - 7 * (world - 1), 50, 0]
        assert out["tp_equal"] and not out["tp_differ"]
        assert out["world_equal"]
        assert out["world_differ"] is (pp == 1)  # every rank holds pp_rank 0 only when there is one stage
        stage = range(pp_rank * tp, (pp_rank + 1) * tp)
        assert torch.equal(out["gather"], torch.cat([torch.full((2, 3), float(r + 1)) for r in stage], dim=-1))
        assert out["overlap_errors"] == []


def _init_in_thread(rank: int, tp: int, pp: int, port: int, timeout_s: float, out: dict) -> threading.Thread:
    """Run the rendezvous of one rank in a thread of this process; it must fail before any process group
    exists, so threads stand in for processes here."""
    def target() -> None:
        start = time.monotonic()
        try:
            init_distributed(tp, pp, rank, f"127.0.0.1:{port}", "cpu", init_timeout_s=timeout_s)
            out[rank] = ("no error", time.monotonic() - start)
        except BaseException as e:  # noqa: BLE001 - reported to the test
            out[rank] = (e, time.monotonic() - start)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


def test_missing_ranks_fail_within_the_bound_naming_them():
    port, out, bound = free_port(), {}, 3.0
    threads = [_init_in_thread(0, 2, 2, port, bound, out)]
    time.sleep(0.3)  # rank 0 (the store's host) gives up first and tells rank 1 which ranks never came
    threads.append(_init_in_thread(1, 2, 2, port, bound, out))
    for t in threads:
        t.join(timeout=bound + 10)
    assert not dist.is_initialized()
    (error0, elapsed0), (error1, elapsed1) = out[0], out[1]
    assert isinstance(error0, DistributedInitError) and isinstance(error1, DistributedInitError), out
    missing = f"ranks 2, 3 of 4 did not reach the rendezvous at --dist-init-addr 127.0.0.1:{port} within 3s"
    assert str(error0).startswith(f"rank 0: {missing}")
    assert str(error1).startswith(f"rank 1: rank 0 gave up: {missing}")
    assert bound - 0.1 < elapsed0 < bound + 2.0 and elapsed1 < bound + 2.0


def test_missing_store_host_fails_within_the_bound():
    port, out, bound = free_port(), {}, 2.0
    _init_in_thread(1, 2, 1, port, bound, out).join(timeout=bound + 10)
    error, elapsed = out[1]
    assert isinstance(error, DistributedInitError), error
    assert f"rank 1: nothing listens at --dist-init-addr 127.0.0.1:{port}" in str(error)
    assert "global rank 0" in str(error)
    assert bound - 0.1 < elapsed < bound + 2.0


def test_ranks_launched_with_different_sizes_are_refused():
    port, out = free_port(), {}
    threads = [_init_in_thread(0, 2, 1, port, 10.0, out), _init_in_thread(1, 1, 2, port, 10.0, out)]
    for t in threads:
        t.join(timeout=20)
    for rank in (0, 1):
        error, elapsed = out[rank]
        assert isinstance(error, DistributedInitError) and "different sizes" in str(error), error
        assert "tp_size=1 pp_size=2" in str(error) and "tp_size=2 pp_size=1" in str(error)
        assert elapsed < 5


def test_address_in_use_is_a_clear_error():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(DistributedInitError, match=f"rank 0 cannot host the rendezvous at .*127.0.0.1:{port}"):
            init_distributed(2, 1, 0, f"127.0.0.1:{port}", "cpu", init_timeout_s=2)
