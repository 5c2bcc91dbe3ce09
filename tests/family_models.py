"""Tiny random checkpoints of the model families, built with transformers' own config and model classes, with
SmolLM2's tokenizer saved beside the weights (so the whole runtime, chat template included, runs in seconds),
and their GGUF twins written by llama.cpp's own converter.

A family is a `FamilySpec`: transformers' config and model class names plus the config overrides that make the
tiny model exercise what the family adds (a head_dim that differs from hidden / heads, a NoPE layer, ...).
`make_family_model(family, folder, **overrides)` saves one and returns transformers' float32 model (the
reference); `gguf_twin(folder, outtype)` converts the folder. Sizes are multiples of 32 (q8_0 blocks; 256 would
be needed for K-quants). Other families add a line to `FAMILY_SPECS`.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from tests.llama_cpp_convert import convert

# Shared by every family: SmolLM2's vocabulary and special ids (bos 1 = <|im_start|>, eos 2 = <|im_end|>).
BASE: dict[str, Any] = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=49152, max_position_embeddings=2048,
                            rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=None,
                            tie_word_embeddings=True)


# Qwen3's own template logic for the generation prompt (its chat_template.jinja ends so): with
# enable_thinking=False the assistant turn starts with an empty think block.
QWEN3_STYLE_TEMPLATE = (
    "{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}")


@dataclass(frozen=True)
class FamilySpec:
    config_class: str  # a transformers attribute, e.g. "Qwen3Config"
    model_class: str  # e.g. "Qwen3ForCausalLM"
    overrides: dict[str, Any] = field(default_factory=dict)  # config fields over BASE
    rope_theta: float = 10000.0
    chat_template: str | None = None  # saved with the tokenizer (else SmolLM2's)
    # GGUF twins: the converter reads the saved tokenizer.json (tests/llama_cpp_convert.py says why)
    saved_tokenizer: bool = False


FAMILY_SPECS: dict[str, FamilySpec] = {
    "qwen2": FamilySpec("Qwen2Config", "Qwen2ForCausalLM", dict(use_sliding_window=False), rope_theta=1e6,
                        saved_tokenizer=True),
    # head_dim 32 != 64 / 4: the q/k norms and attention must take it from the config
    "qwen3": FamilySpec("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, use_sliding_window=False),
                        rope_theta=1e6, chat_template=QWEN3_STYLE_TEMPLATE),
    # 4 layers, the default interval 4: layer 3 has no RoPE (what llama.cpp's smollm3 assumes too)
    "smollm3": FamilySpec("SmolLM3Config", "SmolLM3ForCausalLM", dict(num_hidden_layers=4), rope_theta=2e6),
}
# Named variants: (family, config overrides).
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    **{name: (name, {}) for name in FAMILY_SPECS},
    "smollm3_flags": ("smollm3", dict(no_rope_layers=[1, 0, 0, 1])),  # explicit flags: layers 1 and 2 NoPE
    # windows of 16 tokens, shorter than the tests' prompts: Qwen3 layer 1 (from max_window_layers), SmolLM3
    # its NoPE layer 3
    "qwen3_swa": ("qwen3", dict(use_sliding_window=True, sliding_window=16, max_window_layers=1)),
    "smollm3_swa": ("smollm3", dict(use_sliding_window=True, sliding_window=16)),
}


@functools.cache
def smollm2_tokenizer() -> Any:
    """SmolLM2's tokenizer, read once per process (reading it from the default GGUF takes seconds); callers
    that change it (a chat template) restore it."""
    from tokenloom.config import ServerArgs
    from tokenloom.models.loader import resolve_model_source
    from tokenloom.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model_source(ServerArgs()))


def make_family_model(family: str, folder: str, seed: int = 0, chat_template: str | None = None,
                      **overrides: Any) -> torch.nn.Module:
    """Save a random tiny `family` model (safetensors, config, SmolLM2's tokenizer with `chat_template` if
    given) in `folder` and return transformers' float32 model of it. Norm weights and biases are perturbed
    away from HF's 1 / 0 init so that they are tested."""
    import transformers

    spec = FAMILY_SPECS[family]
    config = getattr(transformers, spec.config_class)(**{**BASE, **spec.overrides, **overrides})
    config.rope_parameters = {"rope_type": "default", "rope_theta": spec.rope_theta}
    torch.manual_seed(seed)
    model = getattr(transformers, spec.model_class)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
    os.makedirs(folder, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer = smollm2_tokenizer()
    own_template = tokenizer.chat_template
    try:
        if chat_template or spec.chat_template:
            tokenizer.chat_template = chat_template or spec.chat_template
        tokenizer.save_pretrained(folder)
    finally:  # the cached tokenizer keeps SmolLM2's template for the next caller
        tokenizer.chat_template = own_template
    return model


def make_variant(variant: str, folder: str, seed: int = 0) -> torch.nn.Module:
    family, overrides = VARIANTS[variant]
    return make_family_model(family, folder, seed, **overrides)


def gguf_twin(folder: str, outtype: str = "f32", out_dir: str | None = None) -> str:
    """`folder` converted by llama.cpp's convert_hf_to_gguf.py (`outtype`: f32, bf16, q8_0), written beside it."""
    out_dir = out_dir or os.path.dirname(os.path.abspath(folder))
    path = os.path.join(out_dir, f"{os.path.basename(os.path.abspath(folder))}-{outtype}.gguf")
    if not os.path.exists(path):
        with open(os.path.join(folder, "config.json")) as f:
            spec = FAMILY_SPECS.get(json.load(f)["model_type"])
        convert(folder, path, outtype, saved_tokenizer=spec is not None and spec.saved_tokenizer)
    return path
