"""`ChunkCache`: the `--disable-radix-cache` prefix cache — no sharing, every request owns all of its KV.

Nothing is ever cached: `match_prefix` matches nothing, locks are no-ops, a chunked request simply keeps its
own slots between chunks, and finishing or retracting frees every slot of its row up to `kv_len`.
Sizes are always 0, so when idle `allocator.available_size() == allocator.size`.
"""

from __future__ import annotations

from typing import Any

import torch

from tokenloom.cache.prefix_cache import MatchResult, PrefixCache
from tokenloom.cache.req_to_token import ReqToTokenPool


class _DummyNode:
    """The only "node": stands in for the tree root in `MatchResult.last_node`."""

    def __repr__(self) -> str:
        return "ChunkCache.root"


class ChunkCache(PrefixCache):
    def __init__(self, req_to_token_pool: ReqToTokenPool, allocator: Any, page_size: int) -> None:
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.page_size = page_size
        self.device = allocator.device
        self.root_node = _DummyNode()

    def match_prefix(self, tokens: list[int]) -> MatchResult:
        return MatchResult(torch.empty(0, dtype=torch.int64, device=self.device), self.root_node)

    def inc_lock_ref(self, node: Any) -> None:
        pass

    def dec_lock_ref(self, node: Any) -> None:
        pass

    def cache_finished(self, row: int, tokens: list[int], kv_len: int, prefix_len: int, last_node: Any) -> None:
        self._free_row(row, kv_len)

    def cache_unfinished(self, row: int, tokens: list[int], prefix_len: int, last_node: Any
                         ) -> tuple[torch.Tensor, Any]:
        return self.req_to_token_pool.req_to_token[row, : len(tokens)].to(torch.int64), self.root_node

    def release_unfinished(self, row: int, kv_len: int, prefix_len: int, last_node: Any) -> None:
        self._free_row(row, kv_len)

    def _free_row(self, row: int, kv_len: int) -> None:
        if kv_len > 0:
            self.allocator.free(self.req_to_token_pool.req_to_token[row, :kv_len].to(torch.int64))

    def evict(self, num_tokens: int) -> int:
        return 0

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def reset(self) -> None:
        pass
