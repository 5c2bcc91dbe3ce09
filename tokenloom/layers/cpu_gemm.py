"""bf16 matmuls on the CPU behind one small seam: weights packed once at load time for oneDNN and for the
AMX tile kernel, and a native weight-streaming kernel for a few rows where the CPU has no AMX.

Plain `F.linear` in bf16 re-lays-out the weight for oneDNN on every call; packing it once at load time makes
decode-size matmuls 1.3-1.7x faster (bench/forward.py) with bit-identical results. In decode at up to
`AMX_M_MAX` rows a linear layer is a stream over its weight: csrc/amx_gemm.c, with the weight packed in tile
order, streams it 1.3x faster than oneDNN (bench/small_gemm.py); past that oneDNN's matmul is as fast or
faster. Without AMX, csrc/small_gemm.c (AVX512-BF16) takes `SMALL_M_MAX` rows. On x86 CPUs with AVX2 but
without AVX-512 (AMD Zen 2/3, Intel client cores), where oneDNN has no bf16 matmul and torch's runs at 15-21
GFLOP/s, csrc/tile_avx2.c takes every row count (`avx2_linear`: a stream over the weight for a few rows,
float32 register tiles from `avx2_bf16_tile_m` rows, 6-7x torch's bf16 matmul at 64-256 rows). Every path sums
exact bf16 products in float32 and rounds once; only the summation order differs. Elsewhere `F.linear`.

`native_linear_f32` is the LM head's matmul: the same exact float32 sums, stored unrounded (logits rounded to
bf16 tie often enough to flip greedy choices). It takes the AMX kernel, else csrc/pair_gemm.c (AVX512-BF16,
register-blocked, no horizontal sums: as fast as oneDNN's bf16 matmul, which cannot write float32), else the
AVX2 kernel; where none runs, the LM head keeps a float32 copy of its weight (tokenloom/layers/embedding.py).
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
    for `native_linear_f32`, where AMX is absent); `avx2`: no copy, the weight itself goes to the AVX2 kernel
    (where oneDNN, AMX and AVX512-BF16 are all absent)."""

    onednn: torch.Tensor | None
    amx: torch.Tensor | None = None
    pair: torch.Tensor | None = None
    avx2: bool = False


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


@functools.cache
def _avx2() -> ctypes.CDLL | None:
    """The kernel library where its AVX2 bf16 matmul is built (x86 with AVX2/FMA/F16C, without the AVX-512
    kernels), else None."""
    lib = load_library("kernels")
    if lib is None or lib.quant_isa() != 1:
        return None
    return lib


def _avx2_applies(weight: torch.Tensor) -> bool:
    return _avx2() is not None and weight.dim() == 2 and weight.is_contiguous() and weight.shape[1] % 8 == 0


def pack_weight(weight: torch.Tensor, onednn: bool = True) -> PackedWeight | None:
    """Packed copies of `weight` [out, in] for `linear`, or with `onednn=False` for `native_linear_f32` (the
    AMX copy, else the feature-pair copy); where none of those kernels runs, the AVX2 kernel's mark; None where
    packing does not apply."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
        return None
    avx2 = PackedWeight(None, avx2=True) if _avx2_applies(weight) else None
    if not onednn:
        amx = pack_amx(weight)
        pair = None if amx is not None else pack_pair(weight)
        return avx2 if amx is None and pair is None else PackedWeight(None, amx, pair)
    if not _onednn_bf16():
        return avx2
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


def avx2_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor | None:
    """x [M, K] @ weight.T (+ bias) through the AVX2 kernel (csrc/tile_avx2.c), bf16 or unrounded float32
    out; None where it does not apply."""
    if not _avx2_applies(weight) or x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16 \
            or x.device.type != "cpu" or x.stride(-1) != 1 or x.shape[0] < 1:
        return None
    if bias is not None and (bias.dtype not in (torch.bfloat16, torch.float32) or not bias.is_contiguous()):
        return None
    (m, k), n = x.shape, weight.shape[0]
    out = torch.empty(m, n, dtype=out_dtype)
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    rc = _avx2().avx2_bf16_linear(ptr(x.data_ptr()), i64(x.stride(0)), ptr(weight.data_ptr()), i64(n), i64(k),
                                  ptr(None if bias is None else bias.data_ptr()),
                                  ctypes.c_int(bias is not None and bias.dtype == torch.float32),
                                  ptr(out.data_ptr()), i64(n), ctypes.c_int(out_dtype == torch.float32), i64(m),
                                  ctypes.c_int(torch.get_num_threads()))
    return out if rc == 0 else None


def native_linear_f32(x: torch.Tensor, weight: torch.Tensor, packed: PackedWeight | None) -> torch.Tensor | None:
    """x [M, K] @ weight.T as unrounded float32 sums of exact bf16 products, through the AMX kernel, the
    feature-pair kernel or the AVX2 kernel (whichever `packed`, from `pack_weight(weight, onednn=False)`, is
    for); None where none applies."""
    if packed is None or x.dtype != torch.bfloat16 or x.device.type != "cpu" or x.stride(-1) != 1 \
            or x.shape[0] < 1 or x.stride(0) % 2:
        return None
    if packed.avx2:
        return avx2_linear(x, weight, None, torch.float32)
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
    weight when there is one; the AVX2 kernel where `packed` says so."""
    if x.dim() != 2:
        return linear(x.reshape(-1, x.shape[-1]), weight, packed, bias).view(*x.shape[:-1], weight.shape[0])
    if packed is not None and packed.avx2:
        out = avx2_linear(x, weight, bias)
        if out is not None:
            return out
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
