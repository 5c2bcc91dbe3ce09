"""Prefix caches over the sliding-window KV pool (cache/swa_pool.py): what sliding-layer KV may be dropped, and
which cached prefixes may still be reused once it is.

A token's sliding-layer K/V is needed only by queries less than `window` positions after it. Both caches
drop ("tombstone": `SWAAllocator.free_swa`, the full-layer KV stays) the sliding KV of a running request's
own tokens once they are `keep = window + 1` positions behind its end: after each decode step
(`release_out_of_window`) and at each prefill chunk boundary (`cache_unfinished`).

`SWARadixCache` (radix tree): tokens in the tree are shared, so the tree decides. An *end point* is a node
where a reuse or a running request may continue: a leaf, a branch (two or more children), or a node where a
request's lock ends (its lock_ref exceeds its children's). The tree keeps sliding KV only for the `window + 1`
positions before each end point; the nodes in between (single child, no lock ending there) lose theirs
whenever an end point disappears (a leaf gets a child, a lock ends). A running request locks the node
ending its cached part, so everything its next queries read is kept.

Reuse rule (correctness): `match_prefix` returns a prefix of length L only when the sliding KV of positions
[L - window - 1, L) is all present (what the query at L reads; one more for the scheduler's len-1
matches), else the longest shorter such prefix (0 at worst: the request recomputes). So a prefix cut out of
a long cached sequence at a point without its window is recomputed, never served with missing KV.
"""

from __future__ import annotations

from typing import Any

import torch

from tokenloom.cache.chunk_cache import ChunkCache
from tokenloom.cache.prefix_cache import MatchResult
from tokenloom.cache.radix_cache import RadixCache, TreeNode
from tokenloom.cache.req_to_token import ReqToTokenPool
from tokenloom.cache.swa_pool import SWAAllocator

# positions before an end point the tree keeps: the window, plus one for a match ending one token early
_KEEP_EXTRA = 1


def _free_row_range(allocator: SWAAllocator, pool: ReqToTokenPool, row: int, lo: int, hi: int) -> None:
    if hi > lo:
        allocator.free_swa(pool.req_to_token[row, lo:hi].to(torch.int64))


class SWAChunkCache(ChunkCache):
    """`--disable-radix-cache` with a sliding-window pool: a request owns its whole row."""

    def __init__(self, req_to_token_pool: ReqToTokenPool, allocator: SWAAllocator, page_size: int,
                 window: int) -> None:
        super().__init__(req_to_token_pool, allocator, page_size)
        self.window = window
        self.keep = window + _KEEP_EXTRA

    def cache_unfinished(self, row: int, tokens: list[int], prefix_len: int, last_node: Any
                         ) -> tuple[torch.Tensor, Any]:
        _free_row_range(self.allocator, self.req_to_token_pool, row, 0, len(tokens) - self.keep)
        return super().cache_unfinished(row, tokens, prefix_len, last_node)

    def release_out_of_window(self, row: int, kv_len: int, prefix_len: int, recent: int) -> None:
        """Drop the sliding KV of the `recent` positions that just left the window of the request in `row`."""
        hi = kv_len - self.keep
        _free_row_range(self.allocator, self.req_to_token_pool, row, max(0, hi - recent), hi)

    def check_integrity(self) -> None:
        """ChunkCache's check, the swa map's own, and (idle) no swa slot in use."""
        super().check_integrity()
        self.allocator.check()
        if self.allocator.swa_in_use():
            raise AssertionError(f"swa leak: {self.allocator.swa_in_use()} swa slots in use while idle")


class SWARadixCache(RadixCache):
    def __init__(self, req_to_token_pool: ReqToTokenPool, allocator: SWAAllocator, page_size: int,
                 window: int) -> None:
        super().__init__(req_to_token_pool, allocator, page_size)
        self.window = window
        self.keep = window + _KEEP_EXTRA

    # ------------------------------------------------------------------------------------------- reuse rule
    def match_prefix(self, tokens: list[int]) -> MatchResult:
        match = super().match_prefix(tokens)
        usable = self._usable_length(match.indices)
        if usable == match.length:
            return match
        return super().match_prefix(tokens[:usable])  # ends at (splits at) the usable length

    def _usable_length(self, indices: torch.Tensor) -> int:
        """The longest L <= len(indices) whose positions [L - keep, L) all have sliding KV."""
        n = int(indices.numel())
        if n == 0:
            return 0
        missing = (self.allocator.full_to_swa[indices] == 0).to(torch.int64)
        cum = torch.cat((missing.new_zeros(1), missing.cumsum(0)))  # cum[L] = missing among [0, L)
        ends = torch.arange(n + 1, device=indices.device)
        ok = (cum - cum[(ends - self.keep).clamp(min=0)]) == 0
        return int(ends[ok].max())

    def insert(self, tokens: list[int], slots: torch.Tensor) -> int:
        """RadixCache's insert; where the tree already had the tokens but dropped their sliding KV and the
        inserting request has it, the tree's slot adopts the request's swa slot (the caller then frees only
        the request's duplicate full slot). Without this a request that recomputed a tombstoned prefix would
        be re-pointed at slots without sliding KV mid-prefill."""
        matched = super().insert(tokens, slots)
        if matched:
            tree = self._match(tokens[:matched]).indices
            mine = slots[:matched].to(torch.int64)
            f2s = self.allocator.full_to_swa
            adopt = (f2s[tree] == 0) & (f2s[mine] > 0) & (tree != mine)
            if bool(adopt.any()):
                f2s[tree[adopt]] = f2s[mine[adopt]]
                f2s[mine[adopt]] = 0
        return matched

    # ----------------------------------------------------------------------------------------- what to drop
    def release_out_of_window(self, row: int, kv_len: int, prefix_len: int, recent: int) -> None:
        """Drop the sliding KV of the `recent` own (not cached) positions that just left the window (all but
        the last `keep`, so that the finished sequence's end can be lent out)."""
        hi = kv_len - self.keep
        lo = max(self._aligned(prefix_len), hi - recent)
        _free_row_range(self.allocator, self.req_to_token_pool, row, lo, hi)

    def cache_finished(self, row: int, tokens: list[int], kv_len: int, prefix_len: int, last_node: Any) -> None:
        super().cache_finished(row, tokens, kv_len, prefix_len, last_node)
        self._trim(self.match_prefix_node(tokens[: self._aligned(kv_len)]))

    def cache_unfinished(self, row: int, tokens: list[int], prefix_len: int, last_node: Any
                         ) -> tuple[torch.Tensor, Any]:
        indices, node = super().cache_unfinished(row, tokens, prefix_len, last_node)
        self._trim(node)
        return indices, node

    def dec_lock_ref(self, node: TreeNode) -> None:
        super().dec_lock_ref(node)
        if node is not self.root_node and node.parent is not None and not self._is_end(node):
            self._trim(node)

    def match_prefix_node(self, tokens: list[int]) -> TreeNode:
        """The node ending exactly the cached `tokens` (the deepest one on their path), without splitting."""
        node, key = self.root_node, list(tokens)
        while key:
            child = node.children.get(self._child_key(key))
            if child is None or self._match_len(child.key, key) < len(child.key):
                break
            node, key = child, key[len(child.key):]
        return node

    def _is_end(self, node: TreeNode) -> bool:
        if node is self.root_node or len(node.children) != 1:
            return True
        return node.lock_ref > next(iter(node.children.values())).lock_ref  # a lock ends here

    def _trim(self, node: TreeNode) -> None:
        """Drop the sliding KV the end point at or below `node` (down its single-child chain) does not keep,
        in that end point and in the single-child nodes above it up to the previous end point."""
        while not self._is_end(node):
            node = next(iter(node.children.values()))
        if node is self.root_node:
            return
        end = 0
        x = node
        while x is not self.root_node:
            end += len(x.key)
            x = x.parent
        need_from = end - self.keep
        x, x_end = node, end
        while x is not self.root_node:
            x_start = x_end - len(x.key)
            if x_start < need_from:
                self.allocator.free_swa(x.value[: min(need_from, x_end) - x_start])
            x, x_end = x.parent, x_start
            if x is self.root_node or self._is_end(x):
                break

    def evict(self, num_tokens: int) -> int:
        """Evict until `available_size()` (the smaller of the two pools' free counts) grew by `num_tokens`:
        a leaf whose sliding KV was dropped frees full slots but few sliding ones."""
        target, freed = self.allocator.available_size() + num_tokens, 0
        while self.allocator.available_size() < target:
            got = super().evict(target - self.allocator.available_size())
            if not got:
                break
            freed += got
        return freed

    # ------------------------------------------------------------------------------------------ checking
    def check_integrity(self) -> None:
        """RadixCache's checks on the full slots, the swa map's own, and (idle) every swa slot in use
        belongs to a token the tree holds."""
        super().check_integrity()
        self.allocator.check()
        held = torch.zeros_like(self.allocator.full_to_swa, dtype=torch.bool)
        for node in self._nodes():
            held[node.value] = True
        stray = (self.allocator.full_to_swa > 0) & ~held
        if bool(stray.any()):
            raise AssertionError(f"swa leak: {int(stray.sum())} swa slots held by no cached token")
