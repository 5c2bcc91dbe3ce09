"""The grouped MoE layer (layers/moe.py) against a per-token loop written here: each token's top-k experts
run one at a time on that token alone. Also: at batch 1 only the k chosen experts run; TP slices and EP
groups of the experts sum to the whole; quantized (Q8_0) experts equal their dequantized float copies; Q4 experts
in the one-call kernel match their float copies."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tokenloom.distributed.parallel_state import SINGLE_PROCESS, ParallelContext
from tokenloom.kernels.quant_gemm import QuantMatrix, dequantize, native_moe_supported
from tokenloom.layers.moe import FusedMoE, route

E, K, H, INTER = 8, 2, 64, 64


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"router": torch.randn(E, H, generator=g),
            "gate": torch.randn(E, INTER, H, generator=g) * 0.1,
            "up": torch.randn(E, INTER, H, generator=g) * 0.1,
            "down": torch.randn(E, H, INTER, generator=g) * 0.1}


def _layer(w: dict[str, torch.Tensor], renormalize: bool, ctx: ParallelContext = SINGLE_PROCESS,
           dtype: torch.dtype = torch.float32) -> FusedMoE:
    moe = FusedMoE(E, K, H, INTER, renormalize, ctx, dtype)
    moe.load_router("router", w["router"])
    for e in range(E):
        for kind, key in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down")):
            moe.load_expert(f"experts.{e}.{kind}", e, kind, w[key][e])
    moe.prepare_for_inference()
    return moe


def _per_token(x: torch.Tensor, w: dict[str, torch.Tensor], renormalize: bool) -> torch.Tensor:
    out = torch.zeros(x.shape[0], H)
    for t in range(x.shape[0]):
        probs = torch.softmax(w["router"] @ x[t], -1)
        top = torch.topk(probs, K)
        scale = top.values / top.values.sum() if renormalize else top.values
        for p, e in zip(scale.tolist(), top.indices.tolist(), strict=True):
            h = F.silu(w["gate"][e] @ x[t]) * (w["up"][e] @ x[t])
            out[t] += p * (w["down"][e] @ h)
    return out


@pytest.mark.parametrize("renormalize", [True, False])
def test_grouped_equals_per_token_loop(renormalize):
    w = _weights()
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(1))
    moe = _layer(w, renormalize)
    got = moe(x)
    torch.testing.assert_close(got, _per_token(x, w, renormalize), atol=1e-5, rtol=1e-5)
    assert moe.active_experts < E  # 5 tokens x top-2 leave some of the 8 experts without tokens
    moe(x[:1])
    assert moe.active_experts == K  # batch 1 touches only its k experts


def test_bf16_close_to_float32():
    w = _weights()
    x = torch.randn(6, H, generator=torch.Generator().manual_seed(2))
    ref = _per_token(x, w, True)
    got = _layer(w, True, dtype=torch.bfloat16)(x.bfloat16()).float()
    assert (got - ref).abs().max().item() < 0.03 * ref.abs().max().item()


@pytest.mark.parametrize("ep", [1, 2])
def test_tp_slices_and_ep_groups_sum_to_the_whole(ep):
    """Two ranks' unreduced outputs (what the all-reduce sums): slices of every expert (ep 1) or four whole
    experts each (ep 2)."""
    w = _weights()
    x = torch.randn(7, H, generator=torch.Generator().manual_seed(3))
    full = _layer(w, True)
    weights, ids = torch.topk(torch.softmax(x @ w["router"].t(), -1), K)
    weights = weights / weights.sum(-1, keepdim=True)
    parts = [_layer(w, True, ParallelContext(tp_rank=r, tp_size=2, ep_size=ep)) for r in range(2)]
    if ep == 2:
        assert [p.first_expert for p in parts] == [0, 4] and parts[0].w13.shape[0] == 4
    else:
        assert parts[0].w13.shape == (E, INTER, H)  # half of each expert's gate and up rows
    total = sum(p.combine(x, weights, ids) for p in parts)
    torch.testing.assert_close(total, full.combine(x, weights, ids), atol=1e-5, rtol=1e-5)


def _q8(t: torch.Tensor) -> QuantMatrix:
    raw = gguf.quants.quantize(t.numpy().astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    return QuantMatrix.from_gguf(int(gguf.GGMLQuantizationType.Q8_0), tuple(t.shape), raw, "q8")


def test_quantized_experts_equal_their_dequantized_copies():
    """Experts kept as Q8_0 blocks (one QuantMatrix per expert and kind) compute what the same weights
    dequantized by the gguf package compute as floats; the float stacks are dropped."""
    w = _weights()
    x = torch.randn(4, H, generator=torch.Generator().manual_seed(4))
    moe = FusedMoE(E, K, H, INTER, True, ParallelContext(), torch.float32)
    deq = {k: torch.empty_like(v) for k, v in w.items()}
    deq["router"] = w["router"]
    moe.load_router("router", w["router"])
    for e in range(E):
        for kind, key in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down")):
            qm = _q8(w[key][e])
            deq[key][e] = torch.from_numpy(gguf.quants.dequantize(qm.data.numpy(), gguf.GGMLQuantizationType.Q8_0)
                                           .reshape(qm.rows, qm.cols))
            assert torch.equal(dequantize(qm), deq[key][e])
            moe.load_expert(f"experts.{e}.{kind}", e, kind, qm)
    moe.prepare_for_inference()
    assert moe.w13 is None and moe.quant13 is not None and len(moe.quant13) == E
    torch.testing.assert_close(moe(x), _per_token(x, deq, True), atol=1e-5, rtol=0)
    torch.testing.assert_close(moe(x), _layer(deq, True)(x), atol=1e-5, rtol=0)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("tokens", [1, 9, 8200])
def test_native_router_matches_torch(renormalize, tokens):
    """The native router (bf16 rows on the CPU; the one-call decode step runs the same kernel) against torch's
    float32 linear, softmax and top-k: the same experts in the same order, weights within float32 rounding;
    8200 tokens (x 8 experts x 64) take its multi-threaded path."""
    from tokenloom.kernels import quant_gemm
    from tokenloom.layers.moe import route

    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, H, generator=g).bfloat16()
    router = torch.randn(E, H, generator=g)
    if quant_gemm.moe_route(x, router, K, renormalize) is None:
        pytest.skip("native kernels unavailable (no C compiler)")
    weights, ids = route(x, router, K, renormalize)
    probs = torch.softmax(F.linear(x.float(), router), dim=-1)
    want_w, want_ids = torch.topk(probs, K, dim=-1)
    if renormalize:
        want_w = want_w / want_w.sum(-1, keepdim=True)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w, atol=1e-6, rtol=1e-5)


@pytest.mark.skipif(not native_moe_supported(), reason="no native quantized kernels here")
@pytest.mark.parametrize("name", ["Q4_0", "Q4_1"])
def test_q4_experts_in_one_native_call_match_the_float_experts(name):
    """Q4 experts at 512 columns (a full span of 16 blocks: the interleaved layout, with the activations
    reordered once per sub-batch inside the MoE kernel) with bf16 activations: the one-call kernel and the
    expert-by-expert path both match the float experts of the same dequantized weights, and each other."""
    from tokenloom.kernels import quant_gemm

    if quant_gemm.moe_route(torch.zeros(1, 64).bfloat16(), torch.zeros(4, 64), 2, True) is None:
        pytest.skip("native kernels unavailable (no C compiler)")
    experts, hidden, inter, qtype = 4, 512, 512, getattr(gguf.GGMLQuantizationType, name)
    g = torch.Generator().manual_seed(7)
    w = {"router": torch.randn(experts, hidden, generator=g),
         "gate": torch.randn(experts, inter, hidden, generator=g),
         "up": torch.randn(experts, inter, hidden, generator=g),
         "down": torch.randn(experts, hidden, inter, generator=g)}
    moe = FusedMoE(experts, 2, hidden, inter, True, SINGLE_PROCESS, torch.bfloat16)
    moe.load_router("router", w["router"])
    deq = {"router": w["router"]}
    for key in ("gate", "up", "down"):
        deq[key] = torch.empty_like(w[key])
    for e in range(experts):
        for kind, key in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down")):
            raw = gguf.quants.quantize(w[key][e].numpy().astype(np.float32), qtype)
            qm = QuantMatrix.from_gguf(int(qtype), tuple(w[key][e].shape), raw, name)
            deq[key][e] = dequantize(qm)
            moe.load_expert(f"experts.{e}.{kind}", e, kind, qm)
    moe.prepare_for_inference()
    x = torch.randn(5, hidden, generator=g).bfloat16()
    weights, ids = route(x, moe.router, 2, True)
    ref = torch.zeros(5, hidden)
    for t in range(5):
        for p, e in zip(weights[t].tolist(), ids[t].tolist(), strict=True):
            xt = x[t].float()
            ref[t] += p * (deq["down"][e] @ (F.silu(deq["gate"][e] @ xt) * (deq["up"][e] @ xt)))
    native = moe.combine(x, weights, ids)
    moe.use_native = False
    modular = moe.combine(x, weights, ids)
    assert moe.native_tables is not None
    for got in (native, modular):
        assert float((got - ref).norm() / ref.norm()) < 0.01
    assert float((native - modular).norm() / ref.norm()) < 0.01
