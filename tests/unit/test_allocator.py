"""KV slot allocators and the req-to-token pool, against simple per-request reference bookkeeping."""

from __future__ import annotations

import random

import pytest
import torch

from tokenloom.cache.allocator import PagedAllocator, TokenAllocator
from tokenloom.cache.req_to_token import ReqToTokenPool

CPU = torch.device("cpu")



def t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


# ----------------------------------------------------------------------------------- TokenAllocator

def test_token_allocator_initial_state():
    a = TokenAllocator(10, CPU)
    assert a.page_size == 1 and a.available_size() == 10
    slots = a.alloc(10)
    assert sorted(slots.tolist()) == list(range(1, 11))  # slot 0 is the dummy, never handed out
    assert a.available_size() == 0
    assert a.alloc(1) is None
    a.clear()
    assert a.available_size() == 10


def test_token_allocator_random_accounting():
    rng = random.Random(0)
    size = 200
    a = TokenAllocator(size, CPU)
    owned: list[list[int]] = []
    used: set[int] = set()
    for _ in range(500):
        if owned and rng.random() < 0.45:
            chunk = owned.pop(rng.randrange(len(owned)))
            a.free(t(chunk))
            used -= set(chunk)
        else:
            n = rng.randint(0, 40)
            before = a.available_size()
            got = a.alloc(n)
            if n > before:
                assert got is None
                assert a.available_size() == before  # took nothing
                continue
            assert got is not None and got.dtype == torch.int64 and got.numel() == n
            ids = got.tolist()
            assert len(set(ids)) == n and not set(ids) & used
            assert all(1 <= s <= size for s in ids)
            used |= set(ids)
            owned.append(ids)
        assert a.available_size() + len(used) == size
    a.free(t([]))  # freeing nothing is fine
    assert a.available_size() + len(used) == size


def test_token_allocator_extend_and_decode_sizes():
    a = TokenAllocator(50, CPU)
    got = a.alloc_extend(t([0, 3, 7]), t([4, 3, 12]), t([0, 5, 9]))
    assert got.numel() == 4 + 0 + 5 and a.available_size() == 41
    got2 = a.alloc_decode(t([5, 4, 13]), t([1, 2, 3]))
    assert got2.numel() == 3 and not set(got2.tolist()) & set(got.tolist())
    assert a.alloc_extend(t([0]), t([39]), t([0])) is None
    assert a.available_size() == 38


# ----------------------------------------------------------------------------------- PagedAllocator

def test_paged_allocator_size_and_alloc():
    a = PagedAllocator(100, 16, CPU)
    assert a.num_pages == 6 and a.size == 96 and a.available_size() == 96
    s = a.alloc(20)  # two pages
    assert s.numel() == 20 and a.available_size() == 64
    pages = [x // 16 for x in s.tolist()]
    assert all(1 <= p <= 6 for p in pages)
    assert pages[:16] == [pages[0]] * 16 and pages[16:] == [pages[16]] * 4 and pages[0] != pages[16]
    assert [x % 16 for x in s.tolist()] == [i % 16 for i in range(20)]
    assert a.alloc(16 * 4 + 1) is None and a.available_size() == 64
    a.free(s)
    assert a.available_size() == 96
    everything = a.alloc(96)
    assert sorted({x // 16 for x in everything.tolist()}) == [1, 2, 3, 4, 5, 6]
    assert 0 not in everything.tolist() and min(everything.tolist()) >= 16


class PagedReference:
    """Per-request slots by position; checks every allocation against the paging rules."""

    def __init__(self, alloc, page_size: int, num_pages: int) -> None:
        self.alloc, self.p, self.num_pages = alloc, page_size, num_pages
        self.slots: dict[int, list[int]] = {}
        self.pages: dict[int, set[int]] = {}

    def used_pages(self) -> set[int]:
        return set().union(*self.pages.values()) if self.pages else set()

    def step(self, reqs: list[int], new_lens: list[int], decode: bool) -> bool:
        p = self.p
        prefix = [len(self.slots[r]) for r in reqs]
        seq = [a + b for a, b in zip(prefix, new_lens, strict=True)]
        last = [self.slots[r][-1] if self.slots[r] else 0 for r in reqs]
        need = sum(-(-s // p) - (-(-a // p)) for a, s in zip(prefix, seq, strict=True))
        before = self.alloc.available_size()
        in_use = self.used_pages()
        if decode:
            got = self.alloc.alloc_decode(t(seq), t(last))
        else:
            got = self.alloc.alloc_extend(t(prefix), t(seq), t(last))
        if need * p > before:
            assert got is None
            assert self.alloc.available_size() == before  # took nothing
            return False
        assert got is not None and got.dtype == torch.int64 and got.numel() == sum(new_lens)
        assert self.alloc.available_size() == before - need * p
        flat = got.tolist()
        fresh: set[int] = set()
        off = 0
        for r, a, n in zip(reqs, prefix, new_lens, strict=True):
            mine = flat[off:off + n]
            off += n
            for i, slot in enumerate(mine):
                pos = a + i
                page = slot // p
                assert slot % p == pos % p, (pos, slot)
                assert 1 <= page <= self.num_pages
                if pos % p and pos - 1 < a:  # continues the request's partial last page
                    assert page == self.slots[r][-1] // p
                elif pos % p:  # same page as the previous position
                    assert page == mine[i - 1] // p
                else:  # page boundary: a page no one holds
                    assert page not in in_use and page not in fresh
                    fresh.add(page)
                    self.pages[r].add(page)
            self.slots[r].extend(mine)
        assert len(fresh) == need
        assert len(set(flat)) == len(flat)
        return True

    def finish(self, r: int) -> None:
        self.alloc.free(t(self.slots.pop(r)))
        self.pages.pop(r)

    def check_accounting(self) -> None:
        used = self.used_pages()
        assert self.alloc.available_size() + len(used) * self.p == self.num_pages * self.p
        total = [s for v in self.slots.values() for s in v]
        assert len(set(total)) == len(total)


@pytest.mark.parametrize("kind, page_size", [("token", 1), ("paged", 1), ("paged", 2), ("paged", 4),
                                             ("paged", 16)])
@pytest.mark.parametrize("seed", range(3))
def test_paged_extend_decode_randomized(kind, page_size, seed):
    rng = random.Random(seed * 100 + page_size)
    num_pages = max(240 // page_size, 10)
    alloc = TokenAllocator(num_pages, CPU) if kind == "token" else \
        PagedAllocator(num_pages * page_size + rng.randrange(page_size), page_size, CPU)
    ref = PagedReference(alloc, page_size, num_pages)
    next_id = 0
    failures = successes = 0
    for _ in range(250):
        # Start a few requests, sometimes with no tokens yet.
        for _ in range(rng.randint(0, 2)):
            ref.slots[next_id], ref.pages[next_id] = [], set()
            next_id += 1
        live = list(ref.slots)
        ok = True
        if live:
            reqs = rng.sample(live, rng.randint(1, min(len(live), 6)))
            decode = all(ref.slots[r] for r in reqs) and rng.random() < 0.5
            new_lens = [1] * len(reqs) if decode else [rng.choice([0, 1, 2, 3, page_size, 2 * page_size + 1,
                                                                   rng.randint(1, 40)]) for _ in reqs]
            ok = ref.step(reqs, new_lens, decode)
            failures += not ok
            successes += ok
        for r in list(ref.slots):
            if rng.random() < (0.05 if ok else 0.4):
                ref.finish(r)
        ref.check_accounting()
    for r in list(ref.slots):
        ref.finish(r)
    assert alloc.available_size() == num_pages * page_size
    assert failures > 5 and successes > 150  # the pool ran out now and then, most steps succeeded


def test_paged_extend_partial_page_example():
    p = 4
    a = PagedAllocator(40, p, CPU)  # pages 1..10
    first = a.alloc_extend(t([0]), t([6]), t([0]))  # two pages, second half-used
    assert first.tolist()[:4] == [4, 5, 6, 7] and first.tolist()[4:] == [8, 9]
    # Continue at position 6 (slot 9 holds position 5): positions 6, 7 go to page 2, 8..9 to a new page.
    more = a.alloc_extend(t([6]), t([10]), t([9]))
    assert more.tolist() == [10, 11, 12, 13]
    dec = a.alloc_decode(t([11]), t([13]))  # position 10 -> page 3 offset 2
    assert dec.tolist() == [14]
    dec = a.alloc_decode(t([13]), t([15]))  # position 12 -> fresh page 4
    assert dec.tolist() == [16]
    assert a.available_size() == 40 - 4 * p


def test_paged_batch_is_all_or_nothing():
    p = 4
    a = PagedAllocator(5 * p, p, CPU)
    assert a.alloc_extend(t([0, 0]), t([8, 13]), t([0, 0])) is None  # needs 2 + 4 pages
    assert a.available_size() == 5 * p
    got = a.alloc_extend(t([0, 0, 3]), t([8, 9, 3]), t([0, 0, 7]))  # 2 + 3 + 0 pages
    assert got.numel() == 17 and a.available_size() == 0


# ----------------------------------------------------------------------------------- ReqToTokenPool

def test_req_to_token_pool_alloc_free():
    rng = random.Random(1)
    pool = ReqToTokenPool(16, 32, CPU)
    assert pool.req_to_token.shape == (16, 32) and pool.req_to_token.dtype == torch.int32
    held: set[int] = set()
    for _ in range(300):
        if held and rng.random() < 0.5:
            rows = rng.sample(sorted(held), rng.randint(1, len(held)))
            pool.free(rows[0] if len(rows) == 1 and rng.random() < 0.5 else rows)
            held -= set(rows)
        else:
            n = rng.randint(0, 6)
            before = pool.available_size()
            rows = pool.alloc(n)
            if n > before:
                assert rows is None and pool.available_size() == before
            else:
                assert len(rows) == n and len(set(rows)) == n and not set(rows) & held
                assert all(0 <= r < 16 for r in rows)
                held |= set(rows)
        assert pool.available_size() + len(held) == 16
    pool.clear()
    assert pool.available_size() == 16 and sorted(pool.alloc(16)) == list(range(16))


def test_req_to_token_pool_write():
    g = torch.Generator().manual_seed(0)
    pool = ReqToTokenPool(6, 20, CPU)
    expected = [[0] * 20 for _ in range(6)]
    for _ in range(5):
        n = 15
        rows = torch.randint(0, 6, (n,), generator=g)
        # unique (row, position) pairs so the write order does not matter
        cells = sorted({(int(r), int(c)) for r, c in zip(rows, torch.randint(0, 20, (n,), generator=g),
                                                         strict=True)})
        slots = torch.randint(0, 10**6, (len(cells),), generator=g)
        pool.write(t([c[0] for c in cells]).int(), t([c[1] for c in cells]).int(), slots)
        for (r, c), s in zip(cells, slots.tolist(), strict=True):
            expected[r][c] = s
        assert pool.req_to_token.tolist() == expected


# ----------------------------------------------------------------------------------- decode runs

def test_token_allocator_decode_runs_are_contiguous():
    """Requests decoding side by side each get contiguous slots (runs of DECODE_RUN), not interleaved ones."""
    a = TokenAllocator(400, CPU, decode_run=8)
    prompt = a.alloc(3)  # each request's prompt ends at one slot
    last = prompt
    per_req: list[list[int]] = [[], [], []]
    lens = t([1, 1, 1])
    for _ in range(20):
        lens = lens + 1
        got = a.alloc_decode(lens, last)
        for i, s in enumerate(got.tolist()):
            per_req[i].append(s)
        last = got
        assert a.available_size() + 3 + sum(map(len, per_req)) == 400
    for slots in per_req:
        breaks = sum(b != a_ + 1 for a_, b in zip(slots, slots[1:], strict=False))
        assert breaks <= 20 // 8  # a new run every 8 tokens at most
    a.free(t([s for r in per_req for s in r] + prompt.tolist()))  # releases the reservations after them
    assert a.available_size() == 400 and a._num_reserved == 0
    assert sorted(a.free_slot_ids().tolist()) == list(range(1, 401))


def test_token_allocator_reservations_are_taken_back_when_short():
    a = TokenAllocator(40, CPU, decode_run=16)
    first = a.alloc(2)
    a.alloc_decode(t([2, 2]), first)  # two runs of 16: 30 slots reserved or used
    assert a.available_size() == 36
    big = a.alloc(36)  # needs the reserved slots
    assert big is not None and a.available_size() == 0 and a._num_reserved == 0
    assert len(set(big.tolist()) | set(first.tolist())) == 38


def test_token_allocator_shared_last_slot_takes_its_successor_once():
    """Two requests whose rows end at the same (cached) slot must not both take its reserved successor."""
    a = TokenAllocator(100, CPU, decode_run=4)
    start = a.alloc(1)
    run_first = a.alloc_decode(t([2]), start)  # slot r, with r+1.. reserved
    got = a.alloc_decode(t([3, 3]), torch.cat([run_first, run_first]))
    assert got[0] == run_first[0] + 1 and got[1] != got[0]


@pytest.mark.parametrize("seed", range(6))
def test_token_allocator_few_request_decode_path_matches_the_tensor_path(seed, monkeypatch):
    """Decode steps of up to FEW_DECODE_REQUESTS requests allocate with Python ints; the same sequence of steps
    on a twin allocator forced onto the tensor path hands out the same slots and ends in the same state
    (reserved successors, shared last slots, misses that take fresh runs, slot 0 and the pool's end)."""
    from tokenloom.cache import allocator as allocator_module

    rng = random.Random(seed)
    few, tensor = TokenAllocator(120, CPU, decode_run=5), TokenAllocator(120, CPU, decode_run=5)
    assert few._reserved_flags is not None
    prompt = few.alloc(4)
    assert torch.equal(prompt, tensor.alloc(4))
    last = prompt.tolist()
    for _ in range(30):
        n = rng.randint(1, allocator_module.FEW_DECODE_REQUESTS)
        lasts = [rng.choice([*last, 0, 120, rng.randint(1, 120)]) for _ in range(n)]
        if n > 1 and rng.random() < 0.3:
            lasts[1] = lasts[0]  # two rows ending at one shared slot: only the first takes its successor
        lens = t([5] * n)
        got_few = few.alloc_decode(lens, t(lasts))
        monkeypatch.setattr(allocator_module, "FEW_DECODE_REQUESTS", 0)
        got_tensor = tensor.alloc_decode(lens, t(lasts))
        monkeypatch.setattr(allocator_module, "FEW_DECODE_REQUESTS", 8)
        if got_few is None or got_tensor is None:
            assert got_few is None and got_tensor is None
            break
        assert got_few.dtype == torch.int64 and got_few.tolist() == got_tensor.tolist()
        assert few._num_reserved == tensor._num_reserved and torch.equal(few._reserved, tensor._reserved)
        assert torch.equal(few._free, tensor._free)
        last = got_few.tolist()
