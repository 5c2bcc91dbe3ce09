"""Tiny random mixture-of-experts checkpoints built with transformers' own classes (Qwen3-MoE, Qwen2-MoE,
Mixtral, OLMoE), saved with SmolLM2's tokenizer beside the weights so the server and llama.cpp's converter run
on them.

The configs make routing matter: 8 experts, top-2 (so with a few tokens some experts get none), the router
weights scaled up so the top-k choice is not a near-tie, norm/bias weights made non-trivial, Qwen3-MoE with
norm_topk_prob on (and, in the `_mixed` variant, a dense layer by mlp_only_layers), OLMoE with it off. Sizes
are multiples of 64 so a Q8_0 expert splits into whole 32-element blocks at TP=2.
"""

from __future__ import annotations

import os
from typing import Any

import torch

_COMMON = dict(vocab_size=49152, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2,
               rms_norm_eps=1e-6, tie_word_embeddings=False, num_experts_per_tok=2)

FAMILIES: dict[str, dict[str, Any]] = {
    "qwen3_moe": dict(num_experts=8, moe_intermediate_size=64, intermediate_size=128, norm_topk_prob=True),
    # a dense layer among the sparse ones (llama.cpp's converter cannot write this one: HF tests only)
    "qwen3_moe_mixed": dict(num_experts=8, moe_intermediate_size=64, intermediate_size=128, norm_topk_prob=True,
                            mlp_only_layers=[1]),
    "qwen2_moe": dict(num_experts=8, moe_intermediate_size=64, intermediate_size=128,
                      shared_expert_intermediate_size=128),
    "mixtral": dict(num_local_experts=8, intermediate_size=64),
    # llama.cpp's converter writes OLMoE's RMSNorm epsilon as 1e-5 whatever the config says
    "olmoe": dict(num_experts=8, intermediate_size=64, norm_topk_prob=False, rms_norm_eps=1e-5),
}


def _classes(family: str) -> tuple[type, type]:
    import transformers as t

    family = family.removesuffix("_mixed")
    return {"qwen3_moe": (t.Qwen3MoeConfig, t.Qwen3MoeForCausalLM),
            "qwen2_moe": (t.Qwen2MoeConfig, t.Qwen2MoeForCausalLM),
            "mixtral": (t.MixtralConfig, t.MixtralForCausalLM),
            "olmoe": (t.OlmoeConfig, t.OlmoeForCausalLM)}[family]


def make_tiny_moe(family: str, folder: str, seed: int = 0, tokenizer: bool = True) -> torch.nn.Module:
    """Create, save (safetensors, plus SmolLM2's tokenizer) and return a tiny random MoE model (float32)."""
    cfg_cls, model_cls = _classes(family)
    config = cfg_cls(**{**_COMMON, **FAMILIES[family]})
    config.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("mlp.gate.weight"):  # routers: decisive top-k (not near-ties)
                p.normal_(0.0, 0.5)
    os.makedirs(folder, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    if tokenizer:
        from tokenloom.config import ServerArgs
        from tokenloom.models.loader import resolve_model_source
        from tokenloom.tokenizer import load_tokenizer

        load_tokenizer(resolve_model_source(ServerArgs())).save_pretrained(folder)
    return model
