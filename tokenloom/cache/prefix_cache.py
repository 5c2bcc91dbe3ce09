"""`PrefixCache`: the interface between the scheduler and a KV prefix cache (radix tree or none).

A request's life with the cache:
1. `match_prefix(tokens)` before it is scheduled: the KV slots of the longest cached, page-aligned prefix
   (never all of `tokens`; the caller passes at most len-1 tokens so one token is always computed) and the
   tree node that ends it.
2. When admitted: `inc_lock_ref(node)` protects that prefix from eviction while the request runs.
3. After a non-final prefill chunk: `cache_unfinished(...)` inserts the KV computed so far, frees the
   request's duplicate slots, rewrites its `req_to_token` row to the tree's slots, moves its lock to the new
   node and returns the new prefix slots (the request keeps its unaligned tail slots).
4. When it finishes (or is aborted): `cache_finished(...)` inserts its page-aligned KV, frees duplicates
   and the unaligned tail, releases its lock. The request row itself is freed by the caller.
   When it is retracted: `release_unfinished(...)` frees everything it owns beyond its locked prefix
   without inserting, and releases the lock.
5. Sliding-window pools only (swa_radix_cache.py): after each decode step, `release_out_of_window(...)` drops
   the sliding-layer KV of the positions that just left the request's window.

Accounting invariant (checked by `check_integrity` when no request is running):
    allocator.available_size() + evictable_size() + protected_size() == pool size.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class MatchResult:
    indices: torch.Tensor  # int64 KV slots of the matched prefix (length is a page multiple)
    last_node: Any  # opaque handle to lock/unlock; the root when nothing matched

    @property
    def length(self) -> int:
        return int(self.indices.numel())


class PrefixCache(ABC):
    @abstractmethod
    def match_prefix(self, tokens: list[int]) -> MatchResult: ...

    @abstractmethod
    def inc_lock_ref(self, node: Any) -> None: ...

    @abstractmethod
    def dec_lock_ref(self, node: Any) -> None: ...

    @abstractmethod
    def cache_finished(self, row: int, tokens: list[int], kv_len: int, prefix_len: int, last_node: Any) -> None:
        """The request in `row` is done. `tokens[:kv_len]` have KV at req_to_token[row, :kv_len];
        `prefix_len` of them were the locked prefix it matched (`last_node`). Frees every slot the tree
        does not keep and releases the lock. Does not free the row."""

    @abstractmethod
    def cache_unfinished(self, row: int, tokens: list[int], prefix_len: int, last_node: Any
                         ) -> tuple[torch.Tensor, Any]:
        """The request in `row` computed KV for all of `tokens` (a chunk boundary). Returns
        (slots now covering `tokens`, i.e. tree prefix + the request's own unaligned tail; new last node)."""

    @abstractmethod
    def release_unfinished(self, row: int, kv_len: int, prefix_len: int, last_node: Any) -> None:
        """Retraction: free req_to_token[row, prefix_len:kv_len] without caching it; release the lock."""

    @abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` slots of unlocked cached KV if possible; return how many were freed."""

    @abstractmethod
    def evictable_size(self) -> int: ...

    @abstractmethod
    def protected_size(self) -> int: ...

    @abstractmethod
    def reset(self) -> None:
        """Drop every cached entry (slots back to the allocator). Only valid when nothing is locked."""

    def check_integrity(self) -> None:
        """Raise AssertionError unless free + evictable + protected == pool size (call when idle)."""
        free = self.allocator.full_available_size()
        total = free + self.evictable_size() + self.protected_size()
        if total != self.allocator.size:
            raise AssertionError(
                f"KV leak: free {free} + evictable {self.evictable_size()} + "
                f"protected {self.protected_size()} = {total} != pool size {self.allocator.size}")

    sliding_window: int = 0  # > 0: a sliding-window pool's cache, which has `release_out_of_window`

    allocator: Any  # set by implementations: the TokenAllocator / PagedAllocator they free into
