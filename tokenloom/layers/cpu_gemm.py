"""Pre-packed bf16 matmuls on the CPU (oneDNN), behind one small seam.

Plain `F.linear` in bf16 re-lays-out the weight for oneDNN on every call; packing it once at load time makes
decode-size matmuls 1.3-1.7x faster (bench/forward.py) with bit-identical results. Used only where oneDNN
supports bf16 on this CPU; everything else keeps `F.linear`.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


@functools.cache
def _onednn_bf16() -> bool:
    try:
        return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """An opaque packed copy of `weight` [out, in] for `linear`, or None where packing does not apply."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or not _onednn_bf16():
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)


def linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias), through the packed weight when there is one."""
    if packed is None:
        return F.linear(x, weight, bias)
    if x.dim() != 2:
        return linear(x.reshape(-1, x.shape[-1]), weight, packed, bias).view(*x.shape[:-1], weight.shape[0])
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
