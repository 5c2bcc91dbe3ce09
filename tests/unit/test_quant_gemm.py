"""The native quantized-matmul kernels (csrc/quant_gemm.c, csrc/quant_legacy.c behind
tokenloom/kernels/quant_gemm.py) against the `gguf` package's dequantize and a float32 matmul.

Bounds, per output o = sum_i w_i x_i with W the gguf-dequantized weight:
* int8 path (bf16 x, m <= the small-path limit): x is rounded to d * q per 32-block with d = max|x_block| / 127,
  so |err| <= sum_i |w_i| * d(i) / 2 (+ float32 rounding);
* dequantized-tile path, bf16 x: the weight is rounded once to bf16, |err| <= 2^-9 * sum_i |w_i x_i|;
* float32 x: exact weights, float32 sums: |err| <= k * 2^-24 * sum_i |w_i x_i|;
and a bf16 output adds its own rounding, 2^-8 |o|.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch

from tests.act_pairs import check_one_row_pairs
from tests.thread_counts import at_thread_counts
from tokenloom.kernels import quant_gemm as qg

LEGACY = ["Q4_0", "Q4_1", "Q8_0"]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.skipif(not all(qg.native_supported(qg.TYPE_IDS[t]) for t in LEGACY),
                                reason="no AVX2 or no C compiler: the native quantized kernels are not built")

# Paths and switches of the AVX-512 families alone: the AVX2 family (csrc/quant_avx2.c) has one int8 path and
# no re-layout, no pairing, no many-row tile (tests/unit/test_quant_avx2.py checks it).
avx512_paths = pytest.mark.skipif(qg.native_isa() != 2, reason="a path of the AVX-512 quantized kernels only")


def _matrix(name: str, n: int, k: int, seed: int) -> qg.QuantMatrix:
    """Valid random blocks: gguf's own quantizer on random float32 data (with a per-row offset, so Q4_1's mins
    are not all zero)."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * 0.05 + rng.standard_normal((n, 1)) * 0.02).astype(np.float32)
    qtype = qg.TYPE_IDS[name]
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType(qtype))
    return qg.QuantMatrix.from_gguf(qtype, (n, k), raw, f"test.{name}")


def _int8_bound(x: torch.Tensor, w_ref: torch.Tensor) -> torch.Tensor:
    """[m, n]: sum_i |w_i| * d(i) / 2 with d the activation's per-32-block int8 scale."""
    m, k = x.shape
    d = x.float().abs().view(m, k // 32, 32).amax(-1) / 127  # [m, blocks]
    per_col = d.repeat_interleave(32, dim=1)  # [m, k]
    return (per_col / 2) @ w_ref.abs().T


def _expected_error(x: torch.Tensor, w_ref: torch.Tensor, small: bool, ref: torch.Tensor,
                    out_dtype: torch.dtype) -> torch.Tensor:
    k = x.shape[1]
    mag = x.float().abs() @ w_ref.abs().T
    if x.dtype == torch.float32:
        tol = k * 2.0 ** -24 * mag
    elif small:
        tol = _int8_bound(x, w_ref) + 1e-5 * mag
    else:
        tol = 2.0 ** -9 * mag + k * 2.0 ** -24 * mag
    if out_dtype == torch.bfloat16:
        tol = tol + 2.0 ** -8 * ref.abs()
    return tol + 1e-6


def _small_limit() -> int:
    return qg._native().quant_small_m(ctypes.c_int(-1))


def _int8_path(qm: qg.QuantMatrix, m: int, x_dtype: torch.dtype) -> bool:
    """Whether quant_linear takes one of the int8 paths (the small stream, the many-row path, the AVX2 one-term
    tile) here."""
    path = qg._native().quant_path(ctypes.c_int(qm.qtype), ctypes.c_int64(m), ctypes.c_int64(qm.cols),
                                   ctypes.c_int(x_dtype == torch.float32))
    assert path in (0, 1, 2, 3)
    return path in (1, 2, 3)


@pytest.mark.parametrize("name", LEGACY)
@pytest.mark.parametrize("k", [32 * 3, 576, 32 * 12, 32 * 31])
def test_dequantize_bit_exact(name, k):
    qm = _matrix(name, 77, k, 1)
    ref = qg.dequantize(qm)  # the gguf package, file layout
    prepared = qg.prepare(qm)
    assert prepared.packed and prepared.nbytes == qm.nbytes and not torch.equal(prepared.data, qm.data)
    assert torch.equal(qg.dequantize(prepared), ref)
    ids = torch.tensor([[5, 0], [76, 5]])
    assert torch.equal(qg.embedding(ids, prepared, torch.float32), ref[ids])
    assert torch.equal(qg.embedding(ids, prepared, torch.bfloat16), ref[ids].bfloat16())
    assert torch.equal(qg.embedding(ids, qm, torch.float32), ref[ids])  # unprepared: the reference rows


@pytest.mark.parametrize("name", LEGACY)
@pytest.mark.parametrize("m", [1, 3, 4, 64, 130])
@pytest.mark.parametrize("k", [32 * 3, 576, 32 * 12, 32 * 31])
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
def test_linear_within_bound(name, m, k, x_dtype):
    qm = _matrix(name, 77, k, m * 7 + k)
    check_linear_within_bound(qm, qg.dequantize(qm), m, x_dtype, m + k)


def check_linear_within_bound(qm: qg.QuantMatrix, w_ref: torch.Tensor, m: int, x_dtype: torch.dtype,
                              seed: int) -> None:
    """`m` random rows of `x_dtype` through the file-layout `qm` prepared, with and without a bias, into float32
    and x's dtype: within the path's bound (module docstring) of a float32 matmul with `w_ref` (the gguf
    package's dequantize); the matrix unprepared (prepared per call) gives the same numbers."""
    n, k = qm.rows, qm.cols
    prepared = qg.prepare(qm)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(x_dtype)
    bias = torch.randn(n, generator=g).to(x_dtype)
    small = _int8_path(prepared, m, x_dtype)
    for b in (None, bias):
        ref = x.float() @ w_ref.T + (0 if b is None else b.float())
        for out_dtype in (torch.float32, x_dtype):
            got = qg.linear(x, prepared, b, out_dtype)
            assert got.dtype == out_dtype and got.shape == (m, n)
            err = (got.float() - ref).abs()
            tol = _expected_error(x, w_ref, small, ref, out_dtype)
            assert bool((err <= tol).all()), f"max excess {float((err - tol).max())}"
    assert torch.equal(qg.linear(x, qm, bias), qg.linear(x, prepared, bias))


@avx512_paths
def test_int8_error_is_not_vacuous():
    """The int8 bound is met with room, but the int8 path does differ from the exact product (it is the path
    taken), while the tile path at the same rows (small limit 0) stays within bf16 weight rounding; the second
    int8 term (the first one's rounding remainder, on by default) cuts the one-term error by two orders."""
    qm = qg.prepare(_matrix("Q4_1", 256, 576, 3))
    x = torch.randn(1, 576, generator=torch.Generator().manual_seed(3)).bfloat16()
    ref = x.float() @ qg.dequantize(qm).T
    lib = qg._native()
    old, residual = lib.quant_small_m(ctypes.c_int(-1)), lib.quant_act_residual(ctypes.c_int(-1))
    batch = lib.quant_batch_m(ctypes.c_int(-1))
    try:
        two_terms = qg.linear(x, qm, out_dtype=torch.float32)
        lib.quant_act_residual(ctypes.c_int(0))
        one_term = qg.linear(x, qm, out_dtype=torch.float32)
        lib.quant_small_m(ctypes.c_int(0))
        lib.quant_batch_m(ctypes.c_int(0))
        tile = qg.linear(x, qm, out_dtype=torch.float32)
    finally:
        lib.quant_small_m(ctypes.c_int(old))
        lib.quant_act_residual(ctypes.c_int(residual))
        lib.quant_batch_m(ctypes.c_int(batch))
    assert old >= 1 and residual == 1 and not torch.equal(one_term, tile) and not torch.equal(two_terms, one_term)
    rel = lambda a: float((a - ref).norm() / ref.norm())  # noqa: E731
    assert rel(one_term) < 0.02 and rel(tile) < 0.005
    assert 0 < rel(two_terms) < rel(one_term) / 30, (rel(two_terms), rel(one_term))


@avx512_paths
@pytest.mark.parametrize("name", LEGACY)
def test_many_row_int8_path(name):
    """Past the small stream, bf16 x takes the many-row int8 path (csrc/quant_batch.c): a row's result does not
    depend on the rows beside it (the same numbers alone, in 13 rows or in 64), it differs from the bf16 tile
    (so it is the path taken); by default its rows take both int8 terms, within the int8 bound and far closer
    than with one term (quant_batch_residual(0), llama.cpp's Q8 activations, still within the bound); the
    small stream's own switch (quant_act_residual) does not touch this path."""
    n, k = 77, 576
    qm = qg.prepare(_matrix(name, n, k, 21))
    w_ref = qg.dequantize(qm)
    x = torch.randn(64, k, generator=torch.Generator().manual_seed(21)).bfloat16()
    ref = x.float() @ w_ref.T
    lib = qg._native()
    batch, residual = lib.quant_batch_m(ctypes.c_int(-1)), lib.quant_batch_residual(ctypes.c_int(-1))
    small_residual, tile_from = lib.quant_act_residual(ctypes.c_int(-1)), lib.quant_tile_m(ctypes.c_int(-1))
    try:
        lib.quant_batch_m(ctypes.c_int(1))  # the default without AMX (test_tile_path_without_amx checks it)
        lib.quant_tile_m(ctypes.c_int(0))  # at every row count (the default where vdpbf16ps lags vpdpbusd)
        assert lib.quant_path(qm.qtype, 64, k, 0) == 2 and lib.quant_path(qm.qtype, 13, k, 0) == 2
        got = qg.linear(x, qm, out_dtype=torch.float32)
        assert torch.equal(qg.linear(x[:13], qm, out_dtype=torch.float32), got[:13])
        assert torch.equal(qg.linear(x[20:33], qm, out_dtype=torch.float32), got[20:33])
        lib.quant_act_residual(ctypes.c_int(1 - small_residual))
        assert torch.equal(qg.linear(x, qm, out_dtype=torch.float32), got)
        lib.quant_act_residual(ctypes.c_int(small_residual))
        lib.quant_batch_residual(ctypes.c_int(0))
        one_term = qg.linear(x, qm, out_dtype=torch.float32)
        assert torch.equal(qg.linear(x[20:33], qm, out_dtype=torch.float32), one_term[20:33])
        lib.quant_batch_residual(ctypes.c_int(residual))
        lib.quant_batch_m(ctypes.c_int(0))
        tile = qg.linear(x, qm, out_dtype=torch.float32)
    finally:
        lib.quant_batch_m(ctypes.c_int(batch))
        lib.quant_batch_residual(ctypes.c_int(residual))
        lib.quant_act_residual(ctypes.c_int(small_residual))
        lib.quant_tile_m(ctypes.c_int(tile_from))
    assert residual == 1 and not torch.equal(got, tile)
    assert bool(((got - ref).abs() <= _expected_error(x, w_ref, True, ref, torch.float32)).all())
    assert bool(((one_term - ref).abs() <= _expected_error(x, w_ref, True, ref, torch.float32)).all())
    rel = lambda a: float((a - ref).norm() / ref.norm())  # noqa: E731
    assert rel(tile) < 0.005 and 0 < rel(got) < rel(one_term) / 30 and rel(one_term) < 0.02, (rel(got), rel(one_term))


@avx512_paths
@pytest.mark.parametrize("name", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_many_row_path_in_passes(name, out_dtype):
    """More rows than one pass of the many-row path holds (~384 KiB of activation quants, at least 288 rows) go
    through in several passes, each quantized on its own: every row, in any pass, with a bias, from a strided
    x, into either output dtype, equals that row computed alone (with the same bound as any int8 result)."""
    n, k, m = 70, 576, 700  # 576 columns, two terms: passes of 336 rows -> 336 + 336 + 28
    qm = qg.prepare(_matrix(name, n, k, 31))
    g = torch.Generator().manual_seed(31)
    x = torch.randn(m, 2 * k, generator=g).bfloat16()[:, :k]  # row stride 2k
    bias = torch.randn(n, generator=g)
    lib = qg._native()
    batch, tile_from = lib.quant_batch_m(ctypes.c_int(-1)), lib.quant_tile_m(ctypes.c_int(-1))
    try:
        lib.quant_batch_m(ctypes.c_int(1))
        lib.quant_tile_m(ctypes.c_int(0))
        assert lib.quant_path(qm.qtype, m, k, 0) == 2
        got = qg.linear(x, qm, bias, out_dtype=out_dtype)
        for rows in (slice(0, 13), slice(330, 343), slice(665, 700)):  # pass 1, across passes 1-2, pass 3
            assert torch.equal(qg.linear(x[rows], qm, bias, out_dtype=out_dtype), got[rows])
    finally:
        lib.quant_batch_m(ctypes.c_int(batch))
        lib.quant_tile_m(ctypes.c_int(tile_from))
    w_ref = qg.dequantize(qm)
    ref = x.float() @ w_ref.T + bias
    assert bool(((got.float() - ref).abs() <= _expected_error(x, w_ref, True, ref, out_dtype)).all())


@pytest.mark.parametrize("name", LEGACY)
def test_batched_shapes_and_strides(name):
    qm = qg.prepare(_matrix(name, 33, 64, 5))
    x = torch.randn(2, 3, 128).bfloat16()[..., 64:]  # rows with stride 128
    got = qg.linear(x, qm)
    assert got.shape == (2, 3, 33)
    assert torch.equal(got, qg.linear(x.contiguous(), qm))


def test_bad_shapes_have_clear_errors():
    with pytest.raises(qg.QuantTypeError, match="whole 32-element blocks"):
        qg.QuantMatrix(qg.TYPE_IDS["Q4_0"], 4, 40, torch.zeros(4, 22, dtype=torch.uint8))
    qm = qg.prepare(_matrix("Q8_0", 8, 64, 6))
    with pytest.raises(ValueError, match="input features 96"):
        qg.linear(torch.randn(1, 96).bfloat16(), qm)
    with pytest.raises(ValueError, match="bias"):
        qg.linear(torch.randn(1, 64).bfloat16(), qm, torch.randn(7))
    with pytest.raises(IndexError, match=r"\[0, 8\)"):
        qg.embedding(torch.tensor([8]), qm, torch.float32)
    # the C entry points check too: k not whole blocks, unknown type
    lib = qg._native()
    out = torch.empty(1, 8)
    x = torch.randn(1, 64)
    args = (ctypes.c_void_p(qm.data.data_ptr()), ctypes.c_int64(8), ctypes.c_int64(40),
            ctypes.c_void_p(x.data_ptr()), ctypes.c_int64(64), ctypes.c_int(1), ctypes.c_int64(1),
            ctypes.c_void_p(None), ctypes.c_int(0), ctypes.c_void_p(out.data_ptr()), ctypes.c_int64(8),
            ctypes.c_int(1), ctypes.c_int(1))
    assert lib.quant_linear(ctypes.c_int(8), *args) == -2
    assert lib.quant_linear(ctypes.c_int(1), *args) == -1  # F16 is no quantized type


def test_other_dtypes_take_the_reference():
    qm = _matrix("Q4_0", 16, 64, 8)
    x = torch.randn(2, 64).half()
    ref = (x.float() @ qg.dequantize(qm).T).half()
    assert torch.equal(qg.linear(x, qg.prepare(qm)), ref) and torch.equal(qg.linear(x, qm), ref)


def test_native_args():
    qm = _matrix("Q4_0", 16, 64, 7)
    with pytest.raises(ValueError, match="prepared"):
        qg.native_args(qm)
    p = qg.prepare(qm)
    assert qg.native_args(p) == (qg.TYPE_IDS["Q4_0"], p.data.data_ptr(), 16, 64)


def test_tile_path_without_amx():
    """Where AMX runs, the tile path uses it; TOKENLOOM_DISABLE_AMX=1 (read once per process) forces the
    AVX512-BF16 bands, checked in a fresh process against the same bound; without AMX the many-row int8 path
    is the default (test_many_row_int8_path checks its numbers)."""
    code = (
        "import torch, sys\n"
        "sys.path.insert(0, 'tests/unit')\n"
        "from test_quant_gemm import _matrix, _expected_error, qg\n"
        "assert qg._native().quant_batch_m(-1) == 1  # the int8 many-row path by default without AMX\n"
        "qg._native().quant_batch_m(0)  # the bf16 tile here\n"
        "for name in ('Q4_0', 'Q4_1', 'Q8_0'):\n"
        "    qm = _matrix(name, 77, 576, 11)\n"
        "    w = qg.dequantize(qm)\n"
        "    x = torch.randn(40, 576, generator=torch.Generator().manual_seed(1)).bfloat16()\n"
        "    ref = x.float() @ w.T\n"
        "    got = qg.linear(x, qg.prepare(qm), out_dtype=torch.float32)\n"
        "    assert bool(((got - ref).abs() <= _expected_error(x, w, False, ref, torch.float32)).all()), name\n"
        "print('ok')\n")
    env = {**os.environ, "TOKENLOOM_DISABLE_AMX": "1", "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


@avx512_paths
def test_tile_takes_rows_back_from_the_int8_path():
    """Where vdpbf16ps keeps pace with vpdpbusd (a probe of the two instructions' issue rates, once per process),
    the bf16 tile takes bf16 x back from the many-row int8 path from quant_tile_m rows on (12), else never (0):
    quant_path follows the two settings, the default is one of those two values, and TOKENLOOM_QUANT_TILE_M
    (A/B runs) sets it in a fresh process."""
    lib = qg._native()
    k, qtype = 576, qg.TYPE_IDS["Q4_1"]
    batch, tile_from, small = lib.quant_batch_m(-1), lib.quant_tile_m(-1), lib.quant_small_m(-1)
    assert tile_from in (0, 12)
    try:
        lib.quant_batch_m(1)
        lib.quant_small_m(8)
        lib.quant_tile_m(16)
        assert [lib.quant_path(qtype, m, k, 0) for m in (8, 9, 15, 16, 64, 4096)] == [1, 2, 2, 0, 0, 0]
        assert lib.quant_path(qtype, 64, k, 1) == 0  # float32 x: always the exact tile
        lib.quant_tile_m(0)
        assert [lib.quant_path(qtype, m, k, 0) for m in (9, 16, 4096)] == [2, 2, 2]
        lib.quant_batch_m(0)
        assert [lib.quant_path(qtype, m, k, 0) for m in (9, 4096)] == [0, 0]
    finally:
        lib.quant_batch_m(batch)
        lib.quant_tile_m(tile_from)
        lib.quant_small_m(small)
    code = "from tokenloom.kernels import quant_gemm as qg\nprint(qg._native().quant_tile_m(-1))\n"
    env = {**os.environ, "TOKENLOOM_QUANT_TILE_M": "24", "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "24", proc.stderr[-2000:]


@pytest.mark.parametrize("name", LEGACY)
def test_prefetch_distance_changes_no_result(name):
    """The small-row kernels' software prefetch (csrc/quant_legacy.c, one tile ahead by default, into L2) only
    moves bytes into cache: the results with it off, at one tile and at three, and filling L1 instead of L2, are
    bit-identical, for 1 and 3 rows, over a row count that ends in a partial tile, and the setters read back what
    they set."""
    n, k = 77, 1088  # 34 blocks: two full spans of 16 and a masked one
    qm = qg.prepare(_matrix(name, n, k, 31))
    lib = qg._native()
    default = lib.quant_prefetch(ctypes.c_int(-1))
    default_level = lib.quant_prefetch_l2(ctypes.c_int(-1))
    assert default == 1 and default_level == 1
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(31)).bfloat16()
    got = {}
    try:
        for tiles in (0, 1, 3):
            assert lib.quant_prefetch(ctypes.c_int(tiles)) == tiles
            got[tiles] = [qg.linear(x[:m], qm, out_dtype=torch.float32) for m in (1, 3)]
        assert lib.quant_prefetch(ctypes.c_int(1)) == 1 and lib.quant_prefetch_l2(ctypes.c_int(0)) == 0
        got["l1"] = [qg.linear(x[:m], qm, out_dtype=torch.float32) for m in (1, 3)]
    finally:
        lib.quant_prefetch(ctypes.c_int(default))
        lib.quant_prefetch_l2(ctypes.c_int(default_level))
    for tiles in (1, 3, "l1"):
        for a, b in zip(got[0], got[tiles], strict=True):
            assert torch.equal(a, b)
    ref = x.float() @ qg.dequantize(qm).T
    assert float((got[1][1] - ref).norm() / ref.norm()) < 0.01


@pytest.mark.parametrize("name", LEGACY)
@pytest.mark.parametrize("k", [1088, 32 * 31])
def test_row_stream_equals_the_row_tiles(name, k):
    """The row-sequential stream (each weight row read whole in turn, for rows shorter than a page) does the
    tiles' arithmetic in the tiles' order: bit-identical results at 1-3 rows (2-6 int8 rows: one pass of the
    k-quants' stream and two), over a row count that ends in a partial tile and a masked span (Q4: one group of
    two blocks after the full spans, or one each of 8, 4, 2 and 1); the setter reads back what it set and defaults
    to batch 1's two int8 rows (the k-quants: test_quant_kquants.py)."""
    n = 77
    qm = qg.prepare(_matrix(name, n, k, 41))
    lib = qg._native()
    default = lib.quant_seq_m(ctypes.c_int(-1))
    assert default == 2
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(41)).bfloat16()
    got = {}
    try:
        for rows in (0, 16):
            assert lib.quant_seq_m(ctypes.c_int(rows)) == rows
            got[rows] = [qg.linear(x[:m], qm, out_dtype=torch.float32) for m in (1, 2, 3)]
    finally:
        lib.quant_seq_m(ctypes.c_int(default))
    for a, b in zip(got[0], got[16], strict=True):
        assert torch.equal(a, b)
    assert torch.equal(qg.linear(x[:1], qm, out_dtype=torch.float32), got[16][0])  # the default: the stream
    ref = x.float() @ qg.dequantize(qm).T
    assert float((got[16][2] - ref).norm() / ref.norm()) < 0.01


@pytest.mark.parametrize("name", LEGACY)
def test_small_path_work_items_change_no_result(name):
    """The small path hands each thread a few large items of weight rows (up to 256, rounded to 16) rather than
    many of 16: over 1000 rows (several items, a partial one, a last band of 8) the results at 1, 2 and 3
    threads are bit-identical and within the int8 bound of the float32 reference, for 1 and 3 activation rows."""
    n, k = 1000, 576
    qm = qg.prepare(_matrix(name, n, k, 51))
    w_ref = qg.dequantize(qm)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(51)).bfloat16()
    got = at_thread_counts(lambda: [qg.linear(x[:m], qm, out_dtype=torch.float32) for m in (1, 3)], (1, 2, 3))
    for t in (2, 3):
        for a, b in zip(got[1], got[t], strict=True):
            assert torch.equal(a, b)
    for m, out in zip((1, 3), got[1], strict=True):
        assert _int8_path(qm, m, torch.bfloat16)
        ref = x[:m].float() @ w_ref.T
        tol = _expected_error(x[:m], w_ref, True, ref, torch.float32)
        assert bool(((out - ref).abs() <= tol).all())


@pytest.mark.parametrize("name", LEGACY)
def test_every_tail_length_in_bands(name):
    """The blocks after a row's last full span of 16 (1 to 15 of them) lie in bands of 16 weight rows, lane =
    row, with the rows left over in a narrower last band: every tail length over 35 rows (two bands and a band
    of 3) dequantizes bit-exactly, and the int8 path's outputs (1 and 5 activation rows: the tail pass's one,
    two and four activation rows at a time) stay within its bound of the float32 reference."""
    n = 35
    g = torch.Generator().manual_seed(61)
    x = torch.randn(5, 512 + 32 * 15, generator=g).bfloat16()
    for tail in range(1, 16):
        k = 512 + 32 * tail
        qm = _matrix(name, n, k, 61 + tail)
        w_ref = qg.dequantize(qm)
        prepared = qg.prepare(qm)
        assert torch.equal(qg.dequantize(prepared), w_ref), f"tail of {tail} blocks"
        for m in (1, 5):
            xm = x[:m, :k]
            assert _int8_path(prepared, m, torch.bfloat16)
            ref = xm.float() @ w_ref.T
            got = qg.linear(xm, prepared, out_dtype=torch.float32)
            assert bool(((got - ref).abs() <= _expected_error(xm, w_ref, True, ref, torch.float32)).all()), tail


@avx512_paths
@pytest.mark.parametrize("name", LEGACY)
@pytest.mark.parametrize("n,k", [(77, 576), (21, 32 * 226)])
def test_one_row_sums_its_two_terms_as_one(name, n, k):
    """At one activation row the two int8 terms (the second scaled by exactly 1/128 of the first) reach the
    kernels as a pair, summed as one integer dot product 128 dot0 + dot1 and scaled once (on by default;
    quant_act_pairs(0) keeps them apart): the full spans, the tail pass and the rows left after the last tile,
    over the row stream (k = 576) and the tiles (rows of a page or more). Only float32 rounding separates the
    two (and it does: the paired form is the one taken), and both stay within the two terms' bound,
    sum_i |w_i| d(i) / 256."""
    qm = qg.prepare(_matrix(name, n, k, 71))
    check_one_row_pairs(qm, torch.randn(1, k, generator=torch.Generator().manual_seed(71)).bfloat16())


@avx512_paths
@pytest.mark.parametrize("name", LEGACY)
@pytest.mark.parametrize("n,k", [(77, 576), (21, 32 * 226), (40, 320)])
def test_batched_rows_sum_their_two_terms_as_one(name, n, k):
    """At 2-11 activation rows (batched decode) each row's two int8 terms reach the legacy types' pair tiles
    as a pair too (quant_act_pairs(1) keeps them apart past one row): tiles of two pairs and of the last odd
    one, the weight rows left after the last tile (77 = 4 * 19 + 1), the tail pass (k = 576's two blocks after
    its span), rows of a page or more (k = 7232) and no full span at all (k = 320). Only float32 rounding
    separates the two, and both stay within the two terms' bound."""
    from tests.act_pairs import PAIRS_ONE_ROW, check_row_pairs

    qm = qg.prepare(_matrix(name, n, k, 73))
    gen = torch.Generator().manual_seed(73)
    for m in (2, 3, 5, 8, 9, 11):
        check_row_pairs(qm, torch.randn(m, k, generator=gen).bfloat16(), PAIRS_ONE_ROW)


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_a_non_finite_block_scale_is_refused(name):
    """A block whose f16 scale (or minimum) is NaN or infinite is a malformed block: QuantMatrix.from_gguf refuses
    it naming the tensor, the type, the block and its row (checked on every f16 field of the type), where the
    kernels would have turned it into NaN outputs; the same blocks with finite scales load."""
    from tests.gguf_factory import KQUANT_BYTES, random_kquant

    qtype = qg.TYPE_IDS[name]
    n, k = 6, 512
    if name in KQUANT_BYTES:
        raw = random_kquant(name, n, k, seed=3)
    else:
        w = np.random.default_rng(3).standard_normal((n, k)).astype(np.float32)
        raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType(qtype))
    qg.QuantMatrix.from_gguf(qtype, (n, k), raw, "blk.0.ffn_up.weight")  # valid
    size = qg.QUANT_TYPES[qtype][2]
    per_row = raw.shape[1] // size
    for offset in qg.F16_FIELDS[qtype]:
        for bits in (0x7E00, 0x7C00, 0xFC00):  # NaN, +Inf, -Inf
            bad = raw.copy()
            block = 2 * per_row + 1  # row 2, its second block
            bad[2, size + offset:size + offset + 2] = np.array([bits & 0xFF, bits >> 8], dtype=np.uint8)
            with pytest.raises(qg.QuantTypeError, match=rf"blk\.0\.ffn_up\.weight: malformed {name} block {block} "
                                                         rf"\(row 2\): its f16 field at byte {offset} is"):
                qg.QuantMatrix.from_gguf(qtype, (n, k), bad, "blk.0.ffn_up.weight")
