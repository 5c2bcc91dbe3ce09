"""Which tensor-parallel shard this process holds, and the collectives that join the shards.

A `ParallelContext` is passed explicitly to every layer that is sharded (no module-level "current group").
At `tp_size == 1` every collective is the identity, so a single process needs no torch.distributed at all.
Invariant: all ranks of a group call the same collectives in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelContext:
    tp_rank: int = 0
    tp_size: int = 1
    tp_group: Any = None  # a torch.distributed ProcessGroup when tp_size > 1

    def __post_init__(self) -> None:
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} outside tp_size {self.tp_size}")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the TP group in place (row-parallel outputs, vocab-parallel embeddings)."""
        if self.tp_size > 1:
            dist.all_reduce(x, group=self.tp_group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate each rank's shard along the last dimension (vocab-parallel logits)."""
        if self.tp_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        dist.all_gather(parts, x.contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=-1)


SINGLE_PROCESS = ParallelContext()


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by tp_size ({denominator})")
    return numerator // denominator
