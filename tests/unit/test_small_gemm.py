"""The native small-M bf16 linear kernel (csrc/small_gemm.c) against a float32 reference, and the dispatch in
`cpu_gemm.linear`."""

from __future__ import annotations

import pytest
import torch

from tokenloom.layers import cpu_gemm

pytestmark = pytest.mark.skipif(cpu_gemm._small_gemm() is None,
                                reason="no AVX512-BF16 or no C compiler: the streaming kernel is not built")


def _data(m, n, k, seed, bias):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.bfloat16) if bias else None
    return x, w, b


@pytest.mark.parametrize("m", [1, 2, 5, 8])
@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (37, 64), (16, 32), (1, 96)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_float32_reference(m, n, k, bias):
    x, w, b = _data(m, n, k, m * 1000 + n + k, bias)
    got = cpu_gemm.small_linear(x, w, b)
    ref = x.float() @ w.float().T + (0 if b is None else b.float())
    assert got is not None and got.dtype == torch.bfloat16 and got.shape == (m, n)
    # products exact, float32 sums: the only error is the final rounding to bf16 (2^-8 relative)
    assert torch.allclose(got.float(), ref, rtol=2 ** -8, atol=1e-3)


def test_strided_rows_and_declined_shapes():
    x, w, _ = _data(3, 48, 64, 1, False)
    wide = torch.cat([x, x], dim=1)[:, 64:]  # rows with stride 128
    assert torch.equal(cpu_gemm.small_linear(wide, w), cpu_gemm.small_linear(x.contiguous(), w))
    assert cpu_gemm.small_linear(x[:, :48].contiguous(), w[:, :48].contiguous()) is None  # K % 32 != 0
    assert cpu_gemm.small_linear(torch.randn(9, 64).bfloat16(), w) is None  # too many rows
    assert cpu_gemm.small_linear(x.float(), w.float()) is None  # bf16 only


def test_linear_dispatch_same_as_onednn_within_rounding():
    x, w, b = _data(1, 960, 576, 7, True)
    packed = cpu_gemm.pack_weight(w)
    if packed is None:
        pytest.skip("oneDNN bf16 unavailable")
    fast = cpu_gemm.linear(x, w, packed, b)
    onednn = torch.ops.mkldnn._linear_pointwise(x, packed.onednn, b, "none", [], "")
    assert (fast.float() - onednn.float()).abs().max().item() <= 2 ** -7 * onednn.float().abs().max().item()
    rows = cpu_gemm.AMX_M_MAX + 1 if packed.amx is not None else cpu_gemm.SMALL_M_MAX + 1
    batch = cpu_gemm.linear(x.expand(rows, -1).contiguous(), w, packed, b)  # above both native kernels: oneDNN
    assert torch.equal(batch[0], onednn[0])


@pytest.mark.parametrize("m", [1, 2, 5, 6, 7, 13, 64])
@pytest.mark.parametrize("n,k", [(960, 576), (37, 64), (1, 96), (100, 2)])
def test_float32_output_is_unrounded_sums(m, n, k):
    """The LM head's kernel (csrc/pair_gemm.c, or AMX): float32 sums of exact bf16 products, never rounded to
    bf16, at any row count (full and partial 6-row bands, full and partial 4-block feature groups)."""
    x, w, _ = _data(m, n, k, m * 7 + n + k, False)
    packed = cpu_gemm.pack_weight(w, onednn=False)
    got = cpu_gemm.native_linear_f32(x, w, packed)
    ref = x.double() @ w.double().T
    assert got is not None and got.dtype == torch.float32 and got.shape == (m, n)
    # only float32 summation order differs from the exact sums: far below bf16's 2^-8 rounding
    assert torch.allclose(got.double(), ref, rtol=1e-5, atol=1e-5)
    if m * n >= 8:
        assert (got != got.bfloat16().float()).any()  # values off the bf16 grid survive
    # a row's logits do not depend on how many rows share the call
    assert torch.equal(got[:1], cpu_gemm.native_linear_f32(x[:1].contiguous(), w, packed))
    strided = torch.cat([x, x], dim=1)[:, k:]
    assert torch.equal(cpu_gemm.native_linear_f32(strided, w, packed), got)


def test_float32_output_declines_what_it_cannot_run():
    x, w, _ = _data(3, 48, 64, 1, False)
    assert cpu_gemm.native_linear_f32(x, w, None) is None  # no packed copy
    assert cpu_gemm.native_linear_f32(x.float(), w, cpu_gemm.pack_weight(w, onednn=False)) is None  # bf16 only
    assert cpu_gemm.pack_weight(w.float(), onednn=False) is None


def test_lm_head_returns_float32_logits_off_the_bf16_grid():
    from tokenloom.distributed.parallel_state import SINGLE_PROCESS
    from tokenloom.layers.embedding import ParallelLMHead, VocabParallelEmbedding

    emb = VocabParallelEmbedding(300, 64, SINGLE_PROCESS, torch.bfloat16)
    x, w, _ = _data(5, 300, 64, 3, False)
    emb.weight.data.copy_(w)
    head = ParallelLMHead(emb, True, SINGLE_PROCESS, torch.bfloat16)
    head.prepare_for_inference()
    assert head.packed is not None and head.weight_f32 is None  # the native kernel, no float32 copy
    logits = head(x)
    assert logits.dtype == torch.float32 and logits.shape == (5, 300)
    assert torch.allclose(logits.double(), x.double() @ w.double().T, rtol=1e-5, atol=1e-5)
    head.packed, head.weight_f32 = None, w.float()  # where no native kernel runs: the float32 copy
    assert torch.allclose(head(x).double(), x.double() @ w.double().T, rtol=1e-5, atol=1e-5)
