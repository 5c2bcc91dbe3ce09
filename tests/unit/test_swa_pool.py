"""The sliding-window KV pool (cache/swa_pool.py, cache/swa_radix_cache.py): its accounting, what it drops and
when, and which cached prefixes it lends out once sliding KV is gone."""

from __future__ import annotations

import pytest
import torch

from tokenloom.cache.kv_memory import KVMemory
from tokenloom.cache.swa_pool import SWAAllocator, SWAKVPool
from tokenloom.cache.swa_radix_cache import SWAChunkCache, SWARadixCache

WINDOW = 4
KEEP = WINDOW + 1  # positions the tree keeps before an end point


def _memory(radix: bool = True, tokens: int = 96, swa_tokens: int = 64) -> KVMemory:
    return KVMemory.build(tokens=tokens, request_slots=4, context_len=80, page_size=1, num_kv_heads=1, head_dim=8,
                          dtype=torch.float32, device=torch.device("cpu"), start_layer=0, end_layer=3,
                          disable_radix_cache=not radix, layer_windows=(WINDOW, 0, WINDOW), swa_tokens=swa_tokens)


def _prefill(memory: KVMemory, tokens: list[int]) -> int:
    """A request row holding fresh slots for `tokens` (as the scheduler's prefill leaves it); returns the row."""
    row = memory.req_to_token_pool.alloc(1)[0]
    slots = memory.token_allocator.alloc(len(tokens))
    memory.req_to_token_pool.req_to_token[row, : len(tokens)] = slots.to(torch.int32)
    return row


def _present(memory: KVMemory, row: int, n: int) -> list[bool]:
    slots = memory.req_to_token_pool.req_to_token[row, :n].to(torch.int64)
    return (memory.token_allocator.full_to_swa[slots] > 0).tolist()


def test_parts_and_accounting():
    memory = _memory()
    alloc, pool = memory.token_allocator, memory.kv_pool
    assert isinstance(alloc, SWAAllocator) and isinstance(pool, SWAKVPool)
    assert isinstance(memory.tree_cache, SWARadixCache)
    assert pool.sliding == (True, False, True) and pool.swa_pool.k_buffers[0].shape[1] == 64 + 1
    assert pool.full_pool.k_buffers[0].shape[1] == 96 + 1
    assert alloc.available_size() == 64  # a new token needs a slot in each pool: the smaller count
    slots = alloc.alloc(10)
    assert alloc.swa_in_use() == 10 and alloc.full_available_size() == 86
    assert alloc.free_swa(slots[:4]) == 4 and alloc.free_swa(slots[:4]) == 0  # idempotent
    assert alloc.swa_in_use() == 6 and alloc.full_available_size() == 86  # full-layer KV kept
    alloc.check()
    alloc.free(slots)
    assert alloc.swa_in_use() == 0 and alloc.full_available_size() == 96
    assert alloc.alloc(65) is None  # more than the sliding pool holds
    alloc.check()


def test_layer_buffers_are_addressed_in_their_own_pool():
    pool = _memory().kv_pool
    k = torch.randn(2, 1, 8)
    pool.set_kv(0, torch.tensor([3, 5]), k, -k)  # swa slots 3, 5 of the sliding layer 0
    pool.set_kv(1, torch.tensor([3, 5]), 2 * k, k)  # full slots of the full layer 1
    assert torch.equal(pool.get_kv(0)[0][:, [3, 5]], k.transpose(0, 1))
    assert torch.equal(pool.get_kv(1)[0][:, [3, 5]], 2 * k.transpose(0, 1))
    assert not pool.get_kv(2)[0].any()


@pytest.mark.parametrize("radix", [True, False])
def test_running_request_drops_out_of_window_sliding_kv(radix):
    memory = _memory(radix)
    cache, alloc = memory.tree_cache, memory.token_allocator
    assert isinstance(cache, SWARadixCache if radix else SWAChunkCache)
    tokens = list(range(100, 130))
    row = _prefill(memory, tokens[:20])
    prefix, node = cache.cache_unfinished(row, tokens[:20], 0, cache.root_node)  # a chunk boundary at 20
    # The next chunk's queries (positions >= 20) read keys >= 20 - WINDOW + 1: those are kept, older ones not.
    kept = _present(memory, row, 20)
    assert all(kept[20 - WINDOW:]) and not any(kept[: 20 - KEEP])
    assert alloc.swa_in_use() <= KEEP
    prefix_len = len(prefix)
    for n in range(21, 31):  # decode: one new slot, then the step's out-of-window token goes
        slot = alloc.alloc(1)
        memory.req_to_token_pool.req_to_token[row, n - 1] = int(slot)
        cache.release_out_of_window(row, n, prefix_len, 8)
        assert all(_present(memory, row, n)[n - WINDOW:])
        assert alloc.swa_in_use() <= 2 * KEEP  # the tree's end window + the request's own
    full_in_use = memory.max_total_num_tokens - alloc.full_available_size()
    assert full_in_use == 30  # the full layers keep every position
    cache.cache_finished(row, tokens, 30, prefix_len, node)
    memory.req_to_token_pool.free(row)
    memory.check_idle_integrity()  # full accounting, swa map, no swa slot outside the tree
    assert alloc.swa_in_use() == (KEEP if radix else 0)


def test_match_lends_only_prefixes_whose_window_is_present():
    memory = _memory()
    cache = memory.tree_cache
    tokens = list(range(200, 240))
    row = _prefill(memory, tokens)
    cache.cache_finished(row, tokens, 40, 0, cache.root_node)  # one leaf [0, 40): sliding KV of [35, 40) kept
    memory.req_to_token_pool.free(row)
    # a continuation matches the whole leaf: the query at 40 reads keys 37..39, present
    match = cache.match_prefix(tokens + [1, 2, 3])
    assert match.length == 40
    # ending inside the leaf, where the window was dropped: nothing is lent (recomputed instead)
    assert cache.match_prefix(tokens[:30]).length == 0
    assert cache.match_prefix(tokens[:39]).length == 0  # [34, 39) misses position 34
    f2s = memory.token_allocator.full_to_swa
    lent = cache.match_prefix(tokens).indices
    assert bool((f2s[lent[-KEEP:]] > 0).all())
    memory.check_idle_integrity()


def test_recomputed_prefix_gives_the_tree_its_sliding_kv():
    """A request recomputing a cached prefix whose window was dropped: at its chunk boundary the tree keeps its
    own slots, which adopt the request's sliding KV, so the request's next chunk still reads it."""
    memory = _memory()
    cache = memory.tree_cache
    tokens = list(range(300, 340))
    row = _prefill(memory, tokens)
    cache.cache_finished(row, tokens, 40, 0, cache.root_node)
    memory.req_to_token_pool.free(row)
    assert cache.match_prefix(tokens[:25]).length == 0
    row = _prefill(memory, tokens[:25])  # recomputes [0, 25)
    prefix, node = cache.cache_unfinished(row, tokens[:25], 0, cache.root_node)
    assert len(prefix) == 25
    assert all(_present(memory, row, 25)[25 - WINDOW:])  # the row now points at tree slots with sliding KV
    cache.release_unfinished(row, 25, 25, node)  # aborted
    memory.req_to_token_pool.free(row)
    memory.check_idle_integrity()
    cache.reset()
    memory.token_allocator.check()
    assert memory.token_allocator.swa_in_use() == 0
    assert memory.token_allocator.full_available_size() == memory.max_total_num_tokens


def test_evict_frees_until_the_sliding_pool_has_room():
    """Leaves whose sliding KV is mostly dropped free few sliding slots: eviction goes on until the smaller
    pool has what was asked."""
    memory = _memory(tokens=96, swa_tokens=24)
    cache, alloc = memory.tree_cache, memory.token_allocator
    for base in (400, 500, 600):  # three cached 8-token sequences, KEEP sliding slots kept each
        tokens = list(range(base, base + 8))
        row = _prefill(memory, tokens)
        cache.cache_finished(row, tokens, 8, 0, cache.root_node)
        memory.req_to_token_pool.free(row)
    assert alloc.swa_in_use() == 3 * KEEP and alloc.available_size() == 24 - 3 * KEEP
    cache.evict(2 * KEEP)
    assert alloc.available_size() >= 24 - 3 * KEEP + 2 * KEEP
    memory.check_idle_integrity()


def test_tail_reservation_and_pool_room():
    """KV arriving for a whole prompt (PD decode): full slots for every position, sliding-layer slots for the
    window's tail only; `free_by_pool` / `swa_tail` tell the decode side what a reservation may take."""
    memory = _memory(radix=False, tokens=96, swa_tokens=8)
    alloc = memory.token_allocator
    assert memory.swa_tail() == KEEP and memory.free_by_pool() == (96, 8)
    slots = alloc.alloc_tail(40, KEEP)
    assert slots is not None and slots.numel() == 40
    assert (alloc.full_to_swa[slots] > 0).tolist() == [False] * (40 - KEEP) + [True] * KEEP
    alloc.check()
    assert memory.free_by_pool() == (56, 8 - KEEP)
    assert alloc.alloc_tail(10, KEEP) is None  # the tail does not fit the sliding pool: nothing taken
    assert memory.free_by_pool() == (56, 8 - KEEP)
    alloc.free(slots)
    assert memory.free_by_pool() == (96, 8) and alloc.swa_in_use() == 0
    plain = KVMemory.build(tokens=32, request_slots=2, context_len=16, page_size=1, num_kv_heads=1, head_dim=8,
                           dtype=torch.float32, device=torch.device("cpu"), start_layer=0, end_layer=1)
    assert plain.swa_tail() is None and plain.free_by_pool() == (32, 32)
