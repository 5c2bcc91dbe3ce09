"""The native row-wise kernels (RMSNorm + residual, SiLU-and-mul, rotary) against the torch expressions they
replace, in float32 and bfloat16, with strided rows as the packed qkv / gate_up outputs give them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenloom.kernels import cpu_ops
from tokenloom.layers.rotary import RotaryEmbedding

pytestmark = pytest.mark.skipif(not cpu_ops.available(torch.zeros(1)),
                                reason="native kernels unavailable (no C compiler)")

# float32: only summation order differs; bfloat16: the torch expressions round intermediates to bf16, the
# kernels round once, so they may differ by a couple of bf16 ulps.
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}
DTYPES = [torch.float32, torch.bfloat16]


def _randn(*shape, dtype, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _close(a, b, dtype):
    assert a.dtype == b.dtype == dtype and a.shape == b.shape
    assert (a.float() - b.float()).abs().max().item() <= TOL[dtype] * max(1.0, b.float().abs().max().item())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_rms_norm_with_and_without_residual(dtype, rows):
    hidden, eps = 576, 1e-5
    x = _randn(rows, hidden, dtype=dtype, seed=1)
    res = _randn(rows, hidden, dtype=dtype, seed=2)
    w = _randn(hidden, dtype=dtype, seed=3)
    _close(cpu_ops.rms_norm(x, w, eps), F.rms_norm(x, (hidden,), w, eps), dtype)
    out, res_out = cpu_ops.rms_norm(x, w, eps, res)
    summed = x + res
    assert torch.equal(res_out, summed)  # the residual sum is rounded once, like torch's add
    _close(out, F.rms_norm(summed, (hidden,), w, eps), dtype)


@pytest.mark.parametrize("rows", [1, 7, 300])
def test_rms_norm_float32_residual_under_bf16(rows):
    """The decoder's residual stream is float32 under a bf16 model: the sum is kept and normalized unrounded,
    and matches the modular path's torch fallback (`RMSNorm` without native kernels)."""
    from tokenloom.layers.norm import RMSNorm

    hidden, eps = 576, 1e-5
    x = _randn(rows, 2 * hidden, dtype=torch.bfloat16, seed=6)[:, hidden:]  # strided rows, as a packed output
    res = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(7))  # float32, off the bf16 grid
    w = _randn(hidden, dtype=torch.bfloat16, seed=8)
    out, res_out = cpu_ops.rms_norm(x, w, eps, res)
    exact = x.double() + res.double()
    assert res_out.dtype == torch.float32 and out.dtype == torch.bfloat16
    assert torch.allclose(res_out.double(), exact, rtol=0, atol=1e-6)  # one float32 rounding of an exact sum
    assert (res_out != res_out.bfloat16().float()).any()  # not rounded to bf16
    ref = (exact * torch.rsqrt(exact.pow(2).mean(-1, keepdim=True) + eps) * w.double()).bfloat16()
    assert (out.float() - ref.float()).abs().max().item() <= 2 ** -7 * ref.float().abs().max().item()
    norm = RMSNorm(hidden, eps, torch.bfloat16)
    norm.weight.data.copy_(w)
    fallback_out, fallback_res = _torch_rms_norm(norm, x, res)
    assert torch.equal(fallback_res, res_out)
    _close(fallback_out, out, torch.bfloat16)


def _torch_rms_norm(norm, x, residual):
    """RMSNorm's torch expression (what runs where the native kernels are unavailable)."""
    import unittest.mock

    with unittest.mock.patch.object(cpu_ops, "available", return_value=False):
        return norm(x, residual)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_strided_input(dtype):
    packed = _randn(5, 2 * 64, dtype=dtype, seed=4)
    x = packed[:, 64:]
    w = _randn(64, dtype=dtype, seed=5)
    _close(cpu_ops.rms_norm(x, w, 1e-6), F.rms_norm(x.contiguous(), (64,), w, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 64])
def test_silu_and_mul(dtype, rows):
    x = _randn(rows, 2 * 1536, dtype=dtype, seed=6) * 4
    gate, up = x.float().chunk(2, dim=-1)
    _close(cpu_ops.silu_and_mul(x), (F.silu(gate) * up).to(dtype), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_at_extreme_gates_is_never_nan(dtype):
    """Gates far below zero, where e^-gate overflows float32 (from about -88.7): silu is -0 there, not NaN (the
    fast-math division by infinity made NaN), and every other gate is unchanged; 64 columns so the vector loop
    runs."""
    gates = torch.tensor([-1e30, -1e4, -1000.0, -100.0, -89.0, -88.5, -88.0, -50.0, 0.0, 3.0, 100.0, 1e4] * 8)
    x = torch.cat([gates, torch.full_like(gates, 3.0)]).unsqueeze(0).to(dtype)
    gate, up = x.float().chunk(2, dim=-1)
    got = cpu_ops.silu_and_mul(x)
    assert not torch.isnan(got).any()
    _close(got, (F.silu(gate) * up).to(dtype), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rope_in_place_on_packed_qkv(dtype, head_dim):
    heads, kv, tokens = 9, 3, 11
    rotary = RotaryEmbedding(head_dim, 4096, 10000.0, None)
    qkv = _randn(tokens, (heads + 2 * kv) * head_dim, dtype=dtype, seed=7)
    positions = torch.tensor([0, 1, 2, 5, 17, 100, 1000, 4095, 3, 3, 64])
    qk = qkv[:, : (heads + kv) * head_dim].view(tokens, heads + kv, head_dim)
    v_before = qkv[:, (heads + kv) * head_dim:].clone()
    cos = rotary.cos.index_select(0, positions).unsqueeze(1)
    sin = rotary.sin.index_select(0, positions).unsqueeze(1)
    x = qk.float()
    expected = (x * cos + x.roll(head_dim // 2, dims=-1) * sin).to(dtype)
    assert cpu_ops.rope_(qk, positions, rotary.cos, rotary.sin)
    _close(qk, expected, dtype)
    assert torch.equal(qkv[:, (heads + kv) * head_dim:], v_before)  # v untouched


def test_rope_declines_non_contiguous_heads():
    rotary = RotaryEmbedding(64, 128, 10000.0, None)
    x = torch.randn(4, 64, 3).transpose(1, 2)  # heads not contiguous per token
    before = x.clone()
    assert not cpu_ops.rope_(x, torch.arange(4), rotary.cos, rotary.sin)
    assert torch.equal(x, before)


def test_rotary_apply_matches_torch_path_and_checks_positions():
    rotary = RotaryEmbedding(64, 256, 500000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    x = _randn(6, 4, 64, dtype=torch.float32, seed=8)
    step = rotary.lookup(torch.tensor([0, 3, 9, 100, 200, 255]), torch.float32)
    cos, sin = step.cos_sin()
    expected = torch.addcmul(x * cos, x.roll(32, dims=-1), sin)
    got = RotaryEmbedding.apply(x.clone(), step)
    _close(got, expected, torch.float32)
    with pytest.raises(ValueError, match="context length"):
        rotary.lookup(torch.tensor([256]), torch.float32)


def test_argmax_matches_torch_including_ties_nan_and_infinities():
    g = torch.Generator().manual_seed(9)
    x = torch.randn(12, 5000, generator=g)
    x[1, 7] = x[1, 4000] = 100.0  # tie: the first index wins
    x[2, :] = float("-inf")  # all -inf: index 0
    x[3, 10] = float("inf")
    x[3, 20] = float("inf")
    x[4, 300] = float("nan")  # a NaN wins, the first one
    x[4, 200] = float("nan")
    x[4, 10] = float("inf")
    x[5, 4999] = 50.0  # maximum in the last column
    x[6, :] = 0.0
    x[6, 3] = -0.0
    x[7, 0] = float("nan")
    assert torch.equal(cpu_ops.argmax(x), torch.argmax(x, dim=-1))
    wide = torch.randn(3, 2 * 777, generator=g)[:, 777:]  # strided rows
    assert torch.equal(cpu_ops.argmax(wide), torch.argmax(wide, dim=-1))
    one = torch.randn(4, 1, generator=g)
    assert torch.equal(cpu_ops.argmax(one), torch.zeros(4, dtype=torch.int64))


def test_greedy_sampling_uses_the_same_argmax():
    from tokenloom.layers.sampler import greedy_argmax

    x = torch.randn(64, 49152, generator=torch.Generator().manual_seed(10))
    assert torch.equal(greedy_argmax(x), torch.argmax(x, dim=-1))
    assert torch.equal(greedy_argmax(x.double()), torch.argmax(x.double(), dim=-1))  # torch fallback


@pytest.mark.parametrize("rows", [1, 5, 300])
def test_qk_head_norm_in_transformers_order(rows):
    """Qwen3's per-head q/k RMSNorm in place on packed bf16 qkv rows (strided, v heads after q and k): equal to
    transformers' expression (normalize in float32, round to bf16, scale by the weight, round again) within a
    bf16 ulp of the normalized value, and the v heads untouched."""
    heads, kv_heads, d, eps = 4, 2, 32, 1e-6
    width = (heads + 2 * kv_heads) * d
    qkv = _randn(rows, width + 16, dtype=torch.bfloat16, seed=7)[:, :width]  # rows 16 elements apart
    q_w, k_w = _randn(d, dtype=torch.bfloat16, seed=8), _randn(d, dtype=torch.bfloat16, seed=9)

    def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        x = x.float()
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(torch.bfloat16)

    q = reference(qkv[:, : heads * d].reshape(rows, heads, d), q_w)
    k = reference(qkv[:, heads * d: (heads + kv_heads) * d].reshape(rows, kv_heads, d), k_w)
    v = qkv[:, (heads + kv_heads) * d:].clone()
    assert cpu_ops.qk_head_norm_(qkv, heads, kv_heads, d, q_w, k_w, eps)
    for got, want in ((qkv[:, : heads * d].reshape(rows, heads, d), q),
                      (qkv[:, heads * d: (heads + kv_heads) * d].reshape(rows, kv_heads, d), k)):
        ulps = (got.float() - want.float()).abs() / want.float().abs().clamp_min(1e-3)
        assert ulps.max().item() <= 2 ** -7  # at most one bf16 rounding step apart
        assert (got != want).float().mean().item() < 0.02  # nearly always the same bf16
    assert torch.equal(qkv[:, (heads + kv_heads) * d:], v)
    assert not cpu_ops.qk_head_norm_(qkv.float(), heads, kv_heads, d, q_w, k_w, eps)  # float32: the torch path
