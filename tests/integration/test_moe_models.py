"""Mixture-of-experts models (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE) in process against transformers' own
classes on the same weights: float32 logits within 1e-4 with equal argmax (HF folders; llama.cpp-converted
F32 GGUFs); the bf16 default within transformers bf16's own distance; Q8_0 GGUFs kept quantized equal the
same file dequantized by the gguf package (--quantization none), and stay near transformers."""

from __future__ import annotations

import os

import pytest
import torch

from tests.forward_steps import ForwardSteps
from tests.llama_cpp_convert import convert
from tests.moe_factory import FAMILIES, make_tiny_moe
from tokenloom.cache.memory_budget import model_nbytes
from tokenloom.config import ServerArgs
from tokenloom.executor.model_runner import ModelRunner
from tokenloom.kernels.quant_gemm import native_moe_supported
from tokenloom.layers.moe import FusedMoE
from tokenloom.layers.quant_linear import QuantWeight, quantized_weights
from tokenloom.models.gguf_file import GGUFFile

GGUF_FAMILIES = [f for f in FAMILIES if not f.endswith("_mixed")]  # llama.cpp cannot write a mixed Qwen3-MoE
# Q8_0 (experts kept quantized): the shared expert's, and Mixtral's Q/K rows llama.cpp permuted (each
# conversion costs seconds; the expert path itself is the same for every family)
QUANT_FAMILIES = ("qwen2_moe", "mixtral")


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    cache: dict[str, tuple[str, torch.nn.Module]] = {}

    def get(family: str) -> tuple[str, torch.nn.Module]:
        if family not in cache:
            folder = str(tmp_path_factory.mktemp(family))
            cache[family] = (folder, make_tiny_moe(family, folder))
        return cache[family]

    return get


def _prompt(n: int = 29) -> list[int]:
    return torch.randint(3, 49152, (n,), generator=torch.Generator().manual_seed(1)).tolist()


def _logits(path: str, prompt: list[int], **kw) -> tuple[torch.Tensor, ModelRunner]:
    runner = ModelRunner(ServerArgs(model_path=path, max_total_tokens=1024, max_running_requests=4,
                                    **{"dtype": "float32", **kw}))
    steps = ForwardSteps(runner)
    seq = steps.start()
    first = steps.extend([seq], [prompt[:-3]], return_all_logits=True)
    rest = [steps.extend([seq], [[t]]) for t in prompt[-3:]]  # decode steps on the cached prefix
    steps.release(seq)
    return torch.cat([first, *rest]), runner


def _hf_logits(hf: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0].float()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_hf_folder_float32_matches_transformers(moe_model, family):
    folder, hf = moe_model(family)
    prompt = _prompt()
    mine, runner = _logits(folder, prompt)
    ref = _hf_logits(hf, prompt)
    assert (mine - ref).abs().max().item() < 1e-4
    assert torch.equal(mine.argmax(-1), ref.argmax(-1))
    assert runner.native_decode is None  # MoE runs the per-layer step (the one-call step declines it)


def test_bf16_default_within_transformers_bf16_distance(moe_model):
    folder, hf = moe_model("qwen3_moe_mixed")
    prompt = _prompt()
    ref = _hf_logits(hf, prompt)
    mine, _ = _logits(folder, prompt, dtype="bfloat16")
    hf16 = hf.to(torch.bfloat16)
    try:
        theirs = _hf_logits(hf16, prompt)
    finally:
        hf.float()
    assert (mine - ref).abs().max().item() <= 1.5 * (theirs - ref).abs().max().item()


@pytest.fixture(scope="module")
def gguf_files(moe_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("moe_gguf")

    def get(family: str, outtype: str) -> str:
        path = os.path.join(out, f"{family}.{outtype}.gguf")
        if not os.path.exists(path):
            convert(moe_model(family)[0], path, outtype)
        return path

    return get


@pytest.mark.parametrize("family", GGUF_FAMILIES)
def test_gguf_f32_and_q8_0_match(moe_model, gguf_files, family):
    _, hf = moe_model(family)
    prompt = _prompt()
    ref = _hf_logits(hf, prompt)
    mine, _ = _logits(gguf_files(family, "f32"), prompt)
    assert (mine - ref).abs().max().item() < 1e-4
    assert torch.equal(mine.argmax(-1), ref.argmax(-1))
    if family not in QUANT_FAMILIES:
        return
    kept, runner = _logits(gguf_files(family, "q8_0"), prompt)
    moe = next(m for m in runner.model.modules() if isinstance(m, FusedMoE))
    assert moe.w13 is None and all(isinstance(q, QuantWeight) for q in moe.quant13)  # experts stay Q8_0
    # the experts count in the load line and in the memory the weights hold (the KV pool is sized after it)
    model = runner.model
    quant_params, types = quantized_weights(model)
    assert sum(p.numel() for p in model.parameters()) + quant_params == sum(p.numel() for p in hf.parameters())
    reader = GGUFFile(gguf_files(family, "q8_0")).reader
    assert types == {"Q8_0": sum(t.tensor_type.name == "Q8_0" for t in reader.tensors)}  # file tensors, not experts
    rotary = sum(b.numel() * b.element_size() for b in model.buffers())
    file_bytes = sum(int(t.n_bytes) for t in reader.tensors)
    assert 0.9 * file_bytes < model_nbytes(model) - rotary < 1.1 * file_bytes
    dequantized, _ = _logits(gguf_files(family, "q8_0"), prompt, quantization="none")
    assert (kept - dequantized).abs().max().item() < 1e-4
    assert (kept - ref).abs().max().item() < 0.05


@pytest.mark.skipif(not native_moe_supported(), reason="no native quantized kernels here")
def test_native_experts_kernel_matches_dequantized_experts(moe_model, gguf_files, monkeypatch):
    """bf16 activations (the default) over Q8_0 experts take the one-call kernel (csrc/quant_moe.c): per layer
    it equals the dequantized experts computed in float32 far closer than the expert-by-expert path (which
    rounds to bf16 between projections), for 1, 3 and 40 tokens (an expert with more than 8 pairs spans
    sub-batches); the whole model's logits are no further from transformers float32 than with that path."""
    from tokenloom.kernels import quant_gemm
    from tokenloom.layers.moe import route

    _, hf = moe_model("mixtral")
    path = gguf_files("mixtral", "q8_0")
    runner = ModelRunner(ServerArgs(model_path=path, max_total_tokens=1024, max_running_requests=4))
    moes = [m for m in runner.model.modules() if isinstance(m, FusedMoE)]
    assert moes and all(m.native_tables is not None for m in moes)
    moe, gen = moes[0], torch.Generator().manual_seed(3)
    for tokens in (1, 3, 40):
        x = torch.randn(tokens, moe.hidden_size, generator=gen).bfloat16()
        weights, ids = route(x, moe.router, moe.top_k, moe.renormalize)
        ref = torch.zeros(tokens, moe.hidden_size)
        for t in range(tokens):
            for j in range(moe.top_k):
                e = int(ids[t, j])
                gate_up = x[t].float() @ quant_gemm.dequantize(moe.quant13[e].segments[0].weight).float().T
                act = torch.nn.functional.silu(gate_up[:moe.inter_local]) * gate_up[moe.inter_local:]
                ref[t] += weights[t, j] * (act @ quant_gemm.dequantize(moe.quant2[e].segments[0].weight).float().T)
        moe.use_native = True
        native = moe.combine(x, weights, ids)
        assert moe.active_experts == len(set(ids.flatten().tolist()))
        moe.use_native = False
        modular = moe.combine(x, weights, ids)
        moe.use_native = True
        err_native, err_modular = (float((v - ref).norm() / ref.norm()) for v in (native, modular))
        assert err_native < 1e-3 and err_native < err_modular / 4, (tokens, err_native, err_modular)
    prompt = _prompt()
    ref_logits = _hf_logits(hf, prompt)
    native, _ = _logits(path, prompt, dtype="bfloat16")
    monkeypatch.setattr(FusedMoE, "_native_expert_tables", lambda self: None)
    modular, _ = _logits(path, prompt, dtype="bfloat16")
    native_err, modular_err = ((v - ref_logits).abs().max().item() for v in (native, modular))
    assert native_err <= 1.1 * modular_err, (native_err, modular_err)
