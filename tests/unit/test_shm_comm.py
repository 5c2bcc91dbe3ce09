"""The shared-memory TP collectives (`ShmCommunicator`, csrc/shm_allreduce.c) with real processes: 2 and 3
ranks joined by gloo on loopback build a communicator, and every all-reduce is checked against references
computed independently on every rank from the known per-rank inputs — the float64 sum rounded once (on
dyadic data whose float32 sum is exact) and torch's float32 sum in rank order (bit for bit, on random data)
— for bf16 and float32, sizes 1 and 577, tensors spanning several slots, and 1200 consecutive calls of
varying size (both slot parities reused many times over). Every rank's results must be bit-identical. Also:
all_gather_last_dim against torch.cat of the shards, a peer that never calls (the others raise
CollectiveTimeout naming it, within a bound, and the communicator stays failed), and that the /dev/shm file is
unlinked by the time `create` returns. One in-process test covers the C entry points' argument checks, a
lone rank's timeout and a world of one."""

from __future__ import annotations

import glob
import hashlib
import os
import time

import pytest
import torch

from tests.rank_processes import report_from_world, run_ranks
from tokenloom.kernels.cpu_build import load_library

pytestmark = pytest.mark.skipif(load_library("kernels") is None, reason="native kernels unavailable")

SMALL_SLOT = 256  # bytes: 128 bf16 / 64 float32 elements per round
MANY_CALLS = 1200
TIMEOUT_S = 0.5
JOIN_S = 60


def _random_input(rank: int, call: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank `rank`'s contribution to call `call`: any rank can regenerate any other rank's."""
    gen = torch.Generator().manual_seed(1_000_003 * call + rank)
    return (torch.randn(n, generator=gen) * (1 + rank)).to(dtype)


def _dyadic_input(rank: int, call: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Integers below 256 times 2^-e for e in [0, 8]: exact in bf16, and a sum of a few of them is exact in
    float32, so rounding the float64 sum once is the exact answer for either dtype."""
    gen = torch.Generator().manual_seed(7_000_001 * call + rank)
    mant = torch.randint(-255, 256, (n,), generator=gen, dtype=torch.int64)
    exp = torch.randint(0, 9, (n,), generator=gen, dtype=torch.int64)
    return (mant.double() * torch.pow(2.0, -exp.double())).to(dtype)


def _rank_order_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    acc = parts[0].float()
    for p in parts[1:]:
        acc = acc + p.float()
    return acc.to(parts[0].dtype)


def _f64_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    acc = torch.zeros(parts[0].shape, dtype=torch.float64)
    for p in parts:
        acc += p.double()
    return acc.float().to(parts[0].dtype)  # exact in float32 by construction, so a single rounding


def _bits(x: torch.Tensor) -> bytes:
    return x.contiguous().view(torch.uint8).numpy().tobytes()


def _check_reduce(comm, world: int, rank: int, call: int, n: int, dtype: torch.dtype, failures: list[str],
                  digest) -> None:
    for make, reference in ((_random_input, _rank_order_sum), (_dyadic_input, _f64_sum)):
        parts = [make(r, call, n, dtype) for r in range(world)]
        x = parts[rank].clone()
        assert comm.all_reduce_(x) is x
        expected = reference(parts)
        if not torch.equal(x.view(torch.uint8), expected.view(torch.uint8)):
            bad = int((x.view(torch.uint8) != expected.view(torch.uint8)).sum())
            failures.append(f"{make.__name__} {dtype} n={n} call={call}: {bad} bytes differ")
        digest.update(_bits(x))


def _exercise(ctx, world: int, rank: int) -> dict:
    from tokenloom.distributed.shm_comm import CollectiveTimeout, ShmCommunicator

    out: dict = {"failures": []}
    failures, digest = out["failures"], hashlib.sha256()
    comm = ShmCommunicator.create(ctx)
    out["unlinked"] = not os.path.exists(comm.path)
    creator = comm.path.rsplit("-", 1)[0]  # the name holds rank 0's pid, then a random token
    call = 0
    for dtype in (torch.bfloat16, torch.float32):
        for n in (1, 577):
            _check_reduce(comm, world, rank, call, n, dtype, failures, digest)
            call += 1
    # 2-d shards, an odd last dim, bf16 and float32
    for shape, dtype in ((torch.Size([3, 5]), torch.float32), (torch.Size([1, 7]), torch.bfloat16),
                         (torch.Size([4]), torch.bfloat16)):
        shards = [_random_input(r, call, shape.numel(), dtype).reshape(shape) for r in range(world)]
        got = comm.all_gather_last_dim(shards[rank])
        if not torch.equal(got, torch.cat(shards, dim=-1)):
            failures.append(f"all_gather_last_dim {shape} {dtype}")
        digest.update(_bits(got))
        call += 1
    takes = [comm.handles(t) for t in (torch.ones(3, dtype=torch.bfloat16), torch.ones(2, 3),
                                       torch.ones(3, dtype=torch.int64), torch.ones(3, 2).t(), torch.tensor(1.0))]
    if takes != [True, True, False, False, False]:
        failures.append(f"handles: {takes}")
    comm.close()
    comm.close()  # idempotent
    if comm.handles(torch.ones(3)):
        failures.append("a closed communicator still handles tensors")

    small = ShmCommunicator.create(ctx, slot_bytes=SMALL_SLOT)
    for dtype, n in ((torch.bfloat16, 3 * 128 + 5), (torch.float32, 5 * 64), (torch.float32, 1000)):
        _check_reduce(small, world, rank, call, n, dtype, failures, digest)  # several rounds each
        call += 1
    shards = [_random_input(r, call, 2 * 150, torch.float32).reshape(2, 150) for r in range(world)]  # 1200 B
    if not torch.equal(small.all_gather_last_dim(shards[rank]), torch.cat(shards, dim=-1)):
        failures.append("multi-slot all_gather_last_dim")
    for i in range(MANY_CALLS):  # sizes from 1 to 3 slots, alternating dtypes
        dtype = torch.bfloat16 if i % 2 else torch.float32
        n = 1 + (i * 37) % 200
        parts = [_random_input(r, call, n, dtype) for r in range(world)]
        x = parts[rank].clone()
        small.all_reduce_(x)
        if not torch.equal(x, _rank_order_sum(parts)):
            failures.append(f"consecutive call {i} ({dtype}, n={n})")
        digest.update(_bits(x))
        call += 1
    small.close()

    # Threads: a piece above the single-thread threshold goes through the OpenMP path; same bits.
    threaded = ShmCommunicator.create(ctx)
    torch.set_num_threads(2)
    _check_reduce(threaded, world, rank, call, 300_000, torch.bfloat16, failures, digest)
    torch.set_num_threads(1)
    threaded.close()
    out["digest"] = digest.hexdigest()

    # The last rank never calls; the others must time out naming it (its global rank), and stay failed.
    timed = ShmCommunicator.create(ctx, timeout_s=TIMEOUT_S)
    if rank != world - 1:
        for attempt in range(2):
            start = time.monotonic()
            try:
                timed.all_reduce_(torch.ones(10, dtype=torch.bfloat16))
                out["timeout"] = "returned"
            except CollectiveTimeout as e:
                out[f"timeout{attempt}"] = (str(e), time.monotonic() - start)
    timed.close()
    out["leftover"] = glob.glob(creator + "-*")  # four segments created, none left
    return out


def _worker(rank: int, world: int, port: int, results) -> None:
    from tokenloom.distributed.comm import broadcast_pyobj

    def body(ctx) -> dict:
        out = _exercise(ctx, world, rank)
        broadcast_pyobj("done", ctx)  # nobody tears down the groups while a peer still waits in them
        return out

    report_from_world(rank, world, 1, port, results, body)


def _run(world: int) -> dict[int, dict]:
    return run_ranks(_worker, world, world, join_s=JOIN_S)[0]


@pytest.mark.parametrize("world", [2, 3])
def test_shm_collectives(world):
    got = _run(world)
    for rank, out in got.items():
        assert out["failures"] == [], (rank, out["failures"][:10])
        assert out["unlinked"], rank
        assert out["leftover"] == [], (rank, out["leftover"])
    assert len({out["digest"] for out in got.values()}) == 1, "ranks got different results"
    missing = world - 1
    for rank in range(world - 1):
        assert "timeout" not in got[rank], got[rank]["timeout"]
        first, elapsed = got[rank]["timeout0"]
        assert f"rank {missing} (tp {missing}) did not arrive within {TIMEOUT_S:g} s" in first, first
        assert TIMEOUT_S <= elapsed < TIMEOUT_S + 2.0, elapsed
        again, elapsed = got[rank]["timeout1"]  # the handle stays failed: at once, same culprit
        assert f"rank {missing} (tp {missing})" in again and elapsed < 0.1, (again, elapsed)


def test_c_entry_points_in_one_process():
    """The C interface on a private segment: bad arguments give -2 / NULL, a lone rank of two times out with
    -1 naming rank 1 and stays failed, and a world of one reduces to the identity and gathers to a copy."""
    import ctypes
    import mmap

    from tokenloom.distributed.shm_comm import _bind

    lib = _bind(load_library("kernels"))
    assert lib.shm_comm_bytes(2, 256) == 2 * 64 + 2 * 2 * 256
    assert [lib.shm_comm_bytes(w, s) for w, s in ((0, 256), (2, 0), (2, 100), (2, -64))] == [-2] * 4
    segment = mmap.mmap(-1, lib.shm_comm_bytes(2, 256))  # anonymous: zero-filled
    base = ctypes.c_char.from_buffer(segment)
    try:
        addr = ctypes.addressof(base)
        for args in ((None, 0, 2, 256, 1.0), (addr, 2, 2, 256, 1.0), (addr, -1, 2, 256, 1.0),
                     (addr, 0, 2, 100, 1.0), (addr, 0, 2, 256, 0.0), (addr + 8, 0, 2, 256, 1.0)):
            assert not lib.shm_comm_open(*args), args
        x = torch.ones(4, dtype=torch.bfloat16)
        assert lib.shm_allreduce_bf16(None, x.data_ptr(), 4, 1) == -2
        alone = lib.shm_comm_open(addr, 0, 2, 256, 0.2)
        assert lib.shm_comm_missing_rank(alone) == -1
        assert lib.shm_allreduce_f32(alone, None, 5, 1) == -2
        assert lib.shm_allgather(alone, x.data_ptr(), -1, x.data_ptr(), 1) == -2
        start = time.monotonic()
        assert lib.shm_allreduce_bf16(alone, x.data_ptr(), 4, 1) == -1
        assert 0.2 <= time.monotonic() - start < 1.5
        assert lib.shm_comm_missing_rank(alone) == 1
        start = time.monotonic()
        assert lib.shm_allgather(alone, x.data_ptr(), 8, x.data_ptr(), 1) == -1  # failed for good, at once
        assert time.monotonic() - start < 0.1
        lib.shm_comm_close(alone)

        solo = lib.shm_comm_open(addr, 0, 1, 256, 1.0)
        y = torch.randn(1000).to(torch.bfloat16)  # 8 rounds of 128 elements
        z = y.clone()
        assert lib.shm_allreduce_bf16(solo, z.data_ptr(), z.numel(), 1) == 0 and torch.equal(z, y)
        out = torch.empty_like(y)
        assert lib.shm_allgather(solo, y.data_ptr(), 2000, out.data_ptr(), 1) == 0 and torch.equal(out, y)
        assert lib.shm_allreduce_f32(solo, None, 0, 1) == 0  # nothing to do
        lib.shm_comm_close(solo)
    finally:
        del base
        segment.close()
