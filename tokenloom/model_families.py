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


def _gemma_common(cfg: dict[str, Any], source: str, default_context: int) -> dict[str, Any]:
    """What Gemma 2 and Gemma 3 share: GeGLU with tanh GELU, (1 + w) RMSNorm, sandwich norms, embeddings
    scaled by sqrt(hidden_size), the query pre-attention scalar, interleaved sliding/global layers. Defaults
    for keys a config leaves out are transformers' (Gemma configs on the Hub omit many of them)."""
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ModelConfigError(f"{source}: unsupported hidden_activation {act!r} (Gemma runs gelu_pytorch_tanh)")
    if cfg.get("attention_bias"):
        raise ModelConfigError(f"{source}: attention_bias is not supported for Gemma (no o_proj bias)")
    if cfg.get("use_bidirectional_attention"):
        raise ModelConfigError(f"{source}: use_bidirectional_attention (an encoder, not a causal LM) "
                               "is not supported")
    layer_types = tuple(cfg.get("layer_types") or ())
    bad = set(layer_types) - {"full_attention", "sliding_attention"}
    if bad:
        raise ModelConfigError(f"{source}: unsupported layer_types {sorted(bad)}")
    window = cfg.get("sliding_window", 4096)
    return {
        "hidden_act": "gelu_pytorch_tanh",
        "head_dim": int(cfg.get("head_dim") or 256),
        "max_position_embeddings": int(cfg.get("max_position_embeddings") or default_context),
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", True)),
        "query_pre_attn_scalar": float(cfg.get("query_pre_attn_scalar") or 256),
        "norm_weight_offset": 1.0,
        "sandwich_norms": True,
        "embedding_multiplier": float(cfg["hidden_size"]) ** 0.5,
        "sliding_window": int(window) if window else None,
        "layer_types": layer_types,
    }


def _softcap(cfg: dict[str, Any], key: str, default: float | None) -> float | None:
    """A soft-cap key: transformers' default when absent, None (off) when null or 0."""
    value = cfg.get(key, default)
    return float(value) if value else None


def _parse_gemma2(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    """Gemma 2: attention and final logit soft-caps (50 / 30 unless the config says otherwise); layers
    alternate sliding (even ids) and global unless `layer_types` lists them."""
    fields = _gemma_common(cfg, source, 8192)
    n = int(cfg["num_hidden_layers"])
    if not fields["layer_types"]:
        fields["layer_types"] = tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n))
    fields["attn_logit_softcap"] = _softcap(cfg, "attn_logit_softcapping", 50.0)
    fields["final_logit_softcap"] = _softcap(cfg, "final_logit_softcapping", 30.0)
    return fields


def _parse_gemma3(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    """Gemma 3 text: per-head (1 + w) q/k norms; sliding layers rotate with their own base
    (`rope_local_base_freq`, or `rope_parameters["sliding_attention"]`) and no scaling, global layers with
    `rope_theta` (default 1e6) and `rope_scaling`; without `layer_types` every `sliding_window_pattern`-th
    layer (default 6th) is global. Soft-caps only where the config sets them."""
    if "text_config" in cfg or "vision_config" in cfg:
        raise ModelConfigError(f"{source}: multimodal Gemma 3 (vision tower) is not supported; serve a "
                               "text-only Gemma3ForCausalLM checkpoint")
    fields = _gemma_common(cfg, source, 131072)
    n = int(cfg["num_hidden_layers"])
    if not fields["layer_types"]:
        pattern = int(cfg.get("sliding_window_pattern") or 6)
        fields["layer_types"] = tuple("sliding_attention" if (i + 1) % pattern else "full_attention"
                                      for i in range(n))
    rope = cfg.get("rope_parameters") or {}
    per_type = isinstance(rope, dict) and any(isinstance(v, dict) for v in rope.values())
    local = dict(rope.get("sliding_attention") or {}) if per_type else {}
    if local.get("rope_type", "default") != "default":
        raise ModelConfigError(f"{source}: unsupported rope_type {local['rope_type']!r} on sliding layers")
    glob = (rope.get("full_attention") or {}) if per_type else rope
    fields["rope_theta"] = float(cfg.get("rope_theta") or glob.get("rope_theta") or 1_000_000.0)
    fields["rope_local_theta"] = float(local.get("rope_theta") or cfg.get("rope_local_base_freq") or 10_000.0)
    fields["qk_norm"] = "head"
    fields["attn_logit_softcap"] = _softcap(cfg, "attn_logit_softcapping", None)
    fields["final_logit_softcap"] = _softcap(cfg, "final_logit_softcapping", None)
    return fields


# Architectures refused by name, with what they would need.
_REFUSED = {
    "Gemma3ForConditionalGeneration": "multimodal Gemma 3 (vision tower + text model) is not supported; "
                                      "serve a text-only Gemma3ForCausalLM checkpoint",
}


def _layer_windows(cfg: dict[str, Any], sliding_by_default: Callable[[int], bool]) -> dict[str, Any]:
    """`sliding_window` and `layer_types` of a config whose window is off unless `use_sliding_window` (Qwen3,
    SmolLM3: transformers' default false): the config's own `layer_types`, else the family's default rule."""
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", False) else None
    if not window:
        return {}
    layers = int(cfg["num_hidden_layers"])
    types = tuple(cfg.get("layer_types") or (
        "sliding_attention" if sliding_by_default(i) else "full_attention" for i in range(layers)))
    return {"sliding_window": int(window), "layer_types": types}


def _parse_qwen3(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    """Qwen3: Llama with a per-head RMSNorm on q and k before RoPE, head_dim from the config, no QKV bias
    unless the config says so. With `use_sliding_window`, the layers from `max_window_layers` on slide (as
    transformers' Qwen3Config; real checkpoints ship it off)."""
    _require_act(cfg, source, ("silu", "swish"))
    first = int(cfg.get("max_window_layers", 28))
    return {"hidden_act": "silu", "qk_norm": "head", "attention_bias": bool(cfg.get("attention_bias") or False),
            **_layer_windows(cfg, lambda i: i >= first)}


def _parse_smollm3(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    """SmolLM3: Llama whose every `no_rope_layer_interval`-th layer (or those `no_rope_layers` flags 0:
    1 = RoPE, 0 = none) applies no RoPE. With `use_sliding_window`, the NoPE layers slide (transformers'
    SmolLM3Config)."""
    _require_act(cfg, source, ("silu", "swish"))
    if cfg.get("mlp_bias"):
        raise ModelConfigError(f"{source}: SmolLM3 mlp_bias is not supported")
    layers = int(cfg["num_hidden_layers"])
    flags = cfg.get("no_rope_layers")
    if flags is None:
        interval = int(cfg.get("no_rope_layer_interval") or 4)
        flags = [int((i + 1) % interval != 0) for i in range(layers)]
    if len(flags) != layers or any(f not in (0, 1) for f in flags):
        raise ModelConfigError(f"{source}: no_rope_layers must be {layers} flags of 0 or 1, got {flags!r}")
    return {"hidden_act": "silu", "no_rope_layers": tuple(i for i, use in enumerate(flags) if not use),
            **_layer_windows(cfg, lambda i: not flags[i])}


def _parse_phi3(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    """Phi-3 / Phi-3.5 / Phi-4-mini: SwiGLU, no biases, LongRoPE (`su` and, as transformers' Phi3Config maps it,
    `yarn` are old names of `longrope`; the original length defaults to 4096 as in Phi3Config), a partial rotary
    (top-level or in rope_parameters), and a sliding window on every layer (Phi-3-mini-4k: 2047).
    Refused: other RoPE types (transformers' Phi-3 runs only default and longrope), other activations, and the
    vision/audio parts of multimodal Phi configs."""
    _require_act(cfg, source, ("silu", "swish"))
    for key in ("embd_layer", "vision_config", "audio_processor", "img_processor"):
        if cfg.get(key):
            raise ModelConfigError(f"{source}: multimodal Phi config ({key}); tokenloom serves text-only models")
    rope = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    scaling = dict(cfg.get("rope_scaling") or {k: v for k, v in rope.items() if k != "rope_theta"})
    kind = scaling.get("rope_type", scaling.get("type")) or "default"
    fields: dict[str, Any] = {"hidden_act": "silu", "attention_bias": False}
    partial = cfg.get("partial_rotary_factor", scaling.pop("partial_rotary_factor", 1.0))
    fields["partial_rotary_factor"] = float(1.0 if partial is None else partial)
    if kind in ("su", "yarn", "longrope"):
        max_pos = int(cfg.get("max_position_embeddings", 4096))
        orig = int(cfg.get("original_max_position_embeddings") or 4096)
        scaling.pop("type", None)
        scaling.update(rope_type="longrope", original_max_position_embeddings=orig)
        if scaling.get("factor") is None:
            scaling["factor"] = max_pos / orig
        fields["rope_scaling"] = scaling
    elif kind != "default":
        raise ModelConfigError(f"{source}: unsupported rope_scaling type {kind!r} for Phi3ForCausalLM "
                               "(transformers' Phi-3 runs default and longrope/su)")
    window = _window(cfg)
    if window:
        fields["sliding_window"] = window  # every layer, as transformers' Phi3 passes it to each attention
    return fields


def _moe_common(cfg: dict[str, Any], source: str, experts_key: str | None = None) -> dict[str, Any]:
    """The router and expert fields every MoE family has; refuses what the MoE layer cannot run."""
    _require_act(cfg, source, ("silu", "swish"))
    experts = cfg.get(experts_key) if experts_key else (cfg.get("num_experts") or cfg.get("num_local_experts"))
    if not experts:
        raise ModelConfigError(f"{source}: a mixture-of-experts config without num_experts")
    if cfg.get("use_sliding_window"):
        raise ModelConfigError(f"{source}: use_sliding_window (sliding-window attention) is not supported for "
                               "this mixture-of-experts family")
    if cfg.get("router_jitter_noise") or cfg.get("clip_qkv"):
        raise ModelConfigError(f"{source}: router_jitter_noise / clip_qkv are not supported")
    return {"hidden_act": "silu", "num_experts": int(experts), "num_experts_per_tok": int(cfg["num_experts_per_tok"]),
            "moe_intermediate_size": int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])}


def _qwen_moe_layers(cfg: dict[str, Any], source: str) -> tuple[int, ...]:
    """Qwen2/3-MoE: a layer is sparse unless in mlp_only_layers or off the decoder_sparse_step grid;
    () when every layer is (the ModelConfig convention)."""
    layers = int(cfg["num_hidden_layers"])
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense = set(cfg.get("mlp_only_layers") or ())
    sparse = tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
    if not sparse:
        raise ModelConfigError(f"{source}: mixture-of-experts config with no sparse layer (decoder_sparse_step / "
                               "mlp_only_layers); serve it as its dense family")
    return () if len(sparse) == layers else sparse


def _parse_qwen3_moe(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    """Qwen3-MoE: q/k RMSNorm per head, softmax top-k router (norm_topk_prob), dense layers by
    decoder_sparse_step / mlp_only_layers."""
    if cfg.get("attention_bias"):
        raise ModelConfigError(f"{source}: attention_bias (with an o_proj bias) is not supported for Qwen3-MoE")
    fields = _moe_common(cfg, source)
    fields.update(qk_norm="head", norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                  moe_layers=_qwen_moe_layers(cfg, source))
    return fields


def _parse_qwen2_moe(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    """Qwen2-MoE: QKV bias, a shared expert gated by sigmoid(shared_expert_gate(x)) beside the routed ones."""
    fields = _moe_common(cfg, source)
    fields.update(attention_bias=bool(cfg.get("qkv_bias", True)),
                  norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                  shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0),
                  moe_layers=_qwen_moe_layers(cfg, source))
    return fields


def _parse_mixtral(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    """Mixtral: Mistral attention (its sliding window, if any, on every layer), every layer 8-expert top-2
    with renormalised weights."""
    fields = _moe_common(cfg, source, "num_local_experts")
    window = _window(cfg)
    fields.update(norm_topk_prob=True, **({"sliding_window": window} if window else {}))
    return fields


def _parse_olmoe(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    """OLMoE: q/k RMSNorm over the whole projection ("full"), top-k without renormalisation by default."""
    if cfg.get("attention_bias"):
        raise ModelConfigError(f"{source}: attention_bias (with an o_proj bias) is not supported for OLMoE")
    fields = _moe_common(cfg, source)
    fields.update(qk_norm="full", norm_topk_prob=bool(cfg.get("norm_topk_prob", False)))
    return fields


FAMILIES: dict[str, Family] = {
    f.architecture: f for f in (
        Family("LlamaForCausalLM", ("llama",), _parse_llama),
        Family("MistralForCausalLM", ("mistral",), _parse_llama),
        Family("Qwen2ForCausalLM", ("qwen2",), _parse_qwen2),
        Family("Gemma2ForCausalLM", ("gemma2",), _parse_gemma2),
        Family("Gemma3ForCausalLM", ("gemma3_text",), _parse_gemma3),
        Family("Qwen3ForCausalLM", ("qwen3",), _parse_qwen3),
        Family("SmolLM3ForCausalLM", ("smollm3",), _parse_smollm3),
        Family("Phi3ForCausalLM", ("phi3",), _parse_phi3),
        Family("Qwen3MoeForCausalLM", ("qwen3_moe",), _parse_qwen3_moe),
        Family("Qwen2MoeForCausalLM", ("qwen2_moe",), _parse_qwen2_moe),
        Family("MixtralForCausalLM", ("mixtral",), _parse_mixtral),
        Family("OlmoeForCausalLM", ("olmoe",), _parse_olmoe),
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
    for arch in archs:
        if arch in _REFUSED:
            raise ModelConfigError(f"{source}: {arch}: {_REFUSED[arch]}")
    found = archs or [cfg.get("model_type")]
    raise ModelConfigError(f"{source}: unsupported architecture {found}; tokenloom supports "
                           f"{', '.join(FAMILIES)}")
