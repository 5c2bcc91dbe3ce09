"""bf16 matmuls on the CPU behind one small seam: pre-packed oneDNN weights, and a native weight-streaming
kernel for a few rows.

Plain `F.linear` in bf16 re-lays-out the weight for oneDNN on every call; packing it once at load time makes
decode-size matmuls 1.3-1.7x faster (bench/forward.py) with bit-identical results. At up to
`SMALL_M_MAX` rows (decode at small batch) a linear layer is a stream over its weight, and
csrc/small_gemm.c streams it faster than oneDNN does (the products are exact and summed in float32 either
way; only the summation order differs). Used only where the hardware supports bf16; everything else keeps
`F.linear`.
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F

from tokenloom.kernels.cpu_build import load_library

SMALL_M_MAX = 1  # rows up to which the streaming kernel beats oneDNN (bench/small_gemm.py measures it)


@functools.cache
def _onednn_bf16() -> bool:
    try:
        return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


@functools.cache
def _small_gemm() -> tuple[ctypes.CDLL, int, int] | None:
    """The native small-M kernel with its (max rows, max K), or None where this build has none."""
    lib = load_library("kernels")
    if lib is None:
        return None
    max_m, max_k = ctypes.c_int(), ctypes.c_int()
    if not lib.small_gemm_supported(ctypes.byref(max_m), ctypes.byref(max_k)):
        return None
    return lib, max_m.value, max_k.value


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """An opaque packed copy of `weight` [out, in] for `linear`, or None where packing does not apply."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or not _onednn_bf16():
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)


def small_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """x [M, K] @ weight.T (+ bias) through the streaming kernel, or None where it does not apply."""
    kernel = _small_gemm()
    if kernel is None or x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16 or x.device.type != "cpu":
        return None
    lib, max_m, max_k = kernel
    m, k = x.shape
    n = weight.shape[0]
    if m > max_m or k % 32 or k > max_k or x.stride(-1) != 1 or not weight.is_contiguous():
        return None
    if bias is not None and (bias.dtype != torch.bfloat16 or not bias.is_contiguous()):
        return None
    out = torch.empty(m, n, dtype=torch.bfloat16)
    ptr = ctypes.c_void_p
    rc = lib.linear_small_bf16(ptr(x.data_ptr()), ctypes.c_int64(x.stride(0)), ptr(weight.data_ptr()),
                               ptr(None if bias is None else bias.data_ptr()), ptr(out.data_ptr()), ctypes.c_int(m),
                               ctypes.c_int64(n), ctypes.c_int64(k), ctypes.c_int(torch.get_num_threads()))
    return out if rc == 0 else None


def linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias): the streaming kernel for a few rows, else the packed weight when there is one."""
    if x.dim() != 2:
        return linear(x.reshape(-1, x.shape[-1]), weight, packed, bias).view(*x.shape[:-1], weight.shape[0])
    if packed is not None and x.shape[0] <= SMALL_M_MAX:
        out = small_linear(x, weight, bias)
        if out is not None:
            return out
    if packed is None:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
