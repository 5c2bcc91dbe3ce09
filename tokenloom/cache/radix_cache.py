"""`RadixCache`: a page-aligned radix tree over token ids whose nodes own KV slots (SGLang's RadixCache).

Tree invariants (verified by `check_integrity`):
- The root has an empty key, is never evicted and is not counted in any size. Every other node has a non-empty
  key whose length is a multiple of `page_size`, and `value` (int64 KV slots) of the same length.
- `children` is keyed by the child's first token (page size 1) or the tuple of its first page's tokens; two
  children never share that key, so a token sequence has at most one path.
- With page size p > 1, each page of a node's key is stored in one whole allocator page, in order
  (`value[i*p:(i+1)*p] == page * p + arange(p)`), so evicting a node frees exactly the pages it owns.
- `lock_ref` of a node = number of locks (`inc_lock_ref`) on it or on any node below it; a locked node's
  ancestors are locked. Locked nodes are never evicted.
- `evictable_size()` = tokens in nodes with lock_ref 0, `protected_size()` = tokens in nodes with lock_ref > 0.
- Every slot the tree holds is in use by the tree alone: requests own only the slots of their row beyond
  the tree part (positions >= prefix_len rounded down to a page), so that, when idle,
  `allocator.available_size() + evictable_size() + protected_size() == allocator.size`.

`prefix_len` passed back to `cache_*`/`release_unfinished` may be unaligned (it is what `cache_unfinished`
returned: tree prefix + the request's own partial page); the cache treats positions
`[prefix_len // page_size * page_size, ...)` as owned by the request.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Any

import torch

from tokenloom.cache.prefix_cache import MatchResult, PrefixCache
from tokenloom.cache.req_to_token import ReqToTokenPool

_ids = itertools.count()


class TreeNode:
    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access_time", "id")

    def __init__(self, key: list[int], value: torch.Tensor, parent: TreeNode | None, access_time: int) -> None:
        self.children: dict[Any, TreeNode] = {}
        self.parent = parent
        self.key = key
        self.value = value
        self.lock_ref = 0
        self.last_access_time = access_time
        self.id = next(_ids)

    def __len__(self) -> int:
        return len(self.key)

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, len={len(self.key)}, lock_ref={self.lock_ref}, children={len(self.children)})"


class RadixCache(PrefixCache):
    def __init__(self, req_to_token_pool: ReqToTokenPool, allocator: Any, page_size: int) -> None:
        assert page_size >= 1
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.page_size = page_size
        self.device = allocator.device
        self._clock = 0
        self._new_tree()

    # ----------------------------------------------------------------------------------------------- helpers
    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _empty(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64, device=self.device)

    def _child_key(self, key: list[int]) -> Any:
        return key[0] if self.page_size == 1 else tuple(key[: self.page_size])

    def _match_len(self, a: list[int], b: list[int]) -> int:
        """Length of the common prefix of `a` and `b`, in whole pages."""
        n, i, p = min(len(a), len(b)), 0, self.page_size
        if p == 1:
            while i < n and a[i] == b[i]:
                i += 1
        else:
            while i + p <= n and a[i:i + p] == b[i:i + p]:
                i += p
        return i

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Split `child` after its first `n` tokens (0 < n < len, page multiple); return the new upper node.

        The upper node inherits lock_ref and access time, so sizes and locks held on `child` stay valid."""
        parent = child.parent
        assert parent is not None and 0 < n < len(child.key) and n % self.page_size == 0
        upper = TreeNode(child.key[:n], child.value[:n], parent, child.last_access_time)
        upper.lock_ref = child.lock_ref
        child.key, child.value, child.parent = child.key[n:], child.value[n:], upper
        upper.children[self._child_key(child.key)] = child
        parent.children[self._child_key(upper.key)] = upper
        return upper

    def _aligned(self, n: int) -> int:
        return n // self.page_size * self.page_size

    # ---------------------------------------------------------------------------------------------- lookups
    def match_prefix(self, tokens: list[int]) -> MatchResult:
        """Longest cached page-aligned prefix of `tokens`: its slots and the node ending it (root if none).

        Splits a node when the match ends inside it and refreshes the access time of every node on the path."""
        return self._match(tokens)

    def _match(self, tokens: list[int]) -> MatchResult:
        """`match_prefix` as the tree holds it (a subclass may restrict what it lends out, not this)."""
        key = list(tokens[: self._aligned(len(tokens))])
        now = self._tick()
        node = self.root_node
        node.last_access_time = now
        values: list[torch.Tensor] = []
        while key:
            child = node.children.get(self._child_key(key))
            if child is None:
                break
            child.last_access_time = now
            n = self._match_len(child.key, key)
            if n < len(child.key):
                node = self._split(child, n)
                values.append(node.value)
                break
            values.append(child.value)
            node, key = child, key[n:]
        return MatchResult(torch.cat(values) if values else self._empty(), node)

    def insert(self, tokens: list[int], slots: torch.Tensor) -> int:
        """Insert the page-aligned part of `tokens` with KV `slots` (same length; anything past the last whole
        page is ignored). Returns how many leading tokens were already cached: the tree keeps its own slots
        for them and the caller must free its duplicates in that range. New tokens get a copy of `slots`."""
        assert len(slots) >= len(tokens), "insert: fewer slots than tokens"
        n_total = self._aligned(len(tokens))
        key = list(tokens[:n_total])
        now = self._tick()
        node = self.root_node
        node.last_access_time = now
        matched = 0
        while key:
            child = node.children.get(self._child_key(key))
            if child is None:
                break
            child.last_access_time = now
            n = self._match_len(child.key, key)
            if n < len(child.key):
                child = self._split(child, n)
            matched += n
            node, key = child, key[n:]
        if key:
            value = slots[matched:n_total].to(device=self.device, dtype=torch.int64, copy=True)
            leaf = TreeNode(key, value, node, now)
            node.children[self._child_key(key)] = leaf
            self._evictable += len(key)
        return matched

    # ------------------------------------------------------------------------------------------------ locks
    def inc_lock_ref(self, node: TreeNode) -> None:
        while node is not self.root_node:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        while node is not self.root_node:
            assert node.lock_ref > 0, f"dec_lock_ref on unlocked {node}"
            if node.lock_ref == 1:
                self._evictable += len(node.key)
                self._protected -= len(node.key)
            node.lock_ref -= 1
            node = node.parent

    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    # --------------------------------------------------------------------------------------- request flow
    def cache_finished(self, row: int, tokens: list[int], kv_len: int, prefix_len: int, last_node: Any) -> None:
        assert len(tokens) >= kv_len >= prefix_len, (len(tokens), kv_len, prefix_len)
        kv = self.req_to_token_pool.req_to_token[row, :kv_len].to(torch.int64)
        aligned, own_start = self._aligned(kv_len), self._aligned(prefix_len)
        in_tree = self.insert(tokens[:aligned], kv[:aligned])
        assert in_tree >= own_start, "the locked prefix is not in the tree (tokens changed?)"
        if in_tree > own_start:  # the request's own slots for tokens the tree already had
            self.allocator.free(kv[own_start:in_tree])
        if kv_len > aligned:  # the unaligned tail: a page only this request owns
            self.allocator.free(kv[aligned:kv_len])
        self.dec_lock_ref(last_node)

    def cache_unfinished(self, row: int, tokens: list[int], prefix_len: int, last_node: Any
                         ) -> tuple[torch.Tensor, Any]:
        n = len(tokens)
        assert n >= prefix_len, (n, prefix_len)
        r2t = self.req_to_token_pool.req_to_token
        kv = r2t[row, :n].to(torch.int64)
        aligned, own_start = self._aligned(n), self._aligned(prefix_len)
        in_tree = self.insert(tokens[:aligned], kv[:aligned])
        assert in_tree >= own_start, "the locked prefix is not in the tree (tokens changed?)"
        if in_tree > own_start:
            self.allocator.free(kv[own_start:in_tree])
        match = self._match(tokens[:aligned])
        assert match.length == aligned, (match.length, aligned)
        r2t[row, own_start:aligned] = match.indices[own_start:aligned].to(r2t.dtype)
        self.inc_lock_ref(match.last_node)
        self.dec_lock_ref(last_node)
        return torch.cat((match.indices, kv[aligned:n])), match.last_node

    def release_unfinished(self, row: int, kv_len: int, prefix_len: int, last_node: Any) -> None:
        own_start = self._aligned(prefix_len)
        if kv_len > own_start:
            self.allocator.free(self.req_to_token_pool.req_to_token[row, own_start:kv_len].to(torch.int64))
        self.dec_lock_ref(last_node)

    # ------------------------------------------------------------------------------------------- eviction
    def _nodes(self) -> list[TreeNode]:
        """Every non-root node (iterative DFS)."""
        out: list[TreeNode] = []
        stack = list(self.root_node.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def evict(self, num_tokens: int) -> int:
        """Evict least recently used unlocked leaves (a parent left childless and unlocked becomes a candidate)
        until at least `num_tokens` slots are freed or nothing is evictable. Returns the number freed."""
        if num_tokens <= 0 or self._evictable == 0:
            return 0
        heap = [(n.last_access_time, n.id, n) for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            self.allocator.free(node.value)
            freed += len(node.key)
            self._evictable -= len(node.key)
            parent = node.parent
            del parent.children[self._child_key(node.key)]
            node.parent = None
            if parent is not self.root_node and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access_time, parent.id, parent))
        return freed

    def reset(self) -> None:
        """Drop the whole tree, returning its slots to the allocator. Requires that nothing is locked.
        (Clearing the allocator afterwards as well, as a full flush does, is harmless.)"""
        assert self._protected == 0, "reset while requests hold locks"
        nodes = self._nodes()
        if nodes:
            self.allocator.free(torch.cat([n.value for n in nodes]))
        self._new_tree()

    def _new_tree(self) -> None:
        self.root_node = TreeNode([], self._empty(), None, self._tick())
        self.root_node.lock_ref = 1  # never evicted, never counted
        self._evictable = 0
        self._protected = 0

    # ------------------------------------------------------------------------------------------ checking
    def total_size(self) -> int:
        return self._evictable + self._protected

    def check_integrity(self) -> None:
        """`check_tree()`, then the pool accounting free + evictable + protected == size (holds when idle)."""
        self.check_tree()
        super().check_integrity()

    def check_tree(self) -> None:
        """Verify the tree invariants listed in the module docstring (valid at any time, also mid-flight)."""
        p, evictable, protected = self.page_size, 0, 0
        slots: list[torch.Tensor] = []
        stack = [self.root_node]
        while stack:
            node = stack.pop()
            child_locks = 0
            for ck, child in node.children.items():
                assert child.parent is node, f"{child} has a wrong parent"
                assert ck == self._child_key(child.key), f"{child} is under a wrong child key"
                assert len(child.key) > 0 and len(child.key) % p == 0, f"{child} key is not page-aligned"
                assert child.value.numel() == len(child.key), f"{child} key/value lengths differ"
                assert child.lock_ref >= 0
                child_locks += child.lock_ref
                if child.lock_ref:
                    protected += len(child.key)
                else:
                    evictable += len(child.key)
                slots.append(child.value)
                stack.append(child)
            if node is not self.root_node:
                assert node.lock_ref >= child_locks, f"{node} lock_ref below its children's"
        assert evictable == self._evictable, f"evictable_size {self._evictable} != {evictable} in the tree"
        assert protected == self._protected, f"protected_size {self._protected} != {protected} in the tree"
        if slots:
            allv = torch.cat(slots)
            assert int(allv.min()) >= 1, "the tree holds the dummy slot 0"
            assert torch.unique(allv).numel() == allv.numel(), "a KV slot is held twice by the tree"
            if p > 1:
                pages = allv.view(-1, p)
                expect = pages[:, :1] // p * p + torch.arange(p, device=allv.device)
                assert torch.equal(pages, expect), "a tree page does not map to one whole allocator page"
