"""Rotary position embedding (NeoX/HF "rotate half" layout) with the config's theta and scaling.

Supported `rope_scaling` types: none/default, `linear` (positions divided by the factor) and `llama3`
(frequency-dependent interpolation). Anything else is rejected when the model is built, not mid-request.
The cos/sin table is computed once in float32 for every position up to the context length.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from tokenloom.models.model_config import ModelConfigError


def _inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> tuple[torch.Tensor, float]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    position_scale = 1.0
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
    if kind in (None, "default"):
        pass
    elif kind == "linear":
        position_scale = 1.0 / float(scaling["factor"])
    elif kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        smooth = (old_ctx / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        inv_freq = torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    else:
        raise ModelConfigError(f"unsupported rope_scaling type {kind!r} (supported: linear, llama3)")
    return inv_freq.float(), position_scale


class RotaryEmbedding(nn.Module):
    """Holds the cos/sin table; `lookup` once per forward, `apply` per layer to the packed q|k heads."""

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: dict[str, Any] | None) -> None:
        super().__init__()
        inv_freq, position_scale = _inv_freq(head_dim, theta, scaling)
        t = torch.arange(max_positions, dtype=torch.float32) * position_scale
        freqs = torch.outer(t, inv_freq)
        # Full-width tables so rotation is x * cos + roll(x, D/2) * sin_signed (the "rotate half" layout).
        self.register_buffer("cos", torch.cat((freqs.cos(), freqs.cos()), dim=-1), persistent=False)
        self.register_buffer("sin", torch.cat((-freqs.sin(), freqs.sin()), dim=-1), persistent=False)
        self.head_dim = head_dim

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin_signed for the given positions: [T, 1, D] each, in the compute dtype."""
        cos = self.cos.index_select(0, positions).to(dtype).unsqueeze(1)
        sin = self.sin.index_select(0, positions).to(dtype).unsqueeze(1)
        return cos, sin

    @staticmethod
    def apply(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Rotate x [T, H, D] (any number of heads at once, q and k together)."""
        cos, sin = cos_sin
        return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)
