"""build_kv_indices / padded_kv_indices and ForwardBatch.build against per-request Python loops."""

from __future__ import annotations

import os
import random

import pytest
import torch

from tokenloom.forward_batch import ForwardBatch, ForwardMode
from tokenloom.layers import kv_indices as kv_indices_module
from tokenloom.layers.kv_indices import build_kv_indices, padded_kv_indices


def t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


# The CPU implementations of the same contract; "native" is skipped where the kernel library cannot build.
CPU_BACKENDS = ["torch", pytest.param("native", marks=pytest.mark.skipif(
    kv_indices_module.native_kv_index_builder() is None, reason="native kernels unavailable"))]


def random_case(rng: random.Random, with_start: bool):
    rows, cols = rng.randint(1, 12), rng.randint(1, 48)
    table = torch.tensor([[rng.randrange(1, 10**6) for _ in range(cols)] for _ in range(rows)], dtype=torch.int32)
    b = rng.randint(1, 8)
    req = [rng.randrange(rows) for _ in range(b)]  # repeats allowed
    starts, lens = [], []
    for _ in range(b):
        s = rng.randint(0, cols) if with_start else 0
        starts.append(s)
        lens.append(rng.choice([0, rng.randint(0, cols - s)]))
    return table, req, starts, lens


def ref_indices(table, req, starts, lens):
    indptr, flat = [0], []
    for r, s, n in zip(req, starts, lens, strict=True):
        flat.extend(int(table[r, c]) for c in range(s, s + n))
        indptr.append(indptr[-1] + n)
    return indptr, flat


@pytest.mark.parametrize("with_start", [False, True])
@pytest.mark.parametrize("seed", range(30))
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_build_kv_indices_matches_loop(seed, with_start, backend):
    rng = random.Random(seed)
    table, req, starts, lens = random_case(rng, with_start)
    want_ptr, want = ref_indices(table, req, starts, lens)
    kv_start = t(starts) if with_start else None
    for total in (None, sum(lens)):
        ptr, idx = build_kv_indices(table, t(req).int(), t(lens).int(), kv_start, total=total, backend=backend)
        assert ptr.dtype == torch.int64 and idx.dtype == torch.int64
        assert ptr.tolist() == want_ptr
        assert idx.tolist() == want

    max_len = max(lens) + rng.randint(0, 3)
    padded, valid = padded_kv_indices(ptr, idx, t(lens), max_len)
    assert padded.shape == (len(req), max_len) and valid.shape == (len(req), max_len)
    for i, (r, s, n) in enumerate(zip(req, starts, lens, strict=True)):
        assert padded[i].tolist() == [int(table[r, s + j]) for j in range(n)] + [0] * (max_len - n)
        assert valid[i].tolist() == [True] * n + [False] * (max_len - n)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_build_kv_indices_all_empty(backend):
    table = torch.arange(20, dtype=torch.int32).reshape(2, 10)
    ptr, idx = build_kv_indices(table, t([1, 0]), t([0, 0]), backend=backend)
    assert ptr.tolist() == [0, 0, 0] and idx.numel() == 0
    padded, valid = padded_kv_indices(ptr, idx, t([0, 0]), 3)
    assert padded.tolist() == [[0] * 3] * 2 and not valid.any()


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_build_kv_indices_small_example(backend):
    table = torch.tensor([[10, 11, 12, 13], [20, 21, 22, 23], [30, 31, 32, 33]], dtype=torch.int32)
    ptr, idx = build_kv_indices(table, t([2, 0, 2]), t([2, 3, 1]), kv_start=t([1, 0, 3]), backend=backend)
    assert ptr.tolist() == [0, 2, 5, 6]
    assert idx.tolist() == [31, 32, 10, 11, 12, 33]


@pytest.mark.parametrize("with_start", [False, True])
@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_build_kv_indices_large_batches_match_loop(seed, with_start, backend):
    """Batches of 1..64 requests, lengths 0..300 with runs of empty requests at the front, middle and end."""
    rng = random.Random(1000 + seed)
    rows, width = rng.randint(1, 80), 320
    table = torch.randint(0, 2**31 - 1, (rows, width), dtype=torch.int32,
                          generator=torch.Generator().manual_seed(seed))
    b = rng.randint(1, 64)
    req = [rng.randrange(rows) for _ in range(b)]
    lens = [rng.choice([0, rng.randint(0, 300)]) for _ in range(b)]
    for i in range(rng.randint(0, b)):  # an empty prefix or suffix of the batch
        lens[i if seed % 2 else b - 1 - i] = 0
    starts = [rng.randint(0, width - n) if with_start else 0 for n in lens]
    want_ptr, want = ref_indices(table, req, starts, lens)
    dtype = torch.int32 if seed % 3 else torch.int64
    ptr, idx = build_kv_indices(table, torch.tensor(req, dtype=dtype), torch.tensor(lens, dtype=dtype),
                                torch.tensor(starts, dtype=dtype) if with_start else None, backend=backend)
    assert ptr.tolist() == want_ptr and idx.tolist() == want


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_build_kv_indices_strided_table_and_empty_batch(backend):
    table = torch.arange(6 * 16, dtype=torch.int32).reshape(6, 16)[:, 4:12]  # row stride 16, width 8
    ptr, idx = build_kv_indices(table, t([5, 0]), t([3, 8]), kv_start=t([5, 0]), backend=backend)
    assert ptr.tolist() == [0, 3, 11]
    assert idx.tolist() == [89, 90, 91] + list(range(4, 12))
    ptr, idx = build_kv_indices(table, t([]), t([]), backend=backend)
    assert ptr.tolist() == [0] and idx.numel() == 0


@pytest.mark.parametrize("rows, lens, starts", [([0], [9], None), ([0], [3], [6]), ([2], [1], None),
                                                ([-1], [1], None), ([0], [-1], None)])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_build_kv_indices_rejects_reads_outside_the_table(rows, lens, starts, backend):
    table = torch.zeros(2, 8, dtype=torch.int32)
    with pytest.raises(IndexError, match="outside req_to_token"):
        build_kv_indices(table, t(rows), t(lens), None if starts is None else t(starts), backend=backend)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_build_kv_indices_rejects_wrong_total(backend):
    with pytest.raises(ValueError, match="total=3"):
        build_kv_indices(torch.zeros(2, 8, dtype=torch.int32), t([0, 1]), t([1, 1]), total=3, backend=backend)


def test_build_kv_indices_backends(monkeypatch):
    table = torch.arange(40, dtype=torch.int32).reshape(4, 10)
    args = (table, t([3, 1]), t([2, 4]), t([1, 0]))
    want = build_kv_indices(*args, backend="torch")
    assert want[1].tolist() == [31, 32, 10, 11, 12, 13]
    # "auto" on CPU tensors is the native kernel when it builds (else torch) and never looks for triton.
    monkeypatch.setattr(kv_indices_module, "triton_kv_index_builder", lambda: pytest.fail("looked for triton"))
    got = build_kv_indices(*args)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    if kv_indices_module.native_kv_index_builder() is not None:
        assert kv_indices_module._auto_backend(table) == "native"
        assert kv_indices_module._auto_backend(table.long()) == "torch"  # the kernel reads int32 tables only
    monkeypatch.setattr(kv_indices_module, "native_kv_index_builder", lambda: None)
    assert kv_indices_module._auto_backend(table) == "torch"
    with pytest.raises(RuntimeError, match="CPU kernel library"):
        build_kv_indices(*args, backend="native")
    monkeypatch.undo()
    # "triton" on CPU tensors outside the interpreter (tests/unit/test_kv_indices_triton.py runs it inside).
    if os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises((ValueError, RuntimeError), match="CUDA tensors|triton package"):
            build_kv_indices(*args, backend="triton")
    with pytest.raises(ValueError, match="unknown KV-index backend 'cuda'"):
        build_kv_indices(*args, backend="cuda")


@pytest.mark.skipif(kv_indices_module.native_kv_index_builder() is None, reason="native kernels unavailable")
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_native_kv_indices_split_over_threads(threads):
    """Large enough for the kernel to split the output over threads: ranges that begin inside a long request,
    runs of empty requests, and a repeated row, all against the torch path."""
    gen = torch.Generator().manual_seed(threads)
    table = torch.randint(0, 2**31 - 1, (40, 8192), dtype=torch.int32, generator=gen)
    lens = torch.randint(0, 3000, (64,), generator=gen)
    lens[::5] = 0
    lens[7] = 8192  # one request covering a whole row
    rows = torch.randint(0, 40, (64,), generator=gen)
    starts = torch.minimum(torch.randint(0, 4000, (64,), generator=gen), 8192 - lens)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = build_kv_indices(table, rows, lens, starts, backend="native")
    finally:
        torch.set_num_threads(old)
    want = build_kv_indices(table, rows, lens, starts, backend="torch")
    assert int(lens.sum()) >= 65536  # above the kernel's threshold for splitting
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# -------------------------------------------------------------------------------------- ForwardBatch

def ref_extend(prefix, seq):
    positions, token_req, starts = [], [], []
    for i, (a, s) in enumerate(zip(prefix, seq, strict=True)):
        starts.append(len(positions))
        positions.extend(range(a, s))
        token_req.extend([i] * (s - a))
    return positions, token_req, starts


@pytest.mark.parametrize("seed", range(20))
def test_forward_batch_extend_matches_loop(seed):
    rng = random.Random(seed)
    b = rng.randint(1, 7)
    prefix = [rng.choice([0, rng.randint(0, 30)]) for _ in range(b)]
    seq = [a + rng.choice([1, rng.randint(0, 20)]) for a in prefix]
    total = sum(s - a for a, s in zip(prefix, seq, strict=True))
    ids = torch.randint(0, 1000, (total,), dtype=torch.int32)
    rows = t([rng.randrange(64) for _ in range(b)]).int()
    loc = torch.randint(1, 5000, (total,), dtype=torch.int32)
    fb = ForwardBatch.build(ForwardMode.EXTEND, ids, rows, t(prefix).int(), t(seq).int(), loc)
    positions, token_req, starts = ref_extend(prefix, seq)
    assert fb.forward_mode is ForwardMode.EXTEND and fb.forward_mode.is_extend()
    assert fb.positions.tolist() == positions
    assert fb.token_req_index.tolist() == token_req
    assert fb.extend_start_loc.tolist() == starts
    assert fb.extend_seq_lens.tolist() == [s - a for a, s in zip(prefix, seq, strict=True)]
    assert fb.extend_prefix_lens.tolist() == prefix and fb.seq_lens.tolist() == seq
    assert fb.max_seq_len == max(seq) and fb.max_extend_len == max(s - a for a, s in zip(prefix, seq,
                                                                                       strict=True))
    assert fb.input_ids.tolist() == ids.tolist() and fb.out_cache_loc.tolist() == loc.tolist()
    assert fb.req_pool_indices.tolist() == rows.tolist() and fb.batch_size == b
    for name in ("input_ids", "positions", "req_pool_indices", "seq_lens", "out_cache_loc",
                 "extend_prefix_lens", "extend_seq_lens", "extend_start_loc", "token_req_index"):
        assert getattr(fb, name).dtype == torch.int64, name
    # The documented layout: request i's tokens are input_ids[start_i : start_i + extend_i].
    for i in range(b):
        sl = slice(starts[i], starts[i] + seq[i] - prefix[i])
        assert (fb.token_req_index[sl] == i).all()


@pytest.mark.parametrize("seed", range(10))
def test_forward_batch_decode_matches_loop(seed):
    rng = random.Random(seed)
    b = rng.randint(1, 9)
    seq = [rng.randint(1, 100) for _ in range(b)]
    prefix = [s - 1 for s in seq]
    fb = ForwardBatch.build(ForwardMode.DECODE, torch.randint(0, 50, (b,)), t(list(range(b))),
                            t(prefix), t(seq), torch.arange(b))
    assert fb.forward_mode.is_decode() and not fb.forward_mode.is_extend()
    assert fb.positions.tolist() == prefix
    assert fb.token_req_index.tolist() == list(range(b))
    assert fb.extend_start_loc.tolist() == list(range(b))
    assert fb.extend_seq_lens.tolist() == [1] * b
    assert fb.extend_prefix_lens.tolist() == prefix
    assert fb.max_seq_len == max(seq) and fb.max_extend_len == 1


def test_forward_batch_decode_rejects_wrong_token_count():
    with pytest.raises(ValueError, match="one token per request"):
        ForwardBatch.build(ForwardMode.DECODE, t([1, 2, 3]), t([0, 1]), t([3, 4]), t([4, 5]), t([1, 2, 3]))


NATIVE = pytest.mark.skipif(kv_indices_module.native_kv_index_builder() is None, reason="native kernels unavailable")


@NATIVE
@pytest.mark.parametrize("seed", range(12))
def test_decode_store_and_build_equals_a_store_then_a_build(seed):
    """One native call for a decode step's table work: the same table and index lists as
    `req_to_token[rows, seq - 1] = slots` followed by the torch builder (distinct rows, lengths up to the row)."""
    from tokenloom.kernels.native_kv_indices import store_decode_slots_and_build_indices

    gen = torch.Generator().manual_seed(seed)
    n_rows, width = 10, 64
    table = torch.randint(1, 2**31 - 1, (n_rows, width), dtype=torch.int32, generator=gen)
    b = 1 + seed % 6
    rows = torch.randperm(n_rows, generator=gen)[:b]
    seq = torch.randint(1, width + 1, (b,), generator=gen)
    slots = torch.randint(0, 2**31 - 1, (b,), generator=gen)
    want_table = table.clone()
    want_table[rows, seq - 1] = slots.to(torch.int32)
    want = build_kv_indices(want_table, rows, seq, backend="torch")
    got = store_decode_slots_and_build_indices(table, rows, seq, slots, int(seq.sum()))
    assert torch.equal(table, want_table)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@NATIVE
@pytest.mark.parametrize("rows, seq, slots, total, error", [
    ([0, 9], [3, 2], [5, 6], 5, "request 1: row 9"),  # row outside the table
    ([0, 1], [3, 0], [5, 6], 3, "request 1: row 1, length 0"),  # a decode token needs length >= 1
    ([0, 1], [3, 9], [5, 6], 12, "request 1: row 1, length 9"),  # longer than a row
    ([0, 1], [3, 2], [5, 2**31], 5, "request 1: row 1, length 2, new slot 2147483648"),  # not an int32 slot
    ([0, 1], [3, 2], [5, 6], 6, "total=6 but the kv_lens sum to 5"),
])
def test_decode_store_and_build_refuses_bad_input_and_writes_nothing(rows, seq, slots, total, error):
    from tokenloom.kernels.native_kv_indices import store_decode_slots_and_build_indices

    table = torch.arange(4 * 8, dtype=torch.int32).view(4, 8)
    before = table.clone()
    with pytest.raises((IndexError, ValueError), match=error):
        store_decode_slots_and_build_indices(table, t(rows), t(seq), t(slots), total)
    assert torch.equal(table, before)


@NATIVE
def test_the_cpu_backend_stores_a_steady_decode_batchs_slots_with_its_metadata():
    """A decode batch that knows its KV total: `stores_new_slots` holds and `init_forward_metadata` leaves the
    table and index lists a store-then-build gives; without the total, the runner's store is needed."""
    from tokenloom.cache.kv_pool import KVPool
    from tokenloom.cache.req_to_token import ReqToTokenPool
    from tokenloom.layers.attention.cpu_paged import CpuPagedBackend

    pool = ReqToTokenPool(4, 32, torch.device("cpu"))
    pool.req_to_token.copy_(torch.arange(4 * 32, dtype=torch.int32).view(4, 32))
    kv = KVPool(200, 1, num_kv_heads=1, head_dim=64, dtype=torch.bfloat16, device=torch.device("cpu"),
                start_layer=0, end_layer=1)
    backend = CpuPagedBackend(pool, kv, num_heads=3)
    rows, seq, slots = t([2, 0]), t([5, 9]), t([150, 151])
    steady = ForwardBatch.build_decode(torch.zeros(2, dtype=torch.int64), rows, seq - 1, seq, slots, 9, t([3, 4]),
                                       kv_total=14)
    plain = ForwardBatch.build(ForwardMode.DECODE, torch.zeros(2, dtype=torch.int64), rows, seq - 1, seq, slots)
    assert backend.stores_new_slots(steady) and not backend.stores_new_slots(plain)
    want_table = pool.req_to_token.clone()
    want_table[rows, seq - 1] = slots.to(torch.int32)
    backend.init_forward_metadata(steady)
    assert torch.equal(pool.req_to_token, want_table)
    want = build_kv_indices(want_table, rows, seq, backend="torch")
    md = steady.attn_metadata
    assert torch.equal(md.kv_indptr, want[0]) and torch.equal(md.kv_indices, want[1])
