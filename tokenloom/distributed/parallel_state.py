"""Where this process sits in the tp × pp world, its groups, and the collectives that join the TP shards.

A `ParallelContext` is passed explicitly to every layer that is sharded (no module-level "current group").
At `tp_size == 1` every collective is the identity, so a single process needs no torch.distributed at all
(`SINGLE_PROCESS`). Global rank = pp_rank * tp_size + tp_rank (SGLang's layout; `topology.py`).

Groups (built by `distributed/init.py`, created on every rank in the same order):
- `tp_group`, the compute group (gloo on the CPU, NCCL on CUDA): the layers' all-reduce / all-gather. With the
  overlap scheduler these run on the forward thread.
- `tp_cpu_group` (always gloo, same ranks): Python-object broadcasts (requests, aborts, rank-0 decisions), which
  run on the scheduling thread. A collective group is a single ordered stream per rank: if both threads used
  one group, the all-reduces and broadcasts would interleave in a different order on different ranks and pair
  the wrong operations (a hang, or garbage). Two groups keep each thread's order self-consistent.
- `tp_comm` (not a group): on one host, the TP group's shared-memory all-reduce / all-gather, used for CPU
  tensors in place of `tp_group` (10-50x faster than gloo over loopback for decode-sized tensors; see
  docs/benchmarks.md); created collectively at start, so every rank of the group has one or none.
- `world_cpu_group` (gloo, every rank of every stage): start-up agreement across stages (MIN-reduced KV
  capacity), consistency checks, and later PP's pickled point-to-point messages.
Invariant: all ranks of a group call the same collectives on it in the same order, each group from one thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tokenloom.distributed import topology


@dataclass(frozen=True)
class ParallelContext:
    tp_rank: int = 0
    tp_size: int = 1
    tp_group: Any = None  # compute ProcessGroup (gloo/NCCL) when tp_size > 1; None: the default group
    pp_rank: int = 0
    pp_size: int = 1
    tp_cpu_group: Any = None  # gloo ProcessGroup of the same ranks as tp_group (tp_size > 1)
    world_cpu_group: Any = None  # gloo ProcessGroup of all ranks (world_size > 1)
    # the TP group's shared-memory communicator (distributed/shm_comm.py) when all its ranks share this host
    # and the CPU runs the model; the compute collectives of CPU tensors go through it instead of tp_group
    tp_comm: Any = None
    # expert parallelism (--ep-size): 1, or tp_size (each TP rank holds num_experts / ep_size whole experts,
    # the contiguous group tp_rank; layers/moe.py). Set by the model runner from the server flags.
    ep_size: int = 1

    def __post_init__(self) -> None:
        if self.ep_size not in (1, self.tp_size):
            raise ValueError(f"ep_size ({self.ep_size}) must be 1 or tp_size ({self.tp_size})")
        if self.tp_size < 1 or self.pp_size < 1:
            raise ValueError(f"tp_size ({self.tp_size}) and pp_size ({self.pp_size}) must be at least 1")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} outside tp_size {self.tp_size}")
        if not 0 <= self.pp_rank < self.pp_size:
            raise ValueError(f"pp_rank {self.pp_rank} outside pp_size {self.pp_size}")

    # --- topology -----------------------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        """Global rank: pp_rank * tp_size + tp_rank."""
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def tp_ranks(self) -> list[int]:
        """Global ranks of this stage's TP group, TP rank 0 first."""
        return topology.tp_group_ranks(self.pp_rank, self.tp_size)

    @property
    def tp_src_rank(self) -> int:
        """Global rank of this stage's TP rank 0: the source of the stage's broadcasts."""
        return self.pp_rank * self.tp_size

    @property
    def is_entry(self) -> bool:
        """The one rank that talks to the tokenizer manager (pp_rank 0, tp_rank 0): it receives requests and
        aborts, broadcasts them to its TP group (and, under PP, forwards them down the stages), and streams
        outputs to the detokenizer (under PP, tokens return to stage 0 along the ring)."""
        return self.pp_rank == 0 and self.tp_rank == 0

    @property
    def is_first_stage(self) -> bool:
        """Stage 0: owns the embedding, reads token ids."""
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        """The last stage: owns the final norm and LM head, computes logits."""
        return self.pp_rank == self.pp_size - 1

    @property
    def is_output(self) -> bool:
        """The output stage (the last one, the issue's name for it): it samples the next tokens."""
        return self.is_last_stage

    @property
    def pp_prev_rank(self) -> int:
        """Global rank of the same tp_rank on the previous stage (a ring: stage 0's is the last stage's)."""
        return topology.pp_neighbours(self.rank, self.tp_size, self.pp_size)[0]

    @property
    def pp_next_rank(self) -> int:
        """Global rank of the same tp_rank on the next stage (a ring: the last stage's is stage 0's)."""
        return topology.pp_neighbours(self.rank, self.tp_size, self.pp_size)[1]

    # --- compute collectives (tp_group; the forward thread) -------------------------------------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the TP group in place (row-parallel outputs, vocab-parallel embeddings)."""
        if self.tp_size > 1:
            if self.tp_comm is not None and self.tp_comm.handles(x):
                return self.tp_comm.all_reduce_(x)
            dist.all_reduce(x, group=self.tp_group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate each rank's shard along the last dimension (vocab-parallel logits)."""
        if self.tp_size == 1:
            return x
        if self.tp_comm is not None and self.tp_comm.handles(x):
            return self.tp_comm.all_gather_last_dim(x)
        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        dist.all_gather(parts, x.contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=-1)


SINGLE_PROCESS = ParallelContext()


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by tp_size ({denominator})")
    return numerator // denominator
