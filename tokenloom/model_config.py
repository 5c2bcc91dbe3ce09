"""Architecture description of a decoder-only model, independent of where it was read from.

`ModelConfig` is built from a Hugging Face `config.json` dict (either the classic `rope_theta`/`rope_scaling`
keys or transformers 5's `rope_parameters`) or from GGUF metadata (`models/gguf_file.py` turns the metadata
into the same kind of dict), and is the one object the model, the KV pool and the scheduler read sizes from.

Families: the fields every decoder has are parsed here; what makes a family differ (q/k norms, sliding
windows, soft-caps, experts, ...) is parsed by that family's function in `model_families.py`, which returns
overrides of the family fields below. Every family field's default is plain Llama behaviour, so a config
that leaves them alone is a Llama. A feature a family declares but tokenloom cannot run is refused at start by
its parser, naming the feature (`ModelConfigError`), never ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

from tokenloom.model_families import ModelConfigError, family_for

__all__ = ["FULL_ATTENTION", "SLIDING_ATTENTION", "ModelConfig", "ModelConfigError"]


FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    rope_scaling: dict[str, Any] | None = None
    hidden_act: str = "silu"  # "silu" (SwiGLU) or "gelu_pytorch_tanh" (GeGLU, Gemma)
    torch_dtype: str | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    source: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    # --- family fields (defaults = Llama) -------------------------------------------------------------
    # Attention
    qk_norm: str | None = None  # None; "head": RMSNorm over head_dim per head (Qwen3, Gemma3); "full": over
    #                             the whole q / k projection (OLMoE)
    attn_logit_softcap: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5 instead of head_dim ** -0.5
    sliding_window: int | None = None  # tokens a sliding layer sees (query at p sees keys (p - window, p])
    layer_types: tuple[str, ...] = ()  # per layer FULL_ATTENTION / SLIDING_ATTENTION; () = all full
    rope_local_theta: float | None = None  # RoPE base of sliding layers when it differs (Gemma 3)
    no_rope_layers: tuple[int, ...] = ()  # layer ids that apply no RoPE (SmolLM3)
    partial_rotary_factor: float = 1.0  # fraction of head_dim RoPE rotates (Phi-4-mini: 0.75)
    # Norms, embedding, head
    norm_weight_offset: float = 0.0  # RMSNorm multiplies by (offset + w): Gemma's 1 + w
    sandwich_norms: bool = False  # Gemma 2/3: post-attention and pre/post-feed-forward norms
    embedding_multiplier: float | None = None  # embeddings scaled by this (Gemma: sqrt(hidden_size))
    final_logit_softcap: float | None = None  # logits -> cap * tanh(logits / cap) (Gemma 2)
    # Mixture of experts (num_experts == 0: dense)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalise the top-k router weights to sum to 1
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's shared expert (sigmoid-gated); 0 = none
    moe_layers: tuple[int, ...] = ()  # layer ids with an MoE block; () with num_experts > 0 = every layer

    @property
    def context_length(self) -> int:
        return self.max_position_embeddings

    def layer_window(self, layer_id: int) -> int:
        """The sliding window of layer `layer_id`, 0 for a full-attention layer."""
        if not self.sliding_window:
            return 0
        if not self.layer_types:
            return self.sliding_window
        return self.sliding_window if self.layer_types[layer_id] == SLIDING_ATTENTION else 0

    def long_rope_after(self) -> int | None:
        """LongRoPE's original length when a served prompt can be longer: such a prompt is computed with the long
        factors (every token of it), a shorter one with the short factors, so their KV differs for the same
        tokens. None for every other RoPE, and where the context does not reach past the original length."""
        scaling = self.rope_scaling or {}
        if scaling.get("rope_type", scaling.get("type")) not in ("longrope", "su"):
            return None
        orig = int(scaling["original_max_position_embeddings"])
        return orig if self.context_length > orig else None

    def is_moe_layer(self, layer_id: int) -> bool:
        return self.num_experts > 0 and (not self.moe_layers or layer_id in self.moe_layers)

    def kv_bytes_per_token(self, dtype: torch.dtype, tp_size: int = 1, num_layers: int | None = None) -> int:
        """Bytes of K and V one token occupies in the pool on one TP rank."""
        layers = self.num_hidden_layers if num_layers is None else num_layers
        kv_heads = max(1, self.num_key_value_heads // tp_size)
        return 2 * kv_heads * self.head_dim * layers * torch.tensor([], dtype=dtype).element_size()

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], source: str = "config.json") -> ModelConfig:
        family = family_for(cfg, source)
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            rope = cfg.get("rope_parameters") or {}
            if isinstance(rope, dict) and all(isinstance(v, dict) for v in rope.values()) and rope:
                rope = rope.get(FULL_ATTENTION) or next(iter(rope.values()))  # per-layer-type parameters
            rope_theta = float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0)
            scaling = cfg.get("rope_scaling") or (
                {k: v for k, v in rope.items() if k != "rope_theta"} if rope else None)
            if scaling and scaling.get("rope_type", scaling.get("type")) in (None, "default"):
                scaling = None
            scaling = _complete_rope_scaling(scaling, cfg)
            eos = cfg.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
            config = cls(
                architecture=family.architecture,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg.get("intermediate_size") or 0),
                num_hidden_layers=int(cfg["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps") or 1e-6),
                rope_theta=rope_theta,
                rope_scaling=dict(scaling) if scaling else None,
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(cfg.get("attention_bias") or False),
                torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos_ids,
                source=source,
            )
            config = replace(config, **family.parse(cfg, source))
        except KeyError as e:
            raise ModelConfigError(f"{source}: missing required key {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            if isinstance(e, ModelConfigError):
                raise
            raise ModelConfigError(f"{source}: malformed config value ({e})") from None
        config.check()
        return config

    def check(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelConfigError(
                f"{self.source}: num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ModelConfigError(f"{self.source}: head_dim {self.head_dim} must be even for RoPE")
        if self.layer_types and len(self.layer_types) != self.num_hidden_layers:
            raise ModelConfigError(f"{self.source}: layer_types has {len(self.layer_types)} entries for "
                                   f"{self.num_hidden_layers} layers")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ModelConfigError(f"{self.source}: num_experts_per_tok {self.num_experts_per_tok} outside "
                                   f"1..{self.num_experts}")
        if not self.num_experts and self.intermediate_size <= 0:
            raise ModelConfigError(f"{self.source}: missing required key 'intermediate_size'")


def _complete_rope_scaling(scaling: dict[str, Any] | None, cfg: dict[str, Any]) -> dict[str, Any] | None:
    """Fill what transformers' standardize_rope_params derives from the rest of the config, while the config's
    own max_position_embeddings is known (--context-length may change the served length later): the original
    length of llama3/yarn/longrope (a top-level `original_max_position_embeddings` wins, as for Phi-3), YaRN's and
    LongRoPE's missing `factor` (max_position_embeddings / original length), and dynamic NTK's reference length.
    `partial_rotary_factor` is a family field, not a scaling parameter."""
    if not scaling:
        return scaling
    scaling = {k: v for k, v in scaling.items() if k != "partial_rotary_factor"}
    kind = scaling.get("rope_type", scaling.get("type"))
    max_pos = int(cfg.get("max_position_embeddings", 2048))
    if kind in ("llama3", "yarn", "longrope", "su"):
        if cfg.get("original_max_position_embeddings"):
            scaling["original_max_position_embeddings"] = int(cfg["original_max_position_embeddings"])
        scaling.setdefault("original_max_position_embeddings", max_pos)
    if kind in ("yarn", "longrope", "su") and scaling.get("factor") is None:
        scaling["factor"] = max_pos / int(scaling["original_max_position_embeddings"])
    if kind == "dynamic":
        scaling["max_position_embeddings"] = max_pos
    return scaling

