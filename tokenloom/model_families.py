"""Which decoder family a Hugging Face config describes, and the family-specific fields it sets.

One `Family` per architecture name: the `model_type` values that name it, and a `parse(cfg, source)` that
returns overrides of `ModelConfig`'s family fields (see model_config.py) from the HF config dict. A parser
refuses, with `ModelConfigError` naming the feature, anything in the config its family's model cannot run
(an activation, a RoPE type, a layout): a model is never served with a feature silently ignored.

This module sits below model_config.py (which re-exports `ModelConfigError`) and imports nothing of the
package. Adding a family: write its parser here, register it in `FAMILIES`, and its model class in models/registry.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


class ModelConfigError(ValueError):
    """The model's configuration is unsupported or inconsistent; the message names the source."""

Parser = Callable[[dict[str, Any], str], dict[str, Any]]


@dataclass(frozen=True)
class Family:
    architecture: str  # the HF `architectures` entry, e.g. "Qwen3ForCausalLM"
    model_types: tuple[str, ...]  # HF `model_type` values naming it
    parse: Parser


def _require_act(cfg: dict[str, Any], source: str, allowed: tuple[str, ...], key: str = "hidden_act") -> str:
    act = cfg.get(key) or allowed[0]
    if act not in allowed:
        raise ModelConfigError(f"{source}: unsupported {key} {act!r} (this family runs {', '.join(allowed)})")
    return "silu" if act == "swish" else act


def _window(cfg: dict[str, Any]) -> int | None:
    """The sliding window a config turns on (Qwen2 only with `use_sliding_window`), else None."""
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
    return int(window) if window else None


def _parse_llama(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    """Llama, Mistral: SwiGLU. Mistral's `sliding_window` applies to every layer (as transformers' Mistral
    does, whatever `layer_types` says)."""
    _require_act(cfg, source, ("silu", "swish"))
    window = _window(cfg)
    return {"hidden_act": "silu", **({"sliding_window": window} if window else {})}


def _parse_qwen2(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    """Qwen2: Llama with QKV bias (on unless the config says otherwise). With `use_sliding_window`, the layers
    `layer_types` names sliding (by default those from `max_window_layers` on, as transformers' Qwen2Config)."""
    fields = _parse_llama(cfg, source)
    fields["attention_bias"] = True if cfg.get("attention_bias") is None else bool(cfg["attention_bias"])
    window = fields.get("sliding_window")
    if window:
        layers = int(cfg["num_hidden_layers"])
        first = int(cfg.get("max_window_layers", 28))
        fields["layer_types"] = tuple(cfg.get("layer_types") or (
            "sliding_attention" if i >= first else "full_attention" for i in range(layers)))
    return fields


FAMILIES: dict[str, Family] = {
    f.architecture: f for f in (
        Family("LlamaForCausalLM", ("llama",), _parse_llama),
        Family("MistralForCausalLM", ("mistral",), _parse_llama),
        Family("Qwen2ForCausalLM", ("qwen2",), _parse_qwen2),
    )
}


def supported_architectures() -> tuple[str, ...]:
    return tuple(FAMILIES)


def family_for(cfg: dict[str, Any], source: str) -> Family:
    """The family of an HF config: its first `architectures` entry tokenloom knows, else its `model_type`."""
    archs = cfg.get("architectures") or []
    for arch in archs:
        if arch in FAMILIES:
            return FAMILIES[arch]
    if not archs:
        model_type = cfg.get("model_type", "")
        for family in FAMILIES.values():
            if model_type in family.model_types:
                return family
    found = archs or [cfg.get("model_type")]
    raise ModelConfigError(f"{source}: unsupported architecture {found}; tokenloom supports "
                           f"{', '.join(FAMILIES)}")
