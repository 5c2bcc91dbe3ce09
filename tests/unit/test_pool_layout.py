"""`PoolLayout` (cache/pool_layout.py) and the sliding-window pool's transfer side (cache/swa_pool.py): runs built
per pipeline stage copy every layer's K/V of the given tokens from one sliding-window pool into another (full
layers at full slots, sliding layers at the swa slots each side maps them to), also across different pipeline
splits; tokens whose sliding K/V the source dropped are not copied; JSON round trips (a plain pool's is the
`KVLayout` JSON); plain and hybrid pools refuse each other; `read_slots` / `write_slots` round-trip both pools."""

from __future__ import annotations

import ctypes

import pytest
import torch

from tokenloom.cache.kv_pool import KVPool
from tokenloom.cache.pool_layout import PoolLayout
from tokenloom.cache.swa_pool import SWAKVPool

PATTERN = (True, True, False, True, True, False)  # Gemma 3's interleave, shortened: S S F S S F
HEADS, DIM = 2, 4


def _pool(start: int, end: int, size: int = 32, swa: int = 24, seed: int = 0) -> SWAKVPool:
    pool = SWAKVPool(size, swa, HEADS, DIM, torch.float32, torch.device("cpu"), start, end, PATTERN)
    pool.full_to_swa = torch.zeros(size + 2, dtype=torch.int64)
    gen = torch.Generator().manual_seed(seed)
    for buffers in (pool.full_pool.buffer, pool.swa_pool.buffer):
        buffers.copy_(torch.randn(buffers.shape, generator=gen))
    return pool


def _copy(runs: list[tuple[int, int, int]]) -> None:
    for src, dst, n in runs:
        ctypes.memmove(dst, src, n)


def _kv(pool: SWAKVPool, layer: int, slot: int) -> torch.Tensor:
    k, v = pool.get_kv(layer)
    row = int(pool.full_to_swa[slot]) if pool.is_sliding(layer) else slot
    return torch.stack((k[:, row], v[:, row]))


@pytest.mark.parametrize("prefill_split", [[(0, 6)], [(0, 3), (3, 6)], [(0, 2), (2, 5), (5, 6)]])
def test_runs_move_both_pools_across_pipeline_splits(prefill_split):
    src_slots, dst_slots = [3, 4, 5, 9, 10], [7, 8, 12, 13, 14]
    # the first source token's sliding K/V was dropped; the destination reserved none for the second
    src_swa, dst_swa = [0, 6, 7, 2, 3], [5, 0, 1, 2, 9]
    decode = _pool(0, 6, seed=99)
    decode.full_to_swa[torch.tensor(dst_slots)] = torch.tensor(dst_swa)
    before = {(layer, slot): _kv(decode, layer, slot).clone() for layer in range(6) for slot in dst_slots}
    stages = []
    for i, (a, b) in enumerate(prefill_split):
        stage = _pool(a, b, seed=i + 1)
        stage.full_to_swa[torch.tensor(src_slots)] = torch.tensor(src_swa)
        stages.append(stage)
        src_layout, dst_layout = stage.layout(0), PoolLayout.from_json(decode.layout(0).to_json())
        _copy(src_layout.runs(dst_layout, src_slots, dst_slots, src_swa, dst_swa, layers=range(a, b)))
    for stage, (a, b) in zip(stages, prefill_split, strict=True):
        for layer in range(a, b):
            for i, (s, d) in enumerate(zip(src_slots, dst_slots, strict=True)):
                got = _kv(decode, layer, d)
                if PATTERN[layer] and 0 in (src_swa[i], dst_swa[i]):  # not copied: the destination is left alone
                    assert torch.equal(got, before[(layer, d)])
                else:
                    assert torch.equal(got, _kv(stage, layer, s)), (layer, s, d)


def test_kind_ranges_json_and_mismatches():
    layout = _pool(2, 5).layout(1)
    assert layout.hybrid and layout.full.head_start == layout.swa.head_start == 1
    assert (layout.full.start_layer, layout.full.end_layer) == (0, 1)  # global layer 2 is full layer 0
    assert (layout.swa.start_layer, layout.swa.end_layer) == (2, 4)  # global 3, 4 are sliding layers 2, 3
    assert layout.kind_ranges(range(0, 6)) == (range(0, 2), range(0, 4))
    assert layout.kind_ranges(range(3, 5)) == (range(1, 1), range(2, 4))
    assert PoolLayout.from_json(layout.to_json()) == layout
    plain = KVPool(16, 1, HEADS, DIM, torch.float32, torch.device("cpu"), 0, 6)
    plain_layout = PoolLayout.of(plain.layout(0))
    assert plain_layout.to_json() == plain.layout(0).to_json()
    assert PoolLayout.from_json(plain.layout(0).to_json()) == plain_layout
    assert sorted(n for _, n in layout.regions()) == sorted((layout.full.nbytes, layout.swa.nbytes))
    with pytest.raises(ValueError, match="--disable-hybrid-swa-memory"):
        plain_layout.runs(layout, [1], [1], None, [1], layers=range(0, 6))
    with pytest.raises(ValueError, match="swa slots"):
        _pool(0, 6).layout(0).runs(_pool(0, 6).layout(0), [1], [1], None, None, layers=range(0, 6))


def test_read_write_slots_round_trip_both_pools():
    src, dst = _pool(0, 6, seed=3), _pool(0, 6, seed=4)
    src.full_to_swa[torch.tensor([1, 2, 3])] = torch.tensor([4, 5, 6])
    dst.full_to_swa[torch.tensor([7, 8, 9])] = torch.tensor([1, 2, 3])
    dst.write_slots(torch.tensor([7, 8, 9]), src.read_slots(torch.tensor([1, 2, 3])))
    for layer in range(6):
        for s, d in ((1, 7), (2, 8), (3, 9)):
            assert torch.equal(_kv(dst, layer, d), _kv(src, layer, s))
    # a slot without a swa slot (out of every window) takes the full layers' rows only
    dummy = {layer: _kv(dst, layer, 10).clone() for layer in range(6)}  # sliding: slot 10 reads the dummy swa row
    dst.write_slots(torch.tensor([10]), src.read_slots(torch.tensor([2])))
    for layer in range(6):
        assert torch.equal(_kv(dst, layer, 10), dummy[layer] if PATTERN[layer] else _kv(src, layer, 2))
        assert torch.equal(_kv(dst, layer, 10), _kv(src, layer, 2)) != PATTERN[layer]


def test_a_decode_server_refuses_a_prefill_server_whose_pool_kind_differs():
    from tokenloom.disaggregation.pairing import topology_ranks
    from tokenloom.disaggregation.prefill_directory import PrefillDirectory

    world = topology_ranks(6, HEADS, 1, 1)
    hybrid = _pool(0, 6).layout(0)
    plain = KVPool(32, 1, HEADS, DIM, torch.float32, torch.device("cpu"), 0, 6).layout(0)

    def info(layout) -> dict:
        return {"ranks": [{"page_size": 1, "kv_cache_dtype": "float32", "transfer_backend": "mooncake",
                           "rank_kv": world[0].to_json(), "layout": layout.to_json()}]}

    for mine, theirs, who in ((hybrid, plain, "this decode server"), (plain, hybrid, "the prefill server")):
        directory = PrefillDirectory(1, "float32", "mooncake", world, mine, 1.0)
        problem = directory.incompatibility(info(theirs))
        assert problem is not None and who in problem and "--disable-hybrid-swa-memory" in problem
    assert PrefillDirectory(1, "float32", "mooncake", world, hybrid, 1.0).incompatibility(info(hybrid)) is None
    other = PoolLayout(hybrid.full, hybrid.swa, (False, True, False, True, True, False))
    assert "pattern" in PrefillDirectory(1, "float32", "mooncake", world, hybrid, 1.0).incompatibility(info(other))
