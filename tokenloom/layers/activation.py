"""Gated activations over a merged gate/up projection: SwiGLU (one native call on the CPU, torch elsewhere)
and GeGLU with the tanh-approximated GELU (Gemma; torch)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenloom.kernels import cpu_ops


class SiluAndMul(nn.Module):
    """[gate | up] -> silu(gate) * up, halving the last dimension."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_ops.available(x):
            return cpu_ops.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluTanhAndMul(nn.Module):
    """[gate | up] -> gelu_tanh(gate) * up, halving the last dimension (transformers' gelu_pytorch_tanh)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up
