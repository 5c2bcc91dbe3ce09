"""Rotary position embedding (NeoX/HF "rotate half" layout) with the config's theta and scaling.

Supported `rope_scaling` types: none/default, `linear` (positions divided by the factor) and `llama3`
(frequency-dependent interpolation). Anything else is rejected when the model is built, not mid-request.
The cos/sin table is computed once in float32 for every position up to the context length. On the CPU the
rotation is one native in-place call per layer (tokenloom/kernels/cpu_ops.py).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from tokenloom.kernels import cpu_ops
from tokenloom.model_config import ModelConfigError


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


class RotaryStep:
    """The rotation of one forward step: its positions, and the cos/sin rows in the compute dtype, built on
    first use by the torch path (the native CPU path reads the float32 tables directly)."""

    def __init__(self, rotary: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype) -> None:
        self.rotary = rotary
        self.positions = positions
        self.dtype = dtype
        self._cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None

    def cos_sin(self) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin_signed for the step's positions: [T, 1, D] each, in the compute dtype."""
        if self._cos_sin is None:
            cos = self.rotary.cos.index_select(0, self.positions).to(self.dtype).unsqueeze(1)
            sin = self.rotary.sin.index_select(0, self.positions).to(self.dtype).unsqueeze(1)
            self._cos_sin = (cos, sin)
        return self._cos_sin


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
        self.max_positions = max_positions

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> RotaryStep:
        """The step's rotation; positions must lie in [0, max_positions) (checked on the CPU, where the native
        kernel would otherwise read outside the table; on an accelerator the check would force a sync)."""
        if positions.device.type == "cpu" and positions.numel() and (
                int(positions.min()) < 0 or int(positions.max()) >= self.max_positions):
            raise ValueError(f"positions outside [0, {self.max_positions}) (the model's context length)")
        return RotaryStep(self, positions, dtype)

    @staticmethod
    def apply(x: torch.Tensor, step: RotaryStep) -> torch.Tensor:
        """Rotate x [T, H, D] (any number of heads at once, q and k together). The native CPU path rotates
        x in place and returns it; the torch path returns a new tensor."""
        if cpu_ops.available(x) and cpu_ops.rope_(x, step.positions, step.rotary.cos, step.rotary.sin):
            return x
        cos, sin = step.cos_sin()
        return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)
