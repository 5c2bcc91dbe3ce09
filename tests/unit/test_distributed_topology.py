"""Rank arithmetic of the tp × pp world (topology.py), ParallelContext's roles and neighbours, the backend
choice, and the size-1 identities of the control collectives — all without torch.distributed."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tokenloom.device import distributed_backend
from tokenloom.distributed import topology
from tokenloom.distributed.comm import all_equal, broadcast_pyobj, min_reduce_ints, value_digest
from tokenloom.distributed.groups import init_distributed
from tokenloom.distributed.parallel_state import SINGLE_PROCESS, ParallelContext, divide


def _ctx(rank: int, tp: int, pp: int) -> ParallelContext:
    tp_rank, pp_rank = topology.rank_coords(rank, tp, pp)
    return ParallelContext(tp_rank=tp_rank, tp_size=tp, pp_rank=pp_rank, pp_size=pp)


def test_rank_layout_is_pp_major():
    # tp 2 x pp 3, written out by hand: stage p holds ranks 2p, 2p+1.
    expected = {0: (0, 0), 1: (1, 0), 2: (0, 1), 3: (1, 1), 4: (0, 2), 5: (1, 2)}
    for rank, (tp_rank, pp_rank) in expected.items():
        assert topology.rank_coords(rank, 2, 3) == (tp_rank, pp_rank)
        assert topology.global_rank(tp_rank, pp_rank, 2, 3) == rank
        assert _ctx(rank, 2, 3).rank == rank
    assert topology.all_tp_groups(2, 3) == [[0, 1], [2, 3], [4, 5]]
    assert topology.all_tp_groups(1, 2) == [[0], [1]]
    assert _ctx(5, 2, 3).tp_ranks == [4, 5] and _ctx(5, 2, 3).tp_src_rank == 4
    assert _ctx(3, 2, 3).world_size == 6


def test_roles_of_each_rank():
    # tp 2 x pp 2: only rank 0 is the entry; stage 1 (ranks 2, 3) is the output stage.
    roles = {r: (c.is_entry, c.is_first_stage, c.is_last_stage, c.is_output)
             for r in range(4) for c in [_ctx(r, 2, 2)]}
    assert roles == {0: (True, True, False, False), 1: (False, True, False, False),
                     2: (False, False, True, True), 3: (False, False, True, True)}
    # One stage: it is both first and output; tp rank 1 is not the entry.
    assert _ctx(1, 2, 1).is_output and _ctx(1, 2, 1).is_first_stage and not _ctx(1, 2, 1).is_entry
    assert SINGLE_PROCESS.is_entry and SINGLE_PROCESS.is_output and SINGLE_PROCESS.world_size == 1


def test_pp_neighbours_form_a_ring_per_tp_rank():
    # tp 2 x pp 3: tp rank 1 lives on ranks 1, 3, 5; the ring closes 5 -> 1.
    assert [(c.pp_prev_rank, c.pp_next_rank) for c in (_ctx(r, 2, 3) for r in (1, 3, 5))] == [(5, 3), (1, 5), (3, 1)]
    assert topology.pp_neighbours(0, 2, 3) == (4, 2)
    assert (SINGLE_PROCESS.pp_prev_rank, SINGLE_PROCESS.pp_next_rank) == (0, 0)


def test_node_split_is_contiguous_and_equal():
    assert topology.node_ranks(2, 2, 2, 0) == range(0, 2)
    assert topology.node_ranks(2, 2, 2, 1) == range(2, 4)
    assert topology.node_ranks(4, 1, 2, 1) == range(2, 4)  # a TP group may span nodes
    assert topology.node_ranks(2, 1, 1, 0) == range(0, 2)
    covered = [r for n in range(3) for r in topology.node_ranks(3, 2, 3, n)]
    assert covered == list(range(6))


@pytest.mark.parametrize(("tp", "pp", "nnodes", "node_rank", "message"), [
    (2, 1, 4, 0, "not divisible by --nnodes"),
    (3, 1, 2, 0, "not divisible by --nnodes"),
    (2, 1, 2, 2, "--node-rank"),
    (2, 1, 2, -1, "--node-rank"),
    (2, 1, 0, 0, "--nnodes"),
    (0, 1, 1, 0, "at least 1"),
])
def test_node_split_errors(tp, pp, nnodes, node_rank, message):
    with pytest.raises(ValueError, match=message):
        topology.node_ranks(tp, pp, nnodes, node_rank)


def test_threads_per_rank_never_oversubscribes():
    assert topology.threads_per_rank(2, cores=2) == 1
    assert topology.threads_per_rank(1, cores=2) == 2
    assert topology.threads_per_rank(3, cores=16) == 5
    assert topology.threads_per_rank(4, cores=2) == 1  # at least one
    assert topology.threads_per_rank(1) == topology.available_cores() >= 1
    with pytest.raises(ValueError, match="local_ranks"):
        topology.threads_per_rank(0, cores=2)


def test_rank_errors():
    with pytest.raises(ValueError, match="outside world size 4"):
        topology.rank_coords(4, 2, 2)
    with pytest.raises(ValueError, match="outside"):
        topology.global_rank(2, 0, 2, 1)
    with pytest.raises(ValueError, match="pp_rank 2 outside pp_size 2"):
        ParallelContext(pp_rank=2, pp_size=2)
    with pytest.raises(ValueError, match="tp_rank 1 outside tp_size 1"):
        ParallelContext(tp_rank=1)
    with pytest.raises(ValueError, match="at least 1"):
        ParallelContext(pp_size=0)


@pytest.mark.parametrize(("addr", "parsed"), [
    ("127.0.0.1:29500", ("127.0.0.1", 29500)),
    ("node-0.cluster:1", ("node-0.cluster", 1)),
    ("[::1]:65535", ("::1", 65535)),
])
def test_parse_dist_init_addr(addr, parsed):
    assert topology.parse_dist_init_addr(addr) == parsed


@pytest.mark.parametrize("addr", ["127.0.0.1", "127.0.0.1:", ":29500", "host:port", "host:0", "host:65536",
                                  "::1:29500", "host:-1"])
def test_parse_dist_init_addr_errors(addr):
    with pytest.raises(ValueError, match="--dist-init-addr"):
        topology.parse_dist_init_addr(addr)


def test_backend_by_device():
    assert distributed_backend("cpu") == "gloo"
    assert distributed_backend(torch.device("cuda", 1)) == "nccl"  # a name only: no CUDA needed
    with pytest.raises(ValueError, match="meta"):
        distributed_backend("meta")


def test_size_one_needs_no_torch_distributed():
    ctx = init_distributed(1, 1, 0, None, "cpu")
    assert ctx == SINGLE_PROCESS and not dist.is_initialized()
    obj = {"a": [1, 2]}
    assert broadcast_pyobj(obj, ctx) is obj
    assert min_reduce_ints([5, 3], ctx) == [5, 3]
    assert all_equal("anything", ctx) and all_equal(1, ctx, across="world")
    x = torch.ones(3)
    assert ctx.all_reduce(x) is x and ctx.all_gather_last_dim(x) is x
    with pytest.raises(ValueError, match="across"):
        all_equal(1, ctx, across="stage")
    with pytest.raises(ValueError, match="--dist-init-addr"):
        init_distributed(2, 1, 0, None, "cpu")
    assert not dist.is_initialized()


def test_value_digest_distinguishes_and_repeats():
    assert value_digest([1, 2, 3]) == value_digest([1, 2, 3])
    assert value_digest([1, 2, 3]) != value_digest([1, 2, 4])
    assert value_digest(("a", 1)) != value_digest(("a", 1.0))
    assert 0 <= value_digest({"k": "v"}) < 2**63


def test_divide_kept():
    assert divide(12, 4, "heads") == 3
    with pytest.raises(ValueError, match="heads \\(10\\) is not divisible by tp_size \\(4\\)"):
        divide(10, 4, "heads")
