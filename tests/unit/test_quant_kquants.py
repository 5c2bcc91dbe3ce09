"""The GGUF k-quant kernels (csrc/quant_kquants.c: Q4_K, Q5_K, Q6_K) against the `gguf` package.

Blocks are written byte by byte (random quants and scales, sane f16 d/dmin), since gguf-py does not quantize
the K types. Rows are first re-laid out by the type's `repack_row` (as `prepare` does); `dequant_row` of that
form must be bit-equal to `gguf.quants.dequantize`; the int8-activation dot kernel is
checked twice: against the float64 product of gguf's dequantized weights with the activations it actually
saw (the int8 values times their block scale: only float32 summation error remains), and against the float32
matmul with the unquantized activations, within the activation-rounding bound sum_i |w_i| * d_i / 2 (each
activation moves by at most half its block's step d = max|x| / 127).
"""

from __future__ import annotations

import ctypes

import gguf
import numpy as np
import pytest

from tokenloom.kernels.cpu_build import load_library

LIB = load_library("kernels")
pytestmark = pytest.mark.skipif(LIB is None, reason="the native kernel library did not build")

Q4_K, Q5_K, Q6_K = 12, 13, 14
BLOCK_BYTES = {Q4_K: 144, Q5_K: 176, Q6_K: 210}


def _f16(rng: np.random.Generator, count: int, wide: bool) -> np.ndarray:
    """f16 scale bytes [count, 2]: 1e-3..1e-2 with random sign, or (wide) any finite f16 bit pattern,
    subnormals included."""
    if wide:
        bits = rng.integers(0, 1 << 16, count, dtype=np.uint16)
        bits[(bits & 0x7C00) == 0x7C00] &= 0xBFFF  # no inf/nan: clear an exponent bit
        return bits.view(np.uint8).reshape(count, 2)
    vals = rng.uniform(1e-3, 1e-2, count) * rng.choice([-1.0, 1.0], count)
    return vals.astype(np.float16).view(np.uint8).reshape(count, 2)


def make_blocks(qtype: int, rows: int, cols: int, seed: int, wide: bool = False) -> np.ndarray:
    """uint8 [rows, cols / 256 * block bytes] of valid random `qtype` super-blocks."""
    rng = np.random.default_rng(seed)
    count = rows * cols // 256
    rand = lambda n: rng.integers(0, 256, (count, n), dtype=np.uint8)  # noqa: E731
    if qtype == Q6_K:  # ql[128] qh[64] scales[16] (int8) d
        parts = [rand(128), rand(64), rand(16), _f16(rng, count, wide)]
    else:  # d dmin scales[12] (qh[32]) qs[128]
        parts = [_f16(rng, count, wide), _f16(rng, count, wide), rand(12)]
        parts += [rand(32)] if qtype == Q5_K else []
        parts += [rand(128)]
    blocks = np.concatenate(parts, axis=1)
    assert blocks.shape[1] == BLOCK_BYTES[qtype]
    return np.ascontiguousarray(blocks.reshape(rows, -1))


def reference_weights(qtype: int, data: np.ndarray, cols: int) -> np.ndarray:
    return gguf.quants.dequantize(data, gguf.GGMLQuantizationType(qtype)).reshape(data.shape[0], cols)


def quantize_activations(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The contract's activation quantization: per 32-element block d = max|x| / 127, q = round(x / d),
    s = sum q."""
    m, k = x.shape
    blocks = x.reshape(m, k // 32, 32)
    d = (np.abs(blocks).max(axis=-1) / 127).astype(np.float32)
    safe = np.where(d == 0, 1, d)[..., None]
    q = np.clip(np.rint(blocks / safe), -127, 127).astype(np.int8)
    s = q.astype(np.int32).sum(axis=-1)
    return q.reshape(m, k), d, s.astype(np.int32)


def ptr(a: np.ndarray) -> ctypes.c_void_p:
    return ctypes.c_void_p(a.ctypes.data)


def prepared(qtype: int, data: np.ndarray, cols: int, lib: ctypes.CDLL | None = None) -> np.ndarray:
    """The rows re-laid out for the kernel (a copy)."""
    out = data.copy()
    for r in range(out.shape[0]):
        assert (lib or LIB).kquant_repack_row(qtype, ptr(out[r]), ctypes.c_int64(cols)) == 0
    return out


def kernel_dequant(qtype: int, data: np.ndarray, cols: int, portable: bool = False,
                   lib: ctypes.CDLL | None = None) -> np.ndarray:
    out = np.empty((data.shape[0], cols), np.float32)
    for r in range(data.shape[0]):
        row = np.ascontiguousarray(data[r])
        rc = (lib or LIB).kquant_dequant_row(qtype, ptr(row), ctypes.c_int64(cols), ptr(out[r]), int(portable))
        assert rc == 0
    return out


def kernel_dot(qtype: int, data: np.ndarray, q: np.ndarray, d: np.ndarray, s: np.ndarray, threads: int = 2,
               row_bytes: int | None = None, lib: ctypes.CDLL | None = None) -> np.ndarray:
    n, (m, k) = data.shape[0], q.shape
    out = np.full((m, n), np.nan, np.float32)
    rc = (lib or LIB).kquant_dot_rows(qtype, ptr(data), ctypes.c_int64(row_bytes or data.shape[1]), ctypes.c_int64(n),
                             ptr(q), ptr(d), ptr(s), m, ctypes.c_int64(k), ptr(out), threads)
    assert rc == 0
    return out


@pytest.mark.parametrize("qtype", [Q4_K, Q5_K, Q6_K])
@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("portable", [False, True])
def test_dequant_row_bit_equal_to_gguf(qtype, wide, portable):
    """The table's dequant_row (AVX-512 where built) and the portable C one."""
    rows, cols = 7, 1024
    data = make_blocks(qtype, rows, cols, seed=qtype * 10 + wide, wide=wide)
    ref = reference_weights(qtype, data, cols)
    packed = prepared(qtype, data, cols)
    assert packed.shape == data.shape and not np.array_equal(packed, data)
    got = kernel_dequant(qtype, packed, cols, portable)
    assert np.isfinite(ref).all()
    assert np.array_equal(got.view(np.uint32), ref.view(np.uint32)), \
        f"{np.count_nonzero(got != ref)} of {got.size} values differ"


@pytest.mark.parametrize("qtype", [Q4_K, Q5_K, Q6_K])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 6, 64])
@pytest.mark.parametrize("k", [256, 768, 2048])
def test_dot_rows_vs_dequantized_matmul(qtype, m, k):
    n = 37  # odd: a tail of weight rows after the blocks of 4, split over two threads
    data = make_blocks(qtype, n, k, seed=1000 * qtype + 10 * m + k)
    w = reference_weights(qtype, data, k)
    rng = np.random.default_rng(m * k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[0, :32] = 0  # an all-zero activation block (d = 0)
    q, d, s = quantize_activations(x)
    got = kernel_dot(qtype, prepared(qtype, data, k), q, d, s).astype(np.float64)

    # 1. against the activations the kernel saw: only float32 summation error
    seen = q.astype(np.float64) * np.repeat(d.astype(np.float64), 32, axis=1)
    exact = seen @ w.astype(np.float64).T
    scale = np.abs(seen) @ np.abs(w.astype(np.float64)).T
    assert np.all(np.abs(got - exact) <= 1e-5 * scale + 1e-30), np.max(np.abs(got - exact) / scale)

    # 2. against the float32 matmul of the unquantized activations: the int8 rounding bound
    ref = (x @ w.T).astype(np.float64)
    bound = (np.repeat(d.astype(np.float64), 32, axis=1) / 2) @ np.abs(w.astype(np.float64)).T
    assert np.all(np.abs(got - ref) <= bound * (1 + 1e-4) + 1e-5 * scale)
    # and relative to sum|w||x| / 127 (the bound's usual size), the error is small
    assert np.max(np.abs(got - ref) / (np.abs(x) @ np.abs(w).T / 127)) < 1.0


@pytest.mark.parametrize("qtype", [Q4_K, Q5_K, Q6_K])
def test_dot_rows_strided_rows_and_thread_counts(qtype):
    n, k, m = 13, 512, 2
    data = prepared(qtype, make_blocks(qtype, n, k, seed=5), k)
    padded = np.zeros((n, data.shape[1] + 64), np.uint8)
    padded[:, :data.shape[1]] = data
    x = np.random.default_rng(1).standard_normal((m, k)).astype(np.float32)
    q, d, s = quantize_activations(x)
    one = kernel_dot(qtype, data, q, d, s, threads=1)
    assert np.array_equal(kernel_dot(qtype, padded, q, d, s, threads=2, row_bytes=padded.shape[1]), one)
    assert np.array_equal(kernel_dot(qtype, data, q, d, s, threads=3), one)


def test_entry_points_refuse_other_types_and_shapes():
    data = make_blocks(Q4_K, 1, 256, seed=0)
    out = np.empty(256, np.float32)
    assert LIB.kquant_dequant_row(2, ptr(data), ctypes.c_int64(256), ptr(out), 0) == -1  # Q4_0: not this family
    assert LIB.kquant_dequant_row(Q4_K, ptr(data), ctypes.c_int64(128), ptr(out), 0) == -1  # not whole blocks


# ---- through the public operations (tokenloom.kernels.quant_gemm: prepare, dequantize, embedding, linear)

def _public_native() -> bool:
    from tokenloom.kernels import quant_gemm as qg

    return hasattr(qg, "native_supported") and all(qg.native_supported(t) for t in (Q4_K, Q5_K, Q6_K))


public = pytest.mark.skipif(not _public_native(), reason="the native quantized-matmul driver is not built")


def _avx512_family() -> bool:
    from tokenloom.kernels import quant_gemm as qg

    return _public_native() and qg.native_isa() == 2


# paths of the AVX-512 families alone (the AVX2 family, csrc/quant_avx2.c, has one int8 path)
avx512_paths = pytest.mark.skipif(not _avx512_family(), reason="a path of the AVX-512 quantized kernels only")


def _quant_matrix(qtype: int, n: int, k: int, seed: int):
    from tokenloom.kernels import quant_gemm as qg

    return qg.QuantMatrix.from_gguf(qtype, (n, k), make_blocks(qtype, n, k, seed), f"test.{qtype}")


@public
@pytest.mark.parametrize("qtype", [Q4_K, Q5_K, Q6_K])
def test_public_small_path_work_items_change_no_result(qtype):
    """The small path's work items (up to 256 weight rows each, split evenly over the threads): over 1000 rows
    the stream's results at 1, 2 and 3 threads are bit-identical and close to the float32 reference."""
    import torch

    from tests.thread_counts import at_thread_counts
    from tokenloom.kernels import quant_gemm as qg

    n, k = 1000, 512
    raw = _quant_matrix(qtype, n, k, seed=61)
    qm = qg.prepare(raw)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(61)).bfloat16()
    got = at_thread_counts(lambda: [qg.linear(x[:m], qm, out_dtype=torch.float32) for m in (1, 3)], (1, 2, 3))
    for t in (2, 3):
        for a, b in zip(got[1], got[t], strict=True):
            assert torch.equal(a, b)
    ref = x.float() @ qg.dequantize(raw).T  # the gguf package's
    assert float((got[1][1] - ref).norm() / ref.norm()) < 0.01


@public
@pytest.mark.parametrize("qtype", [Q4_K, Q5_K, Q6_K])
@pytest.mark.parametrize("k", [768, 2048, 8192])
def test_public_dequantize_and_embedding_bit_equal(qtype, k):
    import torch

    from tokenloom.kernels import quant_gemm as qg

    qm = _quant_matrix(qtype, 29, k, seed=qtype + k)
    ref = qg.dequantize(qm)  # unprepared: the gguf package
    prepared = qg.prepare(qm)
    relaid = prepared.data.shape != qm.data.shape or not torch.equal(prepared.data, qm.data)  # both families
    # the AVX2 family unpacks Q4_K / Q5_K scales: 4 more bytes a super-block; otherwise the file's size
    grow = 4 * 29 * k // 256 if qg.native_isa() == 1 and qtype != Q6_K else 0
    assert prepared.packed and prepared.nbytes == qm.nbytes + grow and relaid
    assert torch.equal(qg.dequantize(prepared), ref)
    ids = torch.tensor([[3, 0], [28, 3]])
    assert torch.equal(qg.embedding(ids, prepared, torch.float32), ref[ids])


@public
@pytest.mark.parametrize("qtype", [Q4_K, Q5_K, Q6_K])
@pytest.mark.parametrize("m", [1, 3, 4, 64])
@pytest.mark.parametrize("k", [768, 2048])
@pytest.mark.parametrize("x_dtype", ["bfloat16", "float32"])
def test_public_linear(qtype, m, k, x_dtype):
    """bf16 x at few rows: the int8 path's bound sum_i |w_i| d(i) / 2; bf16 x at many rows: the weight rounded
    once to bf16 (2^-9 relative; the AVX2 family's tile: exact weights, float32 sums); float32 x: exact
    weights, float32 sums."""
    import ctypes as ct

    import torch

    from tokenloom.kernels import quant_gemm as qg

    n = 37
    raw = _quant_matrix(qtype, n, k, seed=m + k)
    w = qg.dequantize(raw).double()  # the gguf package's dequantize of the file layout, before any re-layout
    qm = qg.prepare(raw)
    g = torch.Generator().manual_seed(m * k)
    x = torch.randn(m, k, generator=g).to(getattr(torch, x_dtype))
    bias = torch.randn(n, generator=g)
    got = qg.linear(x, qm, bias, out_dtype=torch.float32).double()
    xd = x.double()
    ref = xd @ w.T + bias.double()
    mag = xd.abs() @ w.abs().T
    path = qg._native().quant_path(ct.c_int(qtype), ct.c_int64(m), ct.c_int64(k), ct.c_int(x.dtype == torch.float32))
    small = path in (1, 2, 3)  # an int8 path: the small stream, the many-row path or the AVX2 one-term tile
    lib = qg._native()
    batch_from, tile_from = lib.quant_batch_m(ct.c_int(-1)), lib.quant_tile_m(ct.c_int(-1))
    # the many-row int8 path: off where AMX runs, and from tile_from rows on where vdpbf16ps keeps pace
    batch = batch_from > 0 and m >= batch_from and (tile_from == 0 or m < tile_from)
    if qg.native_isa() == 2:
        assert path == (0 if x.dtype == torch.float32 else 1 if m <= 4 else 2 if batch else 0)
    else:  # the AVX2 family: bf16 x through the int8 terms below tile_from rows, else its float32 tile, or its
        # one-term int8 tile from i8_from rows on (Q4_K / Q5_K)
        i8 = x.dtype != torch.float32 and qtype != Q6_K and 0 < lib.quant_i8_tile_m(ct.c_int(-1)) <= m
        assert path == (3 if i8 else 0 if x.dtype == torch.float32 or m >= tile_from else 1)
    if x.dtype == torch.float32 or (path == 0 and qg.native_isa() == 1):  # exact weights, float32 sums
        tol = k * 2.0 ** -24 * mag
    elif small:
        d = xd.abs().view(m, k // 32, 32).amax(-1) / 127
        tol = (d.repeat_interleave(32, dim=1) / 2) @ w.abs().T + 1e-5 * mag
    else:
        tol = 2.0 ** -9 * mag + k * 2.0 ** -24 * mag
    assert got.shape == (m, n)
    assert torch.all((got - ref).abs() <= tol + 1e-6), float(((got - ref).abs() / (tol + 1e-6)).max())


@avx512_paths
@public
@pytest.mark.parametrize("qtype", [Q4_K, Q6_K])
def test_many_row_int8_path(qtype):
    """Many rows of bf16 x take the int8 path (csrc/quant_batch.c) for the k-quants too, Q6_K's 16-column
    sub-blocks included: a row's result does not depend on the rows beside it, it is not the bf16 tile's, and
    both int8 terms keep it within a tenth of the one-term bound sum_i |w_i| d(i) / 2 and far closer to the
    exact product than one term."""
    import ctypes as ct

    import torch

    from tokenloom.kernels import quant_gemm as qg

    n, k = 45, 768
    raw = _quant_matrix(qtype, n, k, seed=9)
    w = qg.dequantize(raw).double()  # the gguf package's
    qm = qg.prepare(raw)
    x = torch.randn(64, k, generator=torch.Generator().manual_seed(9)).bfloat16()
    ref = x.double() @ w.T
    lib = qg._native()
    batch, residual = lib.quant_batch_m(ct.c_int(-1)), lib.quant_batch_residual(ct.c_int(-1))
    tile_from = lib.quant_tile_m(ct.c_int(-1))
    try:
        lib.quant_batch_m(ct.c_int(1))  # the default without AMX
        lib.quant_tile_m(ct.c_int(0))  # at every row count
        assert lib.quant_path(qtype, 64, k, 0) == 2 and lib.quant_path(qtype, 13, k, 0) == 2
        got = qg.linear(x, qm, out_dtype=torch.float32)
        assert torch.equal(qg.linear(x[20:33], qm, out_dtype=torch.float32), got[20:33])
        lib.quant_batch_residual(ct.c_int(0))
        one_term = qg.linear(x, qm, out_dtype=torch.float32)
        lib.quant_batch_m(ct.c_int(0))
        tile = qg.linear(x, qm, out_dtype=torch.float32)
    finally:
        lib.quant_batch_m(ct.c_int(batch))
        lib.quant_batch_residual(ct.c_int(residual))
        lib.quant_tile_m(ct.c_int(tile_from))
    d = x.double().abs().view(64, k // 32, 32).amax(-1) / 127
    bound = (d.repeat_interleave(32, dim=1) / 2) @ w.abs().T + 1e-5 * (x.double().abs() @ w.abs().T) + 1e-6
    assert residual == 1 and not torch.equal(got, tile)
    assert bool(((one_term.double() - ref).abs() <= bound).all())
    assert bool(((got.double() - ref).abs() <= bound / 10).all())
    rel = lambda a: float((a.double() - ref).norm() / ref.norm())  # noqa: E731
    assert 0 < rel(got) < rel(one_term) / 30 and rel(one_term) < 0.02, (rel(got), rel(one_term))


@public
@pytest.mark.parametrize("qtype", [Q4_K, Q5_K, Q6_K])
def test_row_stream_equals_the_row_tiles(qtype):
    """The row-sequential stream (each weight row read whole in turn, rows shorter than a page) does the
    tiles' arithmetic in the tiles' order: bit-identical at 1-3 rows (2-6 int8 rows: one pass of the stream
    and two) over a row count that ends in a partial tile; rows of a page or more (k = 8192) keep the tiles."""
    import ctypes as ct

    import torch

    from tokenloom.kernels import quant_gemm as qg

    lib = qg._native()
    default = lib.quant_seq_m(ct.c_int(-1))
    for n, k in ((37, 1280), (9, 8192)):
        raw = _quant_matrix(qtype, n, k, seed=qtype + k)
        qm = qg.prepare(raw)
        x = torch.randn(3, k, generator=torch.Generator().manual_seed(k)).bfloat16()
        got = {}
        try:
            for rows in (0, 16):
                assert lib.quant_seq_m(ct.c_int(rows)) == rows
                got[rows] = [qg.linear(x[:m], qm, out_dtype=torch.float32) for m in (1, 2, 3)]
        finally:
            lib.quant_seq_m(ct.c_int(default))
        for a, b in zip(got[0], got[16], strict=True):
            assert torch.equal(a, b)
        ref = x.float() @ qg.dequantize(raw).T  # the gguf package's
        assert float((got[16][2] - ref).norm() / ref.norm()) < 0.01


BUILDS = {  # csrc/quant_kquants.c built alone: the fallback every CPU gets, and the AVX-512 kernels without GFNI
    "portable": ["-mno-avx512f"],
    "no_gfni": ["-march=native", "-mno-gfni"],
}


@pytest.fixture(scope="module", params=sorted(BUILDS))
def other_build(request, tmp_path_factory):
    """csrc/quant_kquants.c built alone with the flags of `BUILDS[name]` (no_gfni: the AVX-512 kernels as on a
    CPU without GFNI, where the CPU has AVX-512 at all)."""
    import os
    import shutil
    import subprocess

    from tokenloom.kernels.cpu_build import CSRC

    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler")
    target = str(tmp_path_factory.mktemp("kq") / f"kq_{request.param}.so")
    subprocess.run([cc, "-O2", "-fopenmp", "-fPIC", "-shared", "-std=c11", *BUILDS[request.param],
                    os.path.join(CSRC, "quant_kquants.c"), "-o", target], check=True)
    return ctypes.CDLL(target)


@pytest.mark.parametrize("qtype", [Q4_K, Q5_K, Q6_K])
def test_other_builds(other_build, qtype):
    n, k, m = 9, 512, 3
    data = make_blocks(qtype, n, k, seed=77)
    w = reference_weights(qtype, data, k)
    x = np.random.default_rng(3).standard_normal((m, k)).astype(np.float32)
    q, d, s = quantize_activations(x)
    packed = prepared(qtype, data, k, lib=other_build)
    deq = kernel_dequant(qtype, packed, k, lib=other_build)
    assert np.array_equal(packed, prepared(qtype, data, k))  # the same re-layout as the native build
    assert np.array_equal(deq.view(np.uint32), w.view(np.uint32))
    for rows in (1, m):  # the row stream and the tiles
        got = kernel_dot(qtype, packed, q[:rows], d[:rows], s[:rows], lib=other_build).astype(np.float64)
        seen = q[:rows].astype(np.float64) * np.repeat(d[:rows].astype(np.float64), 32, axis=1)
        scale = np.abs(seen) @ np.abs(w.astype(np.float64)).T
        assert np.all(np.abs(got - seen @ w.astype(np.float64).T) <= 1e-5 * scale)


@avx512_paths
@pytest.mark.parametrize("qtype", [Q4_K, Q5_K, Q6_K])
def test_batched_rows_sum_their_two_terms_as_one(qtype):
    """At 2-11 activation rows each row's two int8 terms go through as a pair too (kq_pairs_dot; quant_act_pairs(1)
    keeps them apart past one row): every super-block decoded once for all pairs, the prepared activations in
    chunks of super-blocks (k = 1280 at 8 pairs: two chunks; k = 4096: several at every count). Only float32
    rounding separates the two, and both stay within the two terms' bound: tests/act_pairs.py's check."""
    import torch

    from tests.act_pairs import PAIRS_ONE_ROW, check_row_pairs
    from tokenloom.kernels import quant_gemm as qg

    for n, k in ((37, 1280), (9, 4096)):
        qm = qg.prepare(_quant_matrix(qtype, n, k, seed=qtype + 5 * k))
        gen = torch.Generator().manual_seed(k + 2)
        for m in (2, 3, 5, 8, 9, 11):
            check_row_pairs(qm, torch.randn(m, k, generator=gen).bfloat16(), PAIRS_ONE_ROW)


@avx512_paths
@pytest.mark.parametrize("qtype", [Q4_K, Q5_K, Q6_K])
def test_one_row_sums_its_two_terms_as_one(qtype):
    """At one activation row the two int8 terms reach the kernels as a pair (128 dot0 + dot1, scaled once; on
    by default, quant_act_pairs(0) keeps them apart), over the row stream (k = 1280, a partial last tile) and
    the tiles (k = 8192): tests/act_pairs.py's check."""
    import torch

    from tests.act_pairs import check_one_row_pairs
    from tokenloom.kernels import quant_gemm as qg

    for n, k in ((37, 1280), (9, 8192)):
        qm = qg.prepare(_quant_matrix(qtype, n, k, seed=qtype + 3 * k))
        check_one_row_pairs(qm, torch.randn(1, k, generator=torch.Generator().manual_seed(k + 1)).bfloat16())
