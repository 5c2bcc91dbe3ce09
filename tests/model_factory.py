"""Tiny random Hugging Face checkpoints the tests create themselves (no downloads)."""

from __future__ import annotations

import os
from typing import Any

import torch

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=512, rms_norm_eps=1e-5)

VARIANTS: dict[str, dict[str, Any]] = {
    "llama": dict(kind="llama", tie_word_embeddings=False, rope_theta=10000.0),
    "llama_tied_mha": dict(kind="llama", tie_word_embeddings=True, num_key_value_heads=4),
    "llama3_rope_scaling": dict(kind="llama", rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}),
    "mistral": dict(kind="mistral", sliding_window=None, rope_theta=1000000.0),
    "qwen2": dict(kind="qwen2", tie_word_embeddings=True, rope_theta=1000000.0),
    # SmolLM2's attention shape (head_dim 64, 3 query heads per KV head): the native extend kernel's shapes
    "llama_hd64": dict(kind="llama", hidden_size=192, intermediate_size=256, num_attention_heads=3,
                       num_key_value_heads=1, max_position_embeddings=1024),
}


def make_hf_model(variant: str, folder: str, seed: int = 0) -> torch.nn.Module:
    """Create, save (safetensors) and return a random tiny model of the given variant."""
    import transformers

    spec = dict(VARIANTS[variant])
    kind = spec.pop("kind")
    cfg_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[kind]
    rope_scaling = spec.pop("rope_scaling", None)
    theta = spec.pop("rope_theta", 10000.0)
    config = cfg_cls(**{**TINY, **spec})
    params = {"rope_type": "default", "rope_theta": theta}
    if rope_scaling:
        params = {**rope_scaling, "rope_theta": theta}
    if hasattr(config, "rope_parameters"):
        config.rope_parameters = params
    else:  # transformers 4.x
        config.rope_theta = theta
        config.rope_scaling = rope_scaling
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():  # HF inits norms to 1 and biases to 0; make them non-trivial so they are tested
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
    os.makedirs(folder, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    return model


def make_tiny_with_smollm2_tokenizer(folder: str, seed: int = 0, chat_template: str | None = None,
                                     **overrides: Any) -> str:
    """A tiny random Llama with SmolLM2's vocabulary and tokenizer saved beside it, so the full runtime
    (tokenizer, detokenizer, stop strings) runs in seconds; `chat_template` replaces SmolLM2's in the saved
    tokenizer. `overrides`: LlamaConfig fields (e.g. num_key_value_heads)."""
    import transformers

    from tokenloom.config import ServerArgs
    from tokenloom.models.loader import resolve_model_source
    from tokenloom.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model_source(ServerArgs()))
    config = transformers.LlamaConfig(**{**TINY, "vocab_size": 49152, "max_position_embeddings": 2048,
                                         "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": True,
                                         **overrides})
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    os.makedirs(folder, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    if chat_template:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(folder)
    return folder
