"""GPTQ and compressed-tensors checkpoints of the other model families (tests/hf_quant_factory.py's
`gptq_from_folder` / `compressed_from_folder`: every linear weight quantized under its checkpoint name): Qwen2
(q/k/v biases beside the packed weights), Phi-3 (fused qkv_proj and gate_up_proj quantized as stored), Qwen3-MoE
and Mixtral (each expert's weights), Gemma 3. float32 logits equal transformers' on the dequantized checkpoint to
summation order; bf16 (the GGUF blocks) within bf16 noise with the same top-1 almost everywhere.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from tests.forward_steps import ForwardSteps
from tests.hf_quant_factory import compressed_from_folder, gptq_from_folder, w8a8_from_folder
from tokenloom.config import ServerArgs
from tokenloom.executor.model_runner import ModelRunner
from tokenloom.layers.quant_linear import quantized_weights

PROMPT = list(range(3, 30))


def _make(family: str, folder: str) -> None:
    if family in ("qwen2", "qwen3"):
        from tests.family_models import make_family_model

        make_family_model(family, folder)
    elif family == "gemma3":
        from tests.gemma_models import make_tiny_gemma

        make_tiny_gemma("gemma3", folder)
    elif family == "phi3":
        from tests.phi3_factory import VARIANTS, make_tiny_phi3

        make_tiny_phi3(folder, sorted(VARIANTS)[0])
    else:
        from tests.moe_factory import make_tiny_moe

        make_tiny_moe(family, folder, tokenizer=False)


def _logits(path: str, dtype: str) -> tuple[torch.Tensor, ModelRunner]:
    runner = ModelRunner(ServerArgs(model_path=path, dtype=dtype, max_total_tokens=256, max_running_requests=2))
    steps = ForwardSteps(runner)
    return steps.extend([steps.start()], [PROMPT], return_all_logits=True), runner


@pytest.mark.parametrize("method,family,bits", [
    ("gptq", "qwen2", 4), ("gptq", "qwen3", 8), ("gptq", "phi3", 4), ("gptq", "gemma3", 8),
    ("gptq", "qwen3_moe", 4), ("gptq", "mixtral", 8),
    ("compressed-tensors", "qwen2", 8), ("compressed-tensors", "phi3", 4), ("compressed-tensors", "qwen3_moe", 4),
    ("w8a8", "qwen3_moe", 8)])
def test_quantized_checkpoint_of_a_family_matches_transformers_on_the_dequantized_weights(tmp_path, method, family,
                                                                                        bits):
    src, dst = str(tmp_path / "float"), str(tmp_path / "quantized")
    _make(family, src)
    if method == "gptq":
        reference_folder = gptq_from_folder(src, dst, group=32, bits=bits, sym=bits == 8)
    elif method == "w8a8":  # compressed-tensors W8A8 int8: the activations are rounded to int8 per token too
        reference_folder = w8a8_from_folder(src, dst, scale_dtype=torch.float32)
    else:  # 4 bits asymmetric (Q4_1 blocks), 8 bits symmetric per channel (Q8_0)
        reference_folder = compressed_from_folder(src, dst, bits, 32 if bits == 4 else -1, symmetric=bits == 8)
    hf = transformers.AutoModelForCausalLM.from_pretrained(reference_folder, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0]
    scale = ref.abs().max().item()
    mine, runner = _logits(dst, "float32")
    assert runner.source.quantization == ("compressed-tensors" if method == "w8a8" else method)
    # every linear weight of the blocks held quantized: all their parameters but the norms' and biases'
    params, types = quantized_weights(runner.model)
    assert set(types) == ({"compressed-tensors-w8a8-int8"} if method == "w8a8" else
                          {f"{method}-int{bits}-" + ("g32" if method == "gptq" or bits == 4 else "channel")})
    linear = sum(p.numel() for n, p in hf.named_parameters() if p.dim() >= 2 and "embed" not in n
                 and "lm_head" not in n and not n.endswith("mlp.gate.weight") and "router" not in n)
    assert params == linear, (params, linear)
    if method == "w8a8":  # within the activations' int8 rounding (as the w8a8_int8 tests bound it)
        assert (mine - ref).abs().max().item() < 0.03 * scale
        assert (mine.argmax(-1) == ref.argmax(-1)).float().mean().item() > 0.9
        return
    assert (mine - ref).abs().max().item() < 1e-4 * max(1.0, scale)
    bf16, _ = _logits(dst, "bfloat16")
    assert (bf16 - ref).abs().max().item() < 0.06 * scale
    assert (bf16.argmax(-1) == ref.argmax(-1)).float().mean().item() > 0.9
