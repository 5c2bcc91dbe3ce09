"""KVPool's single buffer and its KVLayout; transfer_runs checked by applying the runs with memmove against
torch indexing, and its coalescing against a token-by-token brute force."""

from __future__ import annotations

import ctypes
import json

import numpy as np
import pytest
import torch

from tokenloom.cache.kv_layout import (
    KVLayout,
    aligned_prefix,
    transfer_runs,
    transfer_runs_array,
)
from tokenloom.cache.kv_pool import KVPool

HEAD_DIM = 8


def make_pool(start: int, end: int, heads: int, size: int, page_size: int = 4,
              dtype: torch.dtype = torch.float32) -> KVPool:
    return KVPool(size, page_size, heads, HEAD_DIM, dtype, torch.device("cpu"), start, end)


def random_fill(pool: KVPool, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=gen).to(pool.dtype))


def apply_runs(runs: list[tuple[int, int, int]]) -> None:
    for src, dst, n in runs:
        ctypes.memmove(dst, src, n)


def expected_after(src: KVPool, src_head_start: int, dst: KVPool, dst_head_start: int, src_slots: list[int],
                   dst_slots: list[int]) -> torch.Tensor:
    """dst's buffer after the copy, by torch indexing over the shared layers and global heads."""
    out = dst.buffer.clone()
    layers = range(max(src.start_layer, dst.start_layer), min(src.end_layer, dst.end_layer))
    src_heads = range(src_head_start, src_head_start + src.num_kv_heads)
    dst_heads = range(dst_head_start, dst_head_start + dst.num_kv_heads)
    heads = [h for h in src_heads if h in dst_heads]
    for layer in layers:
        for h in heads:
            sl = src.buffer[layer - src.start_layer, :, h - src_head_start]
            out[layer - dst.start_layer, :, h - dst_head_start, dst_slots] = sl[:, src_slots]
    return out


def brute_force_runs(src: KVLayout, dst: KVLayout, src_slots: list[int], dst_slots: list[int]) -> list:
    """One run per (layer, kv, head, token) in transfer order, merged when adjacent in both spaces."""
    runs: list[list[int]] = []
    for layer in range(max(src.start_layer, dst.start_layer), min(src.end_layer, dst.end_layer)):
        for kv in (0, 1):
            for head in range(max(src.head_start, dst.head_start), min(src.head_end, dst.head_end)):
                for s, d in zip(src_slots, dst_slots, strict=True):
                    a, b, n = src.addr(layer, kv, head, s), dst.addr(layer, kv, head, d), src.row_bytes
                    if runs and runs[-1][0] + runs[-1][2] == a and runs[-1][1] + runs[-1][2] == b:
                        runs[-1][2] += n
                    else:
                        runs.append([a, b, n])
    return [tuple(r) for r in runs]


# --- the pool ---------------------------------------------------------------------------------------------


def test_pool_is_one_buffer_whose_views_are_the_per_layer_tensors():
    pool = make_pool(2, 5, heads=3, size=20)
    assert pool.buffer.shape == (3, 2, 3, 24, HEAD_DIM) and pool.buffer.is_contiguous()
    for i in range(3):
        k, v = pool.get_kv(2 + i)
        assert k.shape == v.shape == (3, 24, HEAD_DIM) and k.is_contiguous() and v.is_contiguous()
        assert k.data_ptr() == pool.buffer.data_ptr() + (2 * i) * k.numel() * 4
        assert v.data_ptr() == k.data_ptr() + k.numel() * 4
    k_new = torch.arange(1, 1 + 2 * 3 * HEAD_DIM, dtype=torch.float32).view(2, 3, HEAD_DIM)
    pool.set_kv(3, torch.tensor([5, 9]), k_new, -k_new)
    assert torch.equal(pool.buffer[1, 0][:, [5, 9]], k_new.transpose(0, 1))
    assert torch.equal(pool.buffer[1, 1][:, [5, 9]], -k_new.transpose(0, 1))
    assert int(pool.buffer.ne(0).sum()) == 2 * k_new.numel()  # nothing else written
    assert pool.nbytes() == 3 * 2 * 3 * 24 * HEAD_DIM * 4


def test_layout_addresses_are_the_buffer_elements():
    pool = make_pool(4, 7, heads=2, size=12, dtype=torch.bfloat16)
    layout = pool.layout(head_start=6)
    assert (layout.start_layer, layout.end_layer, layout.heads, layout.rows) == (4, 7, range(6, 8), 16)
    assert (layout.itemsize, layout.dtype, layout.page_size, layout.nbytes) == (2, "bfloat16", 4, pool.nbytes())
    for layer, kv, head, slot in [(4, 0, 6, 0), (5, 1, 7, 3), (6, 1, 7, 15), (6, 0, 6, 9)]:
        element = pool.buffer[layer - 4, kv, head - 6, slot]
        assert layout.addr(layer, kv, head, slot) == element.data_ptr()
    for bad in [(3, 0, 6, 0), (7, 0, 6, 0), (4, 2, 6, 0), (4, 0, 5, 0), (4, 0, 8, 0), (4, 0, 6, 16)]:
        with pytest.raises(IndexError):
            layout.addr(*bad)


def test_layout_json_round_trip_and_refusals():
    layout = make_pool(0, 2, heads=2, size=8).layout(head_start=2)
    data = json.loads(json.dumps(layout.to_json()))
    assert KVLayout.from_json(data) == layout
    with pytest.raises(ValueError, match="missing \\['rows'\\]"):
        KVLayout.from_json({k: v for k, v in data.items() if k != "rows"})
    with pytest.raises(ValueError, match="unknown \\['extra'\\]"):
        KVLayout.from_json({**data, "extra": 1})
    with pytest.raises(ValueError, match="head_dim"):
        KVLayout.from_json({**data, "head_dim": "8"})
    with pytest.raises(ValueError, match="reversed"):
        KVLayout.from_json({**data, "start_layer": 3})


# --- transfer_runs ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pattern", ["scattered", "contiguous", "mixed"])
def test_runs_copy_the_layer_and_head_intersection(pattern, dtype):
    # src: layers [0, 6), global heads [0, 4); dst: layers [2, 8), global heads [2, 4), a different pool size
    src, dst = make_pool(0, 6, heads=4, size=40, dtype=dtype), make_pool(2, 8, heads=2, size=28, dtype=dtype)
    random_fill(src, 1)
    random_fill(dst, 2)
    rng = np.random.default_rng(3)
    n = 12
    if pattern == "scattered":
        src_slots = rng.choice(np.arange(4, 44), n, replace=False).tolist()
        dst_slots = rng.choice(np.arange(4, 32), n, replace=False).tolist()
    elif pattern == "contiguous":
        src_slots, dst_slots = list(range(9, 9 + n)), list(range(17, 17 + n))
    else:  # stretches consecutive on one side only, on both, and a repeated source token
        src_slots = [4, 5, 6, 7, 20, 21, 22, 30, 31, 8, 8, 9]
        dst_slots = [8, 9, 10, 11, 12, 13, 14, 24, 26, 27, 4, 5]
    want = expected_after(src, 0, dst, 2, src_slots, dst_slots)
    src_layout, dst_layout = src.layout(0), dst.layout(2)
    runs = transfer_runs(src_layout, dst_layout, src_slots, dst_slots)
    assert runs == brute_force_runs(src_layout, dst_layout, src_slots, dst_slots)
    apply_runs(runs)
    assert torch.equal(dst.buffer, want)
    if pattern == "contiguous":
        assert len(runs) == 4 * 2 * 2  # one run per (layer, kv, head) of the intersection
        assert {n for _, _, n in runs} == {n * HEAD_DIM * src.buffer.element_size()}


def test_runs_accept_tensors_and_numpy_and_narrowing():
    src, dst = make_pool(0, 4, heads=2, size=16), make_pool(0, 4, heads=2, size=16)
    random_fill(src, 4)
    slots = torch.tensor([4, 6, 7, 8])
    base = transfer_runs(src.layout(0), dst.layout(0), slots, slots.numpy())
    assert base == transfer_runs(src.layout(0), dst.layout(0), slots.tolist(), slots.tolist())
    narrow = transfer_runs(src.layout(0), dst.layout(0), slots, slots, layers=range(1, 3), heads=range(1, 5))
    apply_runs(narrow)
    want = torch.zeros_like(dst.buffer)
    want[1:3, :, 1][..., [4, 6, 7, 8], :] = src.buffer[1:3, :, 1][..., [4, 6, 7, 8], :]
    assert torch.equal(dst.buffer, want)
    assert len(narrow) == 2 * 2 * 1 * 2  # layers x kv x heads x stretches ([4], [6, 7, 8])


def test_whole_rows_merge_across_heads_kv_and_layers():
    src, dst = make_pool(0, 5, heads=3, size=12), make_pool(2, 6, heads=3, size=12)
    random_fill(src, 5)
    rows = list(range(src.rows))
    want = expected_after(src, 0, dst, 0, rows, rows)
    runs = transfer_runs(src.layout(0), dst.layout(0), rows, rows)
    assert runs == brute_force_runs(src.layout(0), dst.layout(0), rows, rows)
    assert runs == [(src.buffer[2].data_ptr(), dst.buffer[0].data_ptr(), 3 * src.buffer[0].numel() * 4)]
    apply_runs(runs)
    assert torch.equal(dst.buffer, want)
    # heads partly shared: a run crosses head boundaries within a (layer, kv) but not past the shared heads
    dst2 = make_pool(2, 6, heads=3, size=12)
    runs = transfer_runs(src.layout(0), dst2.layout(1), rows, rows)
    assert runs == brute_force_runs(src.layout(0), dst2.layout(1), rows, rows)
    assert len(runs) == 3 * 2 and {n for _, _, n in runs} == {2 * src.rows * HEAD_DIM * 4}
    want = expected_after(src, 0, dst2, 1, rows, rows)
    apply_runs(runs)
    assert torch.equal(dst2.buffer, want)


def test_nothing_shared_gives_no_runs():
    a, b = make_pool(0, 2, heads=2, size=8).layout(0), make_pool(2, 4, heads=2, size=8).layout(0)
    assert transfer_runs(a, b, [4, 5], [4, 5]) == []
    c = make_pool(0, 2, heads=2, size=8).layout(2)
    assert transfer_runs(a, c, [4, 5], [4, 5]) == []
    assert transfer_runs(a, a, [], []) == []
    assert transfer_runs_array(a, a, [], []).shape == (0, 3)


def test_runs_refuse_what_cannot_be_exchanged():
    base = make_pool(0, 2, heads=2, size=8).layout(0)
    cases = {
        "head_dim": KVLayout.from_json({**base.to_json(), "head_dim": 16}),
        "dtype": KVLayout.from_json({**base.to_json(), "dtype": "bfloat16"}),
        "itemsize": KVLayout.from_json({**base.to_json(), "itemsize": 2}),
        "page_size": KVLayout.from_json({**base.to_json(), "page_size": 16}),
    }
    for name, other in cases.items():
        with pytest.raises(ValueError, match=f"disagree on {name}"):
            transfer_runs(base, other, [4], [4])
    with pytest.raises(ValueError, match="src_slots has 2 slots but dst_slots has 1"):
        transfer_runs(base, base, [4, 5], [4])
    with pytest.raises(ValueError, match="dst_slots holds slots in \\[4, 12\\]"):
        transfer_runs(base, base, [4, 5], [4, 12])
    with pytest.raises(ValueError, match="src_slots holds slots in \\[-1, 5\\]"):
        transfer_runs(base, base, [-1, 5], [4, 5])
    with pytest.raises(ValueError, match="integers"):
        transfer_runs(base, base, [4.0], [4])
    with pytest.raises(ValueError, match="one-dimensional"):
        transfer_runs(base, base, [[4]], [[4]])
    with pytest.raises(ValueError, match="step 1"):
        transfer_runs(base, base, [4], [4], layers=range(0, 2, 2))


def test_aligned_prefix():
    assert [aligned_prefix(n, 4) for n in (0, 3, 4, 7, 8, 9)] == [0, 0, 4, 4, 8, 8]
    assert aligned_prefix(7, 1) == 7
    with pytest.raises(ValueError):
        aligned_prefix(-1, 4)
    with pytest.raises(ValueError):
        aligned_prefix(4, 0)
