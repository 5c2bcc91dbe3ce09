"""The native paged decode kernel against a plain torch reference (per request, per head), in float32 and
bfloat16, with GQA groups, head dims 64/128/other, ragged lengths, scattered slots, long requests split
into chunks, strided (packed qkv) inputs and the fused write of the step's new K/V rows."""

from __future__ import annotations

import ctypes

import pytest
import torch

from tests.avx2_subprocess import has_avx2, run_avx2
from tokenloom.kernels import paged_attention

pytestmark = pytest.mark.skipif(not paged_attention.available(torch.float32, 4, 64),
                                reason="native kernels unavailable (no C compiler)")

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def _reference(q, k, v, indptr, indices, scale):
    batch, num_heads, dim = q.shape
    num_kv = k.shape[0]
    group = num_heads // num_kv
    out = torch.zeros(batch, num_heads, dim)
    for b in range(batch):
        slots = indices[indptr[b]:indptr[b + 1]]
        for h in range(num_heads):
            keys = k[h // group, slots].float()
            vals = v[h // group, slots].float()
            p = torch.softmax(keys @ q[b, h].float() * scale, dim=0)
            out[b, h] = p @ vals
    return out.view(batch, -1)


def _case(dtype, num_heads, num_kv, dim, lens, seed, rows=None):
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor(lens)
    rows = rows or int(lens.sum()) + 64
    k = torch.randn(num_kv, rows, dim, generator=g).to(dtype)
    v = torch.randn(num_kv, rows, dim, generator=g).to(dtype)
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int64)
    indptr[1:] = lens.cumsum(0)
    indices = torch.randperm(rows - 1, generator=g)[: int(indptr[-1])] + 1
    q = torch.randn(len(lens), num_heads, dim, generator=g).to(dtype)
    return q, k, v, indptr, indices


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv", [(4, 4), (8, 2), (9, 3), (16, 1), (12, 1)])
@pytest.mark.parametrize("dim", [64, 128, 48])
def test_matches_reference(dtype, num_heads, num_kv, dim):
    q, k, v, indptr, indices = _case(dtype, num_heads, num_kv, dim, [1, 7, 130, 33, 300, 2, 16, 17],
                                     num_heads * 7 + num_kv + dim)
    out = paged_attention.decode(q, k, v, indptr, indices, dim ** -0.5)
    ref = _reference(q, k, v, indptr, indices, dim ** -0.5)
    assert out.dtype == dtype and out.shape == (q.shape[0], num_heads * dim)
    assert (out.float() - ref).abs().max().item() < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens", [[3000], [2500, 700]])
def test_long_requests_split_into_chunks(dtype, lens):
    """One or two requests with many slots: the work is split across threads and merged."""
    previous = torch.get_num_threads()
    torch.set_num_threads(max(2, previous))
    try:
        q, k, v, indptr, indices = _case(dtype, 9, 3, 64, lens, 5)
        out = paged_attention.decode(q, k, v, indptr, indices, 0.125)
    finally:
        torch.set_num_threads(previous)
    ref = _reference(q, k, v, indptr, indices, 0.125)
    assert (out.float() - ref).abs().max().item() < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_kv_write_from_packed_qkv(dtype):
    """q, k, v as views of one packed [B, (Hq + 2 Hkv) * D] tensor; k/v are stored at out_loc first."""
    num_heads, num_kv, dim = 9, 3, 64
    q0, k, v, indptr, indices = _case(dtype, num_heads, num_kv, dim, [5, 40, 1, 77], 11)
    batch = q0.shape[0]
    packed = torch.randn(batch, (num_heads + 2 * num_kv) * dim).to(dtype)
    q = packed[:, : num_heads * dim].view(batch, num_heads, dim)
    k_new = packed[:, num_heads * dim: (num_heads + num_kv) * dim].view(batch, num_kv, dim)
    v_new = packed[:, (num_heads + num_kv) * dim:].view(batch, num_kv, dim)
    out_loc = indices[indptr[1:] - 1]  # each request's last slot is the new token's
    k_before, v_before = k.clone(), v.clone()
    out = paged_attention.decode(q, k, v, indptr, indices, 0.125, k_new=k_new, v_new=v_new, out_loc=out_loc)
    k_before[:, out_loc] = k_new.transpose(0, 1)
    v_before[:, out_loc] = v_new.transpose(0, 1)
    assert torch.equal(k, k_before) and torch.equal(v, v_before)
    ref = _reference(q, k, v, indptr, indices, 0.125)
    assert (out.float() - ref).abs().max().item() < TOL[dtype]


def test_empty_request_gives_zeros():
    q, k, v, indptr, indices = _case(torch.float32, 4, 2, 64, [0, 10], 3)
    out = paged_attention.decode(q, k, v, indptr, indices, 0.125)
    assert torch.equal(out[0], torch.zeros_like(out[0]))


def test_limits_reported():
    assert not paged_attention.available(torch.float32, 64, 64)
    assert not paged_attention.available(torch.float16, 4, 64)


def test_dot_product_path_without_amx():
    """bf16 at head_dim 64 runs on the AMX tile unit where it is available; the AVX512-BF16 dot-product path
    it otherwise takes is checked here in a process with AMX turned off (TOKENLOOM_DISABLE_AMX=1)."""
    import os
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from tests.unit.test_paged_attention_kernel import TOL, _case, _reference\n"
        "from tokenloom.kernels import paged_attention\n"
        "for heads, kv in ((9, 3), (8, 1)):\n"
        "    q, k, v, indptr, indices = _case(torch.bfloat16, heads, kv, 64, [1, 7, 130, 33, 300, 2, 16, 17], 3)\n"
        "    out = paged_attention.decode(q, k, v, indptr, indices, 0.125)\n"
        "    ref = _reference(q, k, v, indptr, indices, 0.125)\n"
        "    assert (out.float() - ref).abs().max().item() < TOL[torch.bfloat16]\n"
        "print('ok')\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, TOKENLOOM_DISABLE_AMX="1", PYTHONPATH=root)
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stdout + result.stderr


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bulk_kv_prefetch_changes_no_result(dtype):
    """A call whose K/V is small asks for all of it at its start (`attn_bulk_prefetch`, bytes): results are
    bit-identical with it off and on, over ragged requests (an empty one, one split into chunks) on two
    threads; the setter reads back what it set."""
    from tokenloom.kernels.paged_attention import _lib

    lib = _lib()
    lib.attn_bulk_prefetch.restype = ctypes.c_int64
    lib.attn_bulk_prefetch.argtypes = [ctypes.c_int64]
    default = lib.attn_bulk_prefetch(-1)
    assert default > 0
    q, k, v, indptr, indices = _case(dtype, 9, 3, 64, [0, 7, 600, 33], 21)
    previous = torch.get_num_threads()
    torch.set_num_threads(max(2, previous))
    got = {}
    try:
        for limit in (0, 1 << 40):
            assert lib.attn_bulk_prefetch(limit) == limit
            got[limit] = paged_attention.decode(q, k, v, indptr, indices, 0.125)
    finally:
        lib.attn_bulk_prefetch(default)
        torch.set_num_threads(previous)
    assert torch.equal(got[0], got[1 << 40])
    ref = _reference(q, k, v, indptr, indices, 0.125)
    assert (got[0].float() - ref).abs().max().item() < TOL[dtype]


@pytest.mark.skipif(not has_avx2(), reason="the CPU has no AVX2/FMA/F16C")
def test_avx2_build_matches_reference():
    """The AVX2 path (CPUs without AVX-512: K rows widened 8 at a time, eight keys' dot products side by side),
    bf16 and float32 K/V, against the same reference: this file's reference tests in a process whose kernels
    are built for AVX2 (on an AVX2-only CPU they are the tests above already)."""
    run_avx2("import pytest\n"
             "assert pytest.main(['-q', '-p', 'no:cacheprovider', 'tests/unit/test_paged_attention_kernel.py', '-k', "
             "'matches_reference and not avx2 or split_into_chunks or fused_kv_write']) == 0")
