"""Control-plane collectives over the gloo CPU groups: how ranks agree by construction.

- `broadcast_pyobj`: TP rank 0's Python object to its TP group (requests, aborts, rank-0 decisions such as
  the adaptive overlap policy's choice). `tp_cpu_group`, on the scheduling thread.
- `min_reduce_ints`: the MIN of a few ints over every rank of every stage (KV capacity, request slots at start,
  so every rank schedules within the smallest pool). `world_cpu_group`, before the event loop starts.
- `all_equal`: whether every rank holds the same small value (a step's batch composition): a cheap
  consistency check for tests and a debug flag.
- `all_gather_pyobj`: every rank's Python object, on every rank of the world (the ranks that could not compile
  a grammar the entry rank admitted, scheduler/grammar_sync.py). `world_cpu_group`, on the scheduling thread,
  where every rank handles the same message.

None of these touch the compute group (`tp_group`): with the overlap scheduler the forward thread's
all-reduces run on it concurrently with these, and a group carries one ordered stream of collectives per
rank, so sharing it would pair a broadcast on one rank with an all-reduce on another. Every function is the
identity (no torch.distributed) when its group has one rank. Invariant: every member calls the same functions
on the same group in the same order, with arguments of the same shape (the same number of ints).
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence
from typing import Literal, TypeVar

import torch
import torch.distributed as dist

from tokenloom.distributed.parallel_state import ParallelContext

T = TypeVar("T")


def broadcast_pyobj(obj: T | None, ctx: ParallelContext) -> T:
    """Return TP rank 0's `obj` on every rank of this stage's TP group (other ranks' `obj` is ignored).

    Over `tp_cpu_group` (gloo, CPU tensors even on CUDA): the pickled bytes' length as one int64, then the
    bytes as a uint8 tensor, as SGLang's broadcast_pyobj does; two messages, so receivers size their buffer
    exactly. Under PP each stage's TP rank 0 is the source for its own stage.
    """
    if ctx.tp_size == 1:
        return obj  # type: ignore[return-value]
    group, src = ctx.tp_cpu_group, ctx.tp_src_rank
    if ctx.tp_rank == 0:
        payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        size = torch.tensor([len(payload)], dtype=torch.int64)
        dist.broadcast(size, src=src, group=group)
        dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), src=src, group=group)
        return obj  # type: ignore[return-value]
    size = torch.empty(1, dtype=torch.int64)
    dist.broadcast(size, src=src, group=group)
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(data, src=src, group=group)
    return pickle.loads(data.numpy().tobytes())


def min_reduce_ints(values: Sequence[int], ctx: ParallelContext) -> list[int]:
    """Element-wise MIN of `values` over every rank of every stage (each rank passes the same count).

    Over `world_cpu_group`: stages hold different layers and so different KV capacities, yet all of them
    must make the same scheduling decisions, so the agreement spans the whole world, not one TP group.
    """
    if ctx.world_size == 1:
        return [int(v) for v in values]
    t = torch.tensor([int(v) for v in values], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=ctx.world_cpu_group)
    return [int(v) for v in t.tolist()]


def value_digest(value: object) -> int:
    """A 63-bit digest of `value`'s pickle. Pickles are deterministic for ints, strings, lists, tuples and
    dicts built in the same order, but not for sets of strings (their order follows the per-process hash
    seed): pass sorted sequences."""
    digest = hashlib.blake2b(pickle.dumps(value, protocol=4), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def all_equal(value: object, ctx: ParallelContext, *, across: Literal["tp", "world"] = "tp") -> bool:
    """True on every rank iff every rank of the TP group (`across="tp"`, over `tp_cpu_group`: a scheduling-
    thread check such as a step's batch composition) or of the whole world (`"world"`, over
    `world_cpu_group`) holds an equal `value`. One all-gather of an 8-byte digest (`value_digest`), so every
    rank gets the same answer and it costs the same whatever the value's size."""
    if across == "tp":
        size, group = ctx.tp_size, ctx.tp_cpu_group
    elif across == "world":
        size, group = ctx.world_size, ctx.world_cpu_group
    else:
        raise ValueError(f"across must be 'tp' or 'world', not {across!r}")
    if size == 1:
        return True
    mine = torch.tensor([value_digest(value)], dtype=torch.int64)
    gathered = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(gathered, mine, group=group)
    return all(int(g.item()) == int(mine.item()) for g in gathered)


def all_gather_pyobj(obj: T, ctx: ParallelContext) -> list[T]:
    """Every rank's `obj` (picklable), indexed by global rank, on every rank of the world; over
    `world_cpu_group`. Called on the scheduling thread while handling a message every rank handles at the
    same iteration (under PP that waits for every stage to reach it, as a state report does)."""
    if ctx.world_size == 1:
        return [obj]
    gathered: list = [None] * ctx.world_size
    dist.all_gather_object(gathered, obj, group=ctx.world_cpu_group)
    return gathered
