"""bf16 matmuls on the CPU behind one small seam: weights packed once at load time for oneDNN and for the
AMX tile kernel, and a native weight-streaming kernel for a few rows where the CPU has no AMX.

Plain `F.linear` in bf16 re-lays-out the weight for oneDNN on every call; packing it once at load time makes
decode-size matmuls 1.3-1.7x faster (bench/forward.py) with bit-identical results. In decode at up to
`AMX_M_MAX` rows a linear layer is a stream over its weight: csrc/amx_gemm.c, with the weight packed in tile
order, streams it 1.3x faster than oneDNN (bench/small_gemm.py); past that oneDNN's matmul is as fast or
faster. Without AMX, csrc/small_gemm.c (AVX512-BF16) takes `SMALL_M_MAX` rows. Every path sums exact bf16
products in float32 and rounds once; only the summation order differs. Used only where the hardware
supports bf16; everything else keeps `F.linear`.

`linear_f32` is the LM head's matmul: the same exact float32 sums, stored unrounded (logits rounded to bf16 tie
often enough to flip greedy choices). It takes the AMX kernel, else the streaming kernel (at any row count: the
weight block stays in L1 while every row uses it), else a float32 matmul on a float32 copy of the weight.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenloom.kernels.cpu_build import load_library

SMALL_M_MAX = 1  # rows up to which the streaming kernel beats oneDNN (bench/small_gemm.py measures it)
AMX_M_MAX = 32  # rows up to which the AMX kernel beats oneDNN (bench/small_gemm.py: 1.3x at 1-32, 1.0x at 48-64)


@dataclass(frozen=True)
class PackedWeight:
    """A linear weight's load-time copies: oneDNN's opaque layout (None when the caller never uses oneDNN, like
    the LM head), and the AMX tile order (None without AMX)."""

    onednn: torch.Tensor | None
    amx: torch.Tensor | None = None


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


@functools.cache
def _amx() -> ctypes.CDLL | None:
    """The kernel library when its AMX matmul runs here (AMX present, granted, not disabled), else None."""
    lib = load_library("kernels")
    if lib is None or not lib.amx_gemm_supported():
        return None
    lib.amx_packed_numel.restype = ctypes.c_int64
    return lib


def pack_amx(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` [out, in] (bf16) in the AMX kernel's tile order, or None where that kernel does not run."""
    lib = _amx()
    if lib is None or weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or weight.dim() != 2:
        return None
    n, k = weight.shape
    packed = torch.empty(lib.amx_packed_numel(ctypes.c_int64(n), ctypes.c_int64(k)), dtype=torch.bfloat16)
    lib.amx_pack_weight(ctypes.c_void_p(weight.data_ptr()), ctypes.c_int64(weight.stride(0)), ctypes.c_int64(n),
                        ctypes.c_int64(k), ctypes.c_void_p(packed.data_ptr()))
    return packed


def pack_weight(weight: torch.Tensor, onednn: bool = True) -> PackedWeight | None:
    """Packed copies of `weight` [out, in] for `linear` (`onednn=False`: only the AMX copy, for
    `native_linear_f32`), or None where packing does not apply."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
        return None
    if not onednn:
        amx = pack_amx(weight)
        return None if amx is None else PackedWeight(None, amx)
    if not _onednn_bf16():
        return None
    return PackedWeight(torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None), pack_amx(weight))


def amx_linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """x [M, K] @ weight.T (+ bias) through the AMX kernel (`packed` from `pack_amx(weight)`), or None where it
    does not apply."""
    lib = _amx()
    if lib is None or x.dtype != torch.bfloat16 or x.device.type != "cpu" or x.stride(-1) != 1:
        return None
    if bias is not None and (bias.dtype != torch.bfloat16 or not bias.is_contiguous()):
        return None
    (m, k), n = x.shape, weight.shape[0]
    out = torch.empty(m, n, dtype=torch.bfloat16)
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    rc = lib.amx_linear_bf16(ptr(x.data_ptr()), i64(x.stride(0)), ptr(packed.data_ptr()),
                             ptr(None if bias is None else bias.data_ptr()), ptr(out.data_ptr()), i64(n), i64(m),
                             i64(n), i64(k), ctypes.c_int(torch.get_num_threads()))
    return out if rc == 0 else None


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


def _f32_kernel_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16 and x.device.type == "cpu"
            and x.stride(-1) == 1 and weight.is_contiguous())


def native_linear_f32(x: torch.Tensor, weight: torch.Tensor, packed: PackedWeight | None) -> torch.Tensor | None:
    """x [M, K] @ weight.T as unrounded float32 sums of exact bf16 products, through the AMX kernel (when
    `packed` has its copy) or the streaming kernel; None where neither applies."""
    if not _f32_kernel_applies(x, weight) or x.shape[0] < 1:
        return None
    (m, k), n = x.shape, weight.shape[0]
    out = torch.empty(m, n, dtype=torch.float32)
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    threads = ctypes.c_int(torch.get_num_threads())
    lib = _amx()
    if lib is not None and packed is not None and packed.amx is not None:
        rc = lib.amx_linear_bf16_f32(ptr(x.data_ptr()), i64(x.stride(0)), ptr(packed.amx.data_ptr()), ptr(None),
                                     ptr(out.data_ptr()), i64(n), i64(m), i64(n), i64(k), threads)
        return out if rc == 0 else None
    kernel = _small_gemm()
    if kernel is None or k % 32 or k > kernel[2]:
        return None
    rc = kernel[0].linear_small_bf16_f32(ptr(x.data_ptr()), i64(x.stride(0)), ptr(weight.data_ptr()), ptr(None),
                                         ptr(out.data_ptr()), ctypes.c_int(m), i64(n), i64(k), threads)
    return out if rc == 0 else None


def f32_kernel_available(weight: torch.Tensor) -> bool:
    """Whether `native_linear_f32` runs for this weight on this machine (else callers keep a float32 copy)."""
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or weight.dim() != 2:
        return False
    kernel = _small_gemm()
    return _amx() is not None or (kernel is not None and weight.shape[1] % 32 == 0 and weight.shape[1] <= kernel[2])


def linear(x: torch.Tensor, weight: torch.Tensor, packed: PackedWeight | None,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias): for a few rows the AMX kernel (else the streaming kernel), else oneDNN's packed
    weight when there is one."""
    if x.dim() != 2:
        return linear(x.reshape(-1, x.shape[-1]), weight, packed, bias).view(*x.shape[:-1], weight.shape[0])
    if packed is None or packed.onednn is None:
        return F.linear(x, weight, bias)
    rows = x.shape[0]
    if packed.amx is not None and 0 < rows <= AMX_M_MAX:
        out = amx_linear(x, weight, packed.amx, bias)
        if out is not None:
            return out
    elif rows <= SMALL_M_MAX:
        out = small_linear(x, weight, bias)
        if out is not None:
            return out
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed.onednn, bias, "none", [], "")
