"""Architecture description of a Llama-family model, independent of where it was read from.

`ModelConfig` is built from a Hugging Face `config.json` dict (either the classic `rope_theta`/`rope_scaling`
keys or transformers 5's `rope_parameters`) or from GGUF metadata (see `gguf_file.py`), and is the one
object the model, the KV pool and the scheduler read sizes from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
_MODEL_TYPE_TO_ARCH = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


class ModelConfigError(ValueError):
    """The model's configuration is unsupported or inconsistent; the message names the source."""


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
    hidden_act: str = "silu"
    torch_dtype: str | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    source: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def context_length(self) -> int:
        return self.max_position_embeddings

    def kv_bytes_per_token(self, dtype: torch.dtype, tp_size: int = 1, num_layers: int | None = None) -> int:
        """Bytes of K and V one token occupies in the pool on one TP rank."""
        layers = self.num_hidden_layers if num_layers is None else num_layers
        kv_heads = max(1, self.num_key_value_heads // tp_size)
        return 2 * kv_heads * self.head_dim * layers * torch.tensor([], dtype=dtype).element_size()

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], source: str = "config.json") -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            arch = _MODEL_TYPE_TO_ARCH.get(cfg.get("model_type", "")) if not archs else None
        if arch is None:
            found = archs or [cfg.get("model_type")]
            raise ModelConfigError(
                f"{source}: unsupported architecture {found}; tokenloom supports "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        if cfg.get("hidden_act", "silu") not in ("silu", "swish"):
            raise ModelConfigError(f"{source}: unsupported hidden_act {cfg['hidden_act']!r} (only silu)")
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            rope = cfg.get("rope_parameters") or {}
            rope_theta = float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0)
            scaling = cfg.get("rope_scaling") or (
                {k: v for k, v in rope.items() if k != "rope_theta"} if rope else None)
            if scaling and scaling.get("rope_type", scaling.get("type")) in (None, "default"):
                scaling = None
            eos = cfg.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
            config = cls(
                architecture=arch,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_hidden_layers=int(cfg["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps") or 1e-6),
                rope_theta=rope_theta,
                rope_scaling=dict(scaling) if scaling else None,
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(arch == "Qwen2ForCausalLM" if cfg.get("attention_bias") is None
                                    else cfg["attention_bias"]),
                hidden_act="silu",
                torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos_ids,
                source=source,
                extra={"sliding_window": cfg.get("sliding_window")} if cfg.get("use_sliding_window", True)
                and cfg.get("sliding_window") else {},
            )
        except KeyError as e:
            raise ModelConfigError(f"{source}: missing required key {e.args[0]!r}") from None
        config.check()
        return config

    def check(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelConfigError(
                f"{self.source}: num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ModelConfigError(f"{self.source}: head_dim {self.head_dim} must be even for RoPE")
