"""bf16 matmuls on the CPU behind one small seam: weights packed once at load time for oneDNN and for the
AMX tile kernel, and a native weight-streaming kernel for a few rows where the CPU has no AMX.

Plain `F.linear` in bf16 re-lays-out the weight for oneDNN on every call; packing it once at load time makes
decode-size matmuls 1.3-1.7x faster (bench/forward.py) with bit-identical results. In decode at up to
`AMX_M_MAX` rows a linear layer is a stream over its weight: csrc/amx_gemm.c, with the weight packed in tile
order, streams it 1.3x faster than oneDNN (bench/small_gemm.py); past that oneDNN's matmul is as fast or
faster. Without AMX, csrc/small_gemm.c (AVX512-BF16) takes `SMALL_M_MAX` rows. Every path sums exact bf16
products in float32 and rounds once; only the summation order differs. Used only where the hardware
supports bf16; everything else keeps `F.linear`.

`native_linear_f32` is the LM head's matmul: the same exact float32 sums, stored unrounded (logits rounded to
bf16 tie often enough to flip greedy choices). It takes the AMX kernel, else csrc/pair_gemm.c (AVX512-BF16,
register-blocked, no horizontal sums: as fast as oneDNN's bf16 matmul, which cannot write float32); where
neither runs, the LM head keeps a float32 copy of its weight (tokenloom/layers/embedding.py).
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
    the LM head), the AMX tile order (None without AMX), and the feature-pair order of csrc/pair_gemm.c (only
    for `native_linear_f32`, where AMX is absent)."""

    onednn: torch.Tensor | None
    amx: torch.Tensor | None = None
    pair: torch.Tensor | None = None


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


@functools.cache
def _pair_gemm() -> ctypes.CDLL | None:
    lib = load_library("kernels")
    if lib is None or not lib.pair_gemm_supported():
        return None
    lib.pair_packed_numel.restype = ctypes.c_int64
    return lib


def pack_pair(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` [out, in] (bf16, even `in`) in csrc/pair_gemm.c's feature-pair order, or None where that kernel
    does not run."""
    lib = _pair_gemm()
    if lib is None or weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or weight.dim() != 2 \
            or weight.shape[1] % 2:
        return None
    n, k = weight.shape
    packed = torch.empty(lib.pair_packed_numel(ctypes.c_int64(n), ctypes.c_int64(k)), dtype=torch.bfloat16)
    lib.pair_pack_weight(ctypes.c_void_p(weight.data_ptr()), ctypes.c_int64(weight.stride(0)), ctypes.c_int64(n),
                         ctypes.c_int64(k), ctypes.c_void_p(packed.data_ptr()))
    return packed


def pack_weight(weight: torch.Tensor, onednn: bool = True) -> PackedWeight | None:
    """Packed copies of `weight` [out, in] for `linear`, or with `onednn=False` for `native_linear_f32` (the
    AMX copy, else the feature-pair copy); None where packing does not apply."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
        return None
    if not onednn:
        amx = pack_amx(weight)
        pair = None if amx is not None else pack_pair(weight)
        return None if amx is None and pair is None else PackedWeight(None, amx, pair)
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


def native_linear_f32(x: torch.Tensor, weight: torch.Tensor, packed: PackedWeight | None) -> torch.Tensor | None:
    """x [M, K] @ weight.T as unrounded float32 sums of exact bf16 products, through the AMX kernel or the
    feature-pair kernel (whichever copy `packed` holds, from `pack_weight(weight, onednn=False)`); None where
    neither applies."""
    if packed is None or x.dtype != torch.bfloat16 or x.device.type != "cpu" or x.stride(-1) != 1 \
            or x.shape[0] < 1 or x.stride(0) % 2:
        return None
    (m, k), n = x.shape, weight.shape[0]
    out = torch.empty(m, n, dtype=torch.float32)
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    threads = ctypes.c_int(torch.get_num_threads())
    if packed.amx is not None and _amx() is not None:
        rc = _amx().amx_linear_bf16_f32(ptr(x.data_ptr()), i64(x.stride(0)), ptr(packed.amx.data_ptr()), ptr(None),
                                        ptr(out.data_ptr()), i64(n), i64(m), i64(n), i64(k), threads)
    elif packed.pair is not None and _pair_gemm() is not None:
        rc = _pair_gemm().pair_linear_bf16_f32(ptr(x.data_ptr()), i64(x.stride(0)), ptr(packed.pair.data_ptr()),
                                               ptr(out.data_ptr()), i64(n), i64(m), i64(n), i64(k), threads)
    else:
        return None
    return out if rc == 0 else None


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
