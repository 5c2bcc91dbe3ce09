"""RadixCache / ChunkCache: matching, splitting, pages, locks, LRU eviction, the request flow against a real
ReqToTokenPool + allocator, and a randomized stress test checked against a dict reference model."""

from __future__ import annotations

import random

import pytest
import torch

from tokenloom.cache.allocator import PagedAllocator, TokenAllocator
from tokenloom.cache.chunk_cache import ChunkCache
from tokenloom.cache.radix_cache import RadixCache
from tokenloom.cache.req_to_token import ReqToTokenPool

CPU = torch.device("cpu")


def make(page_size: int = 1, size: int = 64, rows: int = 8, ctx: int = 256, cls=RadixCache):
    pool = ReqToTokenPool(rows, ctx, CPU)
    alloc = TokenAllocator(size, CPU) if page_size == 1 else PagedAllocator(size, page_size, CPU)
    return cls(pool, alloc, page_size)


def aligned(n: int, p: int) -> int:
    return n // p * p


def free_slots(alloc) -> list[int]:
    if isinstance(alloc, PagedAllocator):
        p = alloc.page_size
        return [pg * p + i for pg in alloc._free_pages.tolist() for i in range(p)]
    return alloc.free_slot_ids().tolist()


def all_slots(alloc) -> set[int]:
    if isinstance(alloc, PagedAllocator):
        p = alloc.page_size
        return set(range(p, (alloc.num_pages + 1) * p))
    return set(range(1, alloc.size + 1))


def tree_pages(cache: RadixCache) -> dict[tuple[int, ...], tuple[int, ...]]:
    """Every cached page-aligned prefix -> the slots of its last page, read from the tree structure."""
    p, out = cache.page_size, {}
    stack = [(cache.root_node, ())]
    while stack:
        node, prefix = stack.pop()
        for child in node.children.values():
            key, vals = prefix, child.value.tolist()
            for i in range(0, len(child.key), p):
                key = key + tuple(child.key[i:i + p])
                out[key] = tuple(vals[i:i + p])
            stack.append((child, key))
    return out


def tree_slots(cache) -> list[int]:
    return [s for v in tree_pages(cache).values() for s in v] if isinstance(cache, RadixCache) else []


class Sim:
    """A simulated request driving the cache the way the scheduler does."""

    def __init__(self, cache, tokens: list[int], on_evict=None) -> None:
        self.cache, self.tokens = cache, list(tokens)
        self.pool, self.alloc, self.p = cache.req_to_token_pool, cache.allocator, cache.page_size
        self.r2t = self.pool.req_to_token
        self.row = -1
        self.prefix_len = self.kv_len = 0
        self.last_node = None
        self.on_evict = on_evict or cache.evict

    def admit(self) -> None:
        m = self.cache.match_prefix(self.tokens[:-1])
        assert m.length % self.p == 0 and m.length < len(self.tokens)
        self.row = self.pool.alloc(1)[0]
        self.r2t[self.row, :m.length] = m.indices.to(torch.int32)
        self.cache.inc_lock_ref(m.last_node)
        self.prefix_len = self.kv_len = m.length
        self.last_node = m.last_node

    def extend(self, new_len: int) -> bool:
        """Allocate slots for positions kv_len..new_len-1 (evicting when short); False when out of memory."""
        last = int(self.r2t[self.row, self.kv_len - 1]) if self.kv_len else 0
        args = (torch.tensor([self.kv_len]), torch.tensor([new_len]), torch.tensor([last]))
        slots = self.alloc.alloc_extend(*args)
        if slots is None:
            self.on_evict(new_len - self.kv_len + self.p)
            slots = self.alloc.alloc_extend(*args)
            if slots is None:
                return False
        self.pool.write(torch.full((new_len - self.kv_len,), self.row), torch.arange(self.kv_len, new_len), slots)
        self.kv_len = new_len
        return True

    def prefill(self, new_len: int | None = None) -> None:
        assert self.extend(len(self.tokens) if new_len is None else new_len)

    def decode(self, token: int) -> bool:
        self.tokens.append(token)
        return self.extend(self.kv_len + 1)

    def chunk(self) -> torch.Tensor:
        before = self.r2t[self.row, : self.kv_len].long().clone()
        slots, node = self.cache.cache_unfinished(self.row, self.tokens[: self.kv_len], self.prefix_len,
                                                  self.last_node)
        assert torch.equal(slots, self.r2t[self.row, : self.kv_len].long()), "row not rewritten to returned slots"
        a = aligned(self.kv_len, self.p)
        assert torch.equal(slots[a:], before[a:]), "the unaligned tail must stay the request's own"
        self.prefix_len, self.last_node = int(slots.numel()), node
        return slots

    def finish(self) -> None:
        self.cache.cache_finished(self.row, self.tokens, self.kv_len, self.prefix_len, self.last_node)
        self.pool.free(self.row)

    def retract(self) -> None:
        self.cache.release_unfinished(self.row, self.kv_len, self.prefix_len, self.last_node)
        self.pool.free(self.row)

    def own_start(self) -> int:
        """Positions below this are the tree's; a ChunkCache request owns its whole row."""
        return aligned(self.prefix_len, self.p) if isinstance(self.cache, RadixCache) else 0

    def owned(self) -> list[int]:
        """Every slot of every page this request owns (positions own_start..kv_len-1)."""
        slots = self.r2t[self.row, self.own_start(): self.kv_len].tolist()
        return sorted({(s // self.p) * self.p + i for s in slots for i in range(self.p)})


def check_conservation(cache, running: list[Sim]) -> None:
    """free, tree and running requests' own slots are disjoint and cover the pool exactly; rows point at the
    tree for their locked prefix; protected_size counts exactly the locked prefixes."""
    if isinstance(cache, RadixCache):
        cache.check_tree()
    tree = tree_slots(cache)
    combined = free_slots(cache.allocator) + tree + [s for r in running for s in r.owned()]
    assert len(combined) == len(set(combined)), "a slot is in two places (double free or shared ownership)"
    assert set(combined) == all_slots(cache.allocator), "leaked slots"
    tree_set = set(tree)
    if isinstance(cache, RadixCache):
        p = cache.page_size
        locked = {tuple(r.tokens[:i + p]) for r in running for i in range(0, r.own_start(), p)}
        pages = tree_pages(cache)
        for r in running:
            row = r.r2t[r.row].tolist()
            for i in range(0, r.own_start(), p):
                assert pages[tuple(r.tokens[:i + p])] == tuple(row[i:i + p]), "row prefix differs from the tree"
        assert cache.protected_size() == p * len(locked)
        assert cache.evictable_size() + cache.protected_size() == len(tree_set)
    if not running:
        cache.check_integrity()


# ------------------------------------------------------------------------------------------ basic tree ops
def test_insert_match_and_split_page1():
    cache = make(1, size=32)
    a = list(range(1, 9))
    slots_a = cache.allocator.alloc(8)
    assert cache.insert(a, slots_a) == 0
    m = cache.match_prefix(a)
    assert torch.equal(m.indices, slots_a) and m.last_node.key == a
    assert cache.evictable_size() == 8 and cache.protected_size() == 0

    m = cache.match_prefix([1, 2, 3, 99, 98])  # ends inside the node: split after 3
    assert torch.equal(m.indices, slots_a[:3])
    assert m.last_node.key == [1, 2, 3] and m.last_node.parent is cache.root_node
    assert list(m.last_node.children) == [4] and m.last_node.children[4].key == [4, 5, 6, 7, 8]
    assert torch.equal(m.last_node.children[4].value, slots_a[3:])

    b = [1, 2, 3, 7, 7]
    slots_b = cache.allocator.alloc(5)
    assert cache.insert(b, slots_b) == 3
    cache.allocator.free(slots_b[:3])  # the caller frees its duplicates
    node = cache.root_node.children[1]
    assert sorted(node.children) == [4, 7]
    assert torch.equal(cache.match_prefix(b).indices, torch.cat((slots_a[:3], slots_b[3:])))
    assert torch.equal(cache.match_prefix(a + [50]).indices, slots_a)
    assert cache.evictable_size() == 10
    miss = cache.match_prefix([42, 1, 2])
    assert miss.length == 0 and miss.last_node is cache.root_node and miss.indices.dtype == torch.int64
    assert cache.match_prefix([]).length == 0
    cache.check_integrity()


def test_insert_existing_prefix_only_returns_full_length():
    cache = make(1, size=16)
    s = cache.allocator.alloc(6)
    assert cache.insert([1, 2, 3, 4, 5, 6], s) == 0
    dup = cache.allocator.alloc(4)
    assert cache.insert([1, 2, 3, 4], dup) == 4  # split, nothing new
    cache.allocator.free(dup)
    assert cache.root_node.children[1].key == [1, 2, 3, 4]
    assert cache.evictable_size() == 6
    cache.check_integrity()
    expect = s.clone()
    s.fill_(0)  # the tree keeps its own copy of the slots it was given
    assert torch.equal(cache.match_prefix([1, 2, 3, 4, 5, 6]).indices, expect)


def test_page_size_4_matches_whole_pages_only():
    cache = make(4, size=64)
    toks = list(range(100, 110))  # 10 tokens: two whole pages + a partial one
    slots = cache.allocator.alloc(10)
    assert cache.insert(toks, slots) == 0
    cache.allocator.free(slots[8:])  # the partial page is never cached
    assert cache.evictable_size() == 8
    assert torch.equal(cache.match_prefix(toks).indices, slots[:8])
    assert cache.match_prefix(toks[:7]).length == 4
    assert cache.match_prefix(toks[:3]).length == 0

    m = cache.match_prefix(toks[:6] + [0, 0, 0])  # diverges inside page 2: only page 1 shared, node split at 4
    assert m.length == 4 and torch.equal(m.indices, slots[:4])
    assert m.last_node.key == toks[:4] and list(m.last_node.children) == [tuple(toks[4:8])]
    assert list(cache.root_node.children) == [tuple(toks[:4])]

    other = toks[:5] + [1, 1, 1, 2, 2, 2, 2]  # shares 5 tokens: 1 page
    s2 = cache.allocator.alloc(12)
    assert cache.insert(other, s2) == 4
    cache.allocator.free(s2[:4])
    assert sorted(m.last_node.children) == sorted([tuple(toks[4:8]), tuple(other[4:8])])
    assert torch.equal(cache.match_prefix(other).indices, torch.cat((slots[:4], s2[4:])))
    assert cache.evictable_size() == 16
    cache.check_integrity()
    assert cache.evict(100) == 16
    assert cache.allocator.available_size() == cache.allocator.size
    cache.check_integrity()


def test_lock_refs_protect_and_account():
    cache = make(1, size=32)
    a, b = [1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8]
    cache.insert(a, cache.allocator.alloc(6))
    sb = cache.allocator.alloc(5)
    cache.insert(b, sb)
    cache.allocator.free(sb[:3])
    m = cache.match_prefix(a)
    cache.inc_lock_ref(m.last_node)
    assert cache.protected_size() == 6 and cache.evictable_size() == 2
    cache.inc_lock_ref(m.last_node)
    assert cache.protected_size() == 6
    cache.check_integrity()

    assert cache.evict(100) == 2  # only b's own leaf can go
    assert cache.match_prefix(a).length == 6 and cache.match_prefix(b).length == 3
    assert cache.evictable_size() == 0 and cache.evict(1) == 0
    cache.check_integrity()

    cache.dec_lock_ref(m.last_node)
    assert cache.protected_size() == 6
    cache.dec_lock_ref(m.last_node)
    assert cache.protected_size() == 0 and cache.evictable_size() == 6
    with pytest.raises(AssertionError):
        cache.dec_lock_ref(m.last_node)
    cache.inc_lock_ref(cache.root_node)  # locking the root is a no-op
    cache.dec_lock_ref(cache.root_node)
    assert cache.evict(1) == 3  # the leaf [4, 5, 6]; [1, 2, 3] is then a leaf but enough was freed
    assert cache.evictable_size() == 3
    cache.check_integrity()


def test_lock_survives_split_of_locked_node():
    cache = make(1, size=32)
    cache.insert(list(range(1, 9)), cache.allocator.alloc(8))
    m = cache.match_prefix(list(range(1, 9)))
    cache.inc_lock_ref(m.last_node)
    cache.match_prefix([1, 2, 3, 0])  # splits the locked node
    upper = cache.root_node.children[1]
    assert upper.key == [1, 2, 3] and upper.lock_ref == 1 and m.last_node.lock_ref == 1
    assert cache.protected_size() == 8
    cache.dec_lock_ref(m.last_node)
    assert upper.lock_ref == 0 and cache.evictable_size() == 8 and cache.protected_size() == 0
    cache.check_integrity()


def test_lru_eviction_order():
    cache = make(1, size=32)
    x, y, z = [1, 1], [2, 2], [3, 3]
    sx, sy, sz = (cache.allocator.alloc(2) for _ in range(3))
    for k, s in ((x, sx), (y, sy), (z, sz)):
        cache.insert(k, s)
    cache.match_prefix(x)  # x becomes the most recent
    free0 = cache.allocator.available_size()
    assert cache.evict(1) == 2
    assert cache.match_prefix(y).length == 0 and cache.match_prefix(x).length == 2
    assert cache.allocator.available_size() == free0 + 2 and set(sy.tolist()) <= set(free_slots(cache.allocator))
    cache.match_prefix(x)
    assert cache.evict(1) == 2 and cache.match_prefix(z).length == 0
    assert cache.evict(1) == 2 and cache.match_prefix(x).length == 0
    assert cache.evict(5) == 0
    assert cache.allocator.available_size() == cache.allocator.size
    cache.check_integrity()


def test_eviction_climbs_to_parents_that_become_leaves():
    cache = make(1, size=32)
    s1 = cache.allocator.alloc(3)
    cache.insert([5, 6, 7], s1)
    s2 = cache.allocator.alloc(3)
    cache.insert([5, 6, 8], s2)
    cache.allocator.free(s2[:2])
    assert cache.evict(1) == 1  # the older leaf [7]
    assert cache.match_prefix([5, 6, 7]).length == 2 and cache.match_prefix([5, 6, 8]).length == 3
    assert cache.evict(2) == 3  # leaf [8], then its parent [5, 6]
    assert not cache.root_node.children and cache.evictable_size() == 0
    assert cache.allocator.available_size() == cache.allocator.size
    assert cache.evict(0) == 0
    cache.check_integrity()


def test_reset_returns_slots():
    for p in (1, 4):
        cache = make(p, size=64)
        s = cache.allocator.alloc(20)
        cache.insert(list(range(20)), s)
        assert cache.total_size() == 20
        cache.reset()
        assert cache.total_size() == 0 and not cache.root_node.children
        assert cache.allocator.available_size() == cache.allocator.size
        cache.check_integrity()
        cache.allocator.clear()  # a full flush also clearing the allocator stays consistent
        cache.check_integrity()


def test_integrity_detects_leaks_and_bad_accounting():
    cache = make(1, size=16)
    cache.insert([1, 2, 3], cache.allocator.alloc(3))
    cache.allocator.alloc(1)  # slot taken by nobody
    with pytest.raises(AssertionError, match="KV leak"):
        cache.check_integrity()
    cache = make(1, size=16)
    cache.insert([1, 2, 3], cache.allocator.alloc(3))
    cache._evictable += 1
    with pytest.raises(AssertionError, match="evictable"):
        cache.check_tree()


# ---------------------------------------------------------------------------------------- request flows
@pytest.mark.parametrize("p", [1, 4])
def test_request_flow(p):
    cache = make(p, size=128)
    a = Sim(cache, list(range(1, 11)))  # 10-token prompt
    a.admit()
    assert a.prefix_len == 0
    a.prefill()
    check_conservation(cache, [a])
    for t in (11, 12, 13):
        assert a.decode(t)
    a.finish()
    check_conservation(cache, [])
    assert cache.evictable_size() == aligned(13, p)

    b = Sim(cache, list(range(1, 8)) + [50, 51, 52, 53, 54, 55])  # shares 7 prompt tokens
    b.admit()
    assert b.prefix_len == aligned(7, p)
    assert cache.protected_size() == aligned(7, p)
    b.prefill(9)
    check_conservation(cache, [b])
    slots = b.chunk()
    assert b.prefix_len == 9 and slots.numel() == 9
    assert cache.match_prefix(b.tokens[:9]).length == aligned(9, p)
    check_conservation(cache, [b])
    b.prefill()
    b.finish()
    check_conservation(cache, [])

    c = Sim(cache, a.tokens)  # retracted after computing more
    c.admit()
    assert c.prefix_len == aligned(12, p)
    c.prefill()
    assert c.decode(77)
    check_conservation(cache, [c])
    c.retract()
    check_conservation(cache, [])
    assert cache.match_prefix(a.tokens + [77, 0]).length == aligned(13, p)  # retraction cached nothing


@pytest.mark.parametrize("p", [1, 4])
def test_concurrent_duplicates_are_freed(p):
    cache = make(p, size=128)
    prompt = [9, 8, 7, 6, 5, 4, 3, 2, 1, 9, 8, 7, 6, 5]
    d, e = Sim(cache, prompt), Sim(cache, prompt)
    d.admit()
    e.admit()  # neither sees the other's KV yet
    d.prefill(10)
    e.prefill(10)
    d.chunk()
    free_before = cache.allocator.available_size()
    e.chunk()  # e's first aligned(10) slots are duplicates: freed, row rewritten to d's (= the tree's)
    assert cache.allocator.available_size() == free_before + aligned(10, p)
    a10 = aligned(10, p)
    assert torch.equal(e.r2t[e.row, :a10], d.r2t[d.row, :a10])
    check_conservation(cache, [d, e])
    d.prefill()
    e.prefill()
    d.finish()
    check_conservation(cache, [e])
    e.finish()
    check_conservation(cache, [])
    assert cache.evictable_size() == aligned(14, p)


def test_unaligned_chunk_boundary_then_other_request_fills_the_page():
    """p=4: a chunk ends at 6 (own partial page holds positions 4,5); meanwhile another request caches the
    same 8 tokens. The next chunk must free the whole partial page and point positions 4.. at the tree."""
    p = 4
    cache = make(p, size=128)
    toks = list(range(30, 46))
    e = Sim(cache, toks)
    e.admit()
    e.prefill(6)
    e.chunk()
    assert e.prefix_len == 6
    f = Sim(cache, toks[:9])
    f.admit()
    assert f.prefix_len == 4
    f.prefill()
    f.finish()  # caches toks[:8]
    check_conservation(cache, [e])
    e.prefill(12)
    e.chunk()
    assert torch.equal(e.r2t[e.row, :8], cache.match_prefix(toks[:8]).indices.to(torch.int32))
    check_conservation(cache, [e])
    e.retract()  # also covers prefix_len unaligned (12 is aligned here; 14 is not below)
    check_conservation(cache, [])

    g = Sim(cache, toks)
    g.admit()
    g.prefill(14)
    g.chunk()
    assert g.prefix_len == 14
    g.retract()  # kv_len == prefix_len: the own partial page (positions 12, 13) must still be freed
    check_conservation(cache, [])


# ------------------------------------------------------------------------------------------- ChunkCache
@pytest.mark.parametrize("p", [1, 4])
def test_chunk_cache(p):
    cache = make(p, size=64, cls=ChunkCache)
    a = Sim(cache, list(range(1, 12)))
    a.admit()
    assert a.prefix_len == 0
    m = cache.match_prefix(list(range(1, 12)))
    assert m.length == 0 and m.indices.dtype == torch.int64
    a.prefill(6)
    slots = a.chunk()
    assert torch.equal(slots, a.r2t[a.row, :6].long()) and a.prefix_len == 6
    a.prefill()
    assert a.decode(3)
    assert cache.evictable_size() == 0 and cache.protected_size() == 0 and cache.evict(100) == 0
    check_conservation(cache, [a])
    a.finish()
    check_conservation(cache, [])
    b = Sim(cache, list(range(1, 12)))
    b.admit()
    assert b.prefix_len == 0
    b.prefill(7)
    b.chunk()
    b.prefill()
    b.retract()
    check_conservation(cache, [])
    cache.reset()
    cache.check_integrity()


# ------------------------------------------------------------------------------------------ stress test
class Harness:
    """Drives random request traffic; `ref` mirrors the tree as {page-aligned prefix: slots of its last page}."""

    def __init__(self, p: int, seed: int) -> None:
        self.rng = random.Random(seed)
        self.p = p
        self.cache = make(p, size=96, rows=6, ctx=128)
        self.ref: dict[tuple[int, ...], tuple[int, ...]] = {}
        self.running: list[Sim] = []
        self.waiting: list[list[int]] = []
        self.bank = [[self.rng.randrange(4) for _ in range(self.rng.randint(3, 24))] for _ in range(5)]

    def evict(self, n: int) -> int:
        before_free = set(free_slots(self.cache.allocator))
        freed = self.cache.evict(n)
        evictable = sum(self.p for k in self.ref) - self.cache.protected_size()
        assert freed >= min(n, evictable) if n > 0 else freed == 0
        new = tree_pages(self.cache)
        assert all(self.ref.get(k) == v for k, v in new.items()), "eviction changed cached slots"
        dropped = self.ref.keys() - new.keys()
        assert len(dropped) * self.p == freed
        for r in self.running:
            for i in range(0, r.own_start(), self.p):
                assert tuple(r.tokens[:i + self.p]) not in dropped, "a locked prefix was evicted"
        now_free = set(free_slots(self.cache.allocator)) - before_free
        assert now_free == {s for k in dropped for s in self.ref[k]}
        self.ref = new
        return freed

    def record_insert(self, r: Sim, n: int) -> None:
        """Before r inserts tokens[:n]: pages the model lacks will get r's current slots."""
        row = r.r2t[r.row, :n].tolist()
        for i in range(0, aligned(n, self.p), self.p):
            key = tuple(r.tokens[:i + self.p])
            if key not in self.ref:
                self.ref[key] = tuple(row[i:i + self.p])

    def expected_match(self, q: list[int]) -> list[int]:
        out: list[int] = []
        for i in range(0, aligned(len(q), self.p), self.p):
            page = self.ref.get(tuple(q[:i + self.p]))
            if page is None:
                break
            out.extend(page)
        return out

    def new_prompt(self) -> list[int]:
        base = self.rng.choice(self.bank)
        return base[: self.rng.randint(0, len(base))] + [self.rng.randrange(6) for _ in range(self.rng.randint(1, 20))]

    def admit(self, tokens: list[int]) -> None:
        r = Sim(self.cache, tokens, on_evict=self.evict)
        assert self.cache.match_prefix(tokens[:-1]).indices.tolist() == self.expected_match(tokens[:-1])
        r.admit()
        self.running.append(r)
        if not r.extend(min(len(tokens), r.kv_len + self.rng.randint(1, 16))):
            self.retract(r)

    def retract(self, r: Sim) -> None:
        r.retract()
        self.running.remove(r)
        self.waiting.append(r.tokens)

    def step(self, r: Sim) -> None:
        roll = self.rng.random()
        if roll < 0.08:
            self.retract(r)
        elif roll < 0.25 and r.kv_len > r.prefix_len:
            self.record_insert(r, r.kv_len)
            r.finish()
            self.running.remove(r)
        elif r.kv_len < len(r.tokens) or roll < 0.35:
            if r.kv_len < len(r.tokens) and not r.extend(min(len(r.tokens), r.kv_len + self.rng.randint(1, 16))):
                self.retract(r)
                return
            self.record_insert(r, r.kv_len)
            r.chunk()
        elif len(r.tokens) >= 100 or not r.decode(self.rng.randrange(6)):
            self.retract(r)

    def run(self, steps: int) -> None:
        for _ in range(steps):
            roll = self.rng.random()
            if roll < 0.3 and self.cache.req_to_token_pool.available_size():
                self.admit(self.waiting.pop(0) if self.waiting and roll < 0.1 else self.new_prompt())
            elif roll < 0.38:
                self.evict(self.rng.randint(0, 40))
            elif roll < 0.385 and not self.running:
                self.cache.reset()
                self.ref = {}
            elif self.running:
                self.step(self.rng.choice(self.running))
            assert tree_pages(self.cache) == self.ref, "tree differs from the reference model"
            check_conservation(self.cache, self.running)
            if self.ref and self.rng.random() < 0.3:
                key = list(self.rng.choice(list(self.ref)))
                q = key + [self.rng.randrange(6) for _ in range(self.rng.randint(0, 9))]
                assert self.cache.match_prefix(q).indices.tolist() == self.expected_match(q)
        for r in list(self.running):
            self.record_insert(r, r.kv_len)
            r.finish()
            self.running.remove(r)
        check_conservation(self.cache, [])
        self.evict(10**6)
        assert not self.ref and self.cache.allocator.available_size() == self.cache.allocator.size


@pytest.mark.parametrize("p,seed", [(1, 0), (1, 1), (4, 2), (4, 3), (2, 4)])
def test_randomized_stress(p, seed):
    Harness(p, seed).run(700)
