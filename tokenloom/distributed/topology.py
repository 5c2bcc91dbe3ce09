"""Rank arithmetic of a tp × pp world spread over nodes: pure functions, no torch.distributed.

Layout (SGLang's): global rank = pp_rank * tp_size + tp_rank, so a pipeline stage's TP ranks are contiguous
and a TP group is `[pp_rank * tp_size, (pp_rank + 1) * tp_size)`. Across nodes the world is split into
contiguous, equal blocks: node n runs ranks `[n * per_node, (n + 1) * per_node)`, so node 0 always runs
global rank 0 (the entry rank, which also hosts the rendezvous store).
Invariant: every function here gives the same answer on every rank for the same arguments; the launcher and
`init_distributed` build groups from them, so ranks agree on the groups by construction.
"""

from __future__ import annotations

import os


def _check_sizes(tp_size: int, pp_size: int) -> None:
    if tp_size < 1 or pp_size < 1:
        raise ValueError(f"tp_size ({tp_size}) and pp_size ({pp_size}) must be at least 1")


def global_rank(tp_rank: int, pp_rank: int, tp_size: int, pp_size: int) -> int:
    """The global rank of (tp_rank, pp_rank)."""
    _check_sizes(tp_size, pp_size)
    if not (0 <= tp_rank < tp_size and 0 <= pp_rank < pp_size):
        raise ValueError(f"(tp_rank {tp_rank}, pp_rank {pp_rank}) outside tp_size {tp_size} x pp_size {pp_size}")
    return pp_rank * tp_size + tp_rank


def rank_coords(rank: int, tp_size: int, pp_size: int) -> tuple[int, int]:
    """(tp_rank, pp_rank) of a global rank."""
    _check_sizes(tp_size, pp_size)
    if not 0 <= rank < tp_size * pp_size:
        raise ValueError(f"rank {rank} outside world size {tp_size * pp_size} (tp {tp_size} x pp {pp_size})")
    return rank % tp_size, rank // tp_size


def tp_group_ranks(pp_rank: int, tp_size: int) -> list[int]:
    """Global ranks of stage `pp_rank`'s TP group, TP rank 0 first."""
    return list(range(pp_rank * tp_size, (pp_rank + 1) * tp_size))


def all_tp_groups(tp_size: int, pp_size: int) -> list[list[int]]:
    """Every stage's TP group, stage 0 first: the order in which every rank creates them."""
    _check_sizes(tp_size, pp_size)
    return [tp_group_ranks(p, tp_size) for p in range(pp_size)]


def pp_neighbours(rank: int, tp_size: int, pp_size: int) -> tuple[int, int]:
    """(prev, next): the global ranks with the same tp_rank on the previous and next stage, as a ring.

    The ring closes last → first because sampled tokens travel from the last stage back to stage 0, which
    embeds them in its next batch (as in SGLang's `event_loop_pp`). At pp_size 1 both are `rank` itself.
    """
    tp_rank, pp_rank = rank_coords(rank, tp_size, pp_size)
    prev_stage = (pp_rank - 1) % pp_size
    next_stage = (pp_rank + 1) % pp_size
    return prev_stage * tp_size + tp_rank, next_stage * tp_size + tp_rank


def node_ranks(tp_size: int, pp_size: int, nnodes: int, node_rank: int) -> range:
    """The global ranks node `node_rank` of `nnodes` runs (contiguous, equal blocks)."""
    _check_sizes(tp_size, pp_size)
    if nnodes < 1:
        raise ValueError(f"--nnodes ({nnodes}) must be at least 1")
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"--node-rank ({node_rank}) must be in [0, --nnodes {nnodes})")
    world = tp_size * pp_size
    if world % nnodes:
        raise ValueError(f"the world size tp_size x pp_size = {tp_size} x {pp_size} = {world} is not divisible by "
                         f"--nnodes ({nnodes}): every node runs the same number of ranks")
    per_node = world // nnodes
    return range(node_rank * per_node, (node_rank + 1) * per_node)


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask, which containers and taskset narrow)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # platforms without sched_getaffinity, or a mask that cannot be read
        return max(1, os.cpu_count() or 1)


def threads_per_rank(local_ranks: int, cores: int | None = None) -> int:
    """Default intra-op threads of each of this node's `local_ranks` ranks: cores / local ranks, at least 1,
    so the ranks of one node never oversubscribe its cores (each rank's OpenMP team spins on its own cores)."""
    if local_ranks < 1:
        raise ValueError(f"local_ranks ({local_ranks}) must be at least 1")
    if cores is None:
        cores = available_cores()
    return max(1, cores // local_ranks)


def parse_dist_init_addr(addr: str) -> tuple[str, int]:
    """`host:port` (IPv6 as `[::1]:port`) → (host, port), with a clear error for anything else."""
    host, sep, port_text = addr.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"--dist-init-addr {addr!r}: expected host:port with a port in 1..65535 "
                         f"(IPv6 as [addr]:port)")
    if ":" in host and not addr.startswith("["):
        raise ValueError(f"--dist-init-addr {addr!r}: write an IPv6 address in brackets, [addr]:port")
    return host, int(port_text)
