"""RMSNorm with an optional residual add. On the CPU (float32/bfloat16) it is one native call
(tokenloom/kernels/cpu_ops.py); elsewhere torch's fused rms_norm. Both accumulate in float32.

The residual stream may be float32 under a bf16 model (the decoder keeps it so: bf16 rounding of the running
sum, layer after layer, is the largest accuracy cost of bf16 inference, see docs/benchmarks.md): the sum is
then kept and normalized in float32 and only the normalized output is rounded to the model dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenloom.kernels import cpu_ops


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without `residual`: norm(x). With it: (norm(x + residual), x + residual)."""
        if cpu_ops.available(x):
            return cpu_ops.rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        residual = x.to(residual.dtype) + residual
        out = F.rms_norm(residual.float(), self.weight.shape, self.weight.float(), self.eps)
        return out.to(x.dtype), residual
