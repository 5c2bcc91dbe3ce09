"""Tiny random Gemma 2 / Gemma 3 (text) checkpoints built with transformers' own classes, with SmolLM2's
tokenizer saved beside them (so the HTTP server runs them), configured so every Gemma feature binds:
soft-caps small enough that tanh bends the scores (a larger init makes the scores large), head_dim and
query_pre_attn_scalar unlike hidden/heads, norm weights away from 0 (so 1 + w is tested), Gemma 3's local
and global RoPE bases with linear scaling on the global layers.

`WINDOW`: the sliding window of the models the tests build."""

from __future__ import annotations

import os
from typing import Any

import torch

from tests.family_models import smollm2_tokenizer as _smollm2_tokenizer  # read once per process

WINDOW = 12

COMMON: dict[str, Any] = dict(
    vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, max_position_embeddings=1024, rms_norm_eps=1e-6, bos_token_id=1,
    eos_token_id=2, pad_token_id=0, tie_word_embeddings=True, initializer_range=0.15, query_pre_attn_scalar=24,
)

KINDS: dict[str, dict[str, Any]] = {
    "gemma2": dict(attn_logit_softcapping=2.0, final_logit_softcapping=4.0,
                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "gemma3": dict(layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
                   rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
}


def hf_config(kind: str, **overrides: Any):
    import transformers

    cls = {"gemma2": transformers.Gemma2Config, "gemma3": transformers.Gemma3TextConfig}[kind]
    return cls(**{**COMMON, "sliding_window": WINDOW, **KINDS[kind], **overrides})


def make_tiny_gemma(kind: str, folder: str, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """Create, save (safetensors, with SmolLM2's tokenizer) and return a float32 tiny Gemma of `kind`."""
    import transformers

    config = hf_config(kind, **overrides)
    config._attn_implementation = "eager"  # the soft-cap is in eager attention (SDPA cannot cap)
    cls = {"gemma2": transformers.Gemma2ForCausalLM, "gemma3": transformers.Gemma3ForCausalLM}[kind]
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():  # transformers inits Gemma norms to 0 (a scale of 1): make them non-trivial
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.2)
    os.makedirs(folder, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    _smollm2_tokenizer().save_pretrained(folder)
    return model
