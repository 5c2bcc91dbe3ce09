"""Native row-wise kernels of the decoder layer on the CPU (csrc/cpu_ops.c): RMSNorm with the residual add,
SiLU-and-mul, rotary embedding and Qwen3's per-head q/k RMSNorm, one call each instead of a chain of small aten
ops; and a row argmax (torch's CPU argmax over a vocabulary-wide row is ~10x slower than reading it); and a
grammar bitmask applied to float32 logits in place (unpacking the bits with torch costs ~10x more than the one
pass the kernel makes).

`available(x)` says whether a tensor can take the native path (CPU, float32 or bfloat16, kernels built);
callers keep their torch expression as the fallback. Every function computes in float32 and rounds once
(the q/k norm twice, in transformers' order).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from tokenloom.kernels.cpu_build import load_library

_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


def _lib() -> ctypes.CDLL | None:
    return load_library("kernels")


def available(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype in _SUFFIX and _lib() is not None


@functools.cache
def _fn(name: str, dtype: torch.dtype):
    return getattr(_lib(), f"{name}_{_SUFFIX[dtype]}")


def _ptr(t: torch.Tensor | None) -> ctypes.c_void_p:
    return ctypes.c_void_p(None if t is None else t.data_ptr())


def _rows(x: torch.Tensor) -> torch.Tensor:
    """A 2-D view whose rows are contiguous (any stride between rows), copying only if needed."""
    x = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    return x if x.stride(-1) == 1 else x.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """norm(x) * weight, or with `residual`: (norm(x + residual) * weight, x + residual). A float32 residual
    with bf16 `x` stays float32 (the sum is normalized unrounded); otherwise the residual takes x's dtype."""
    shape = x.shape
    x2 = _rows(x)
    rows, hidden = x2.shape
    out = torch.empty(rows, hidden, dtype=x.dtype)
    res2 = res_out = None
    fn = _fn("rms_norm", x.dtype)
    if residual is not None:
        res_dtype = x.dtype
        if residual.dtype == torch.float32 and x.dtype == torch.bfloat16:
            res_dtype, fn = torch.float32, _lib().rms_norm_bf16_res32
        res2 = _rows(residual.to(res_dtype))
        res_out = torch.empty(rows, hidden, dtype=res_dtype)
    w = weight.to(x.dtype).contiguous()
    fn(_ptr(x2), ctypes.c_int64(x2.stride(0)), _ptr(res2), ctypes.c_int64(0 if res2 is None else res2.stride(0)),
       _ptr(w), _ptr(out), _ptr(res_out), ctypes.c_int64(rows), ctypes.c_int64(hidden), ctypes.c_float(eps),
       ctypes.c_int(torch.get_num_threads()))
    if res_out is None:
        return out.view(shape)
    return out.view(shape), res_out.view(shape)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2I] = [gate | up] -> silu(gate) * up [..., I]."""
    x2 = _rows(x)
    rows, inter = x2.shape[0], x2.shape[1] // 2
    out = torch.empty(rows, inter, dtype=x.dtype)
    _fn("silu_and_mul", x.dtype)(_ptr(x2), ctypes.c_int64(x2.stride(0)), _ptr(out), ctypes.c_int64(rows),
                                 ctypes.c_int64(inter), ctypes.c_int(torch.get_num_threads()))
    return out.view(*x.shape[:-1], inter)


def rope_(x: torch.Tensor, positions: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor) -> bool:
    """Rotate x [T, H, D] in place (rotate-half layout; tables [rows, R] float32 as `RotaryEmbedding` keeps
    them, `positions` their row of each token). R < D rotates only the first R elements of each head (partial
    rotary); the rest are left as they are. Returns False, touching nothing, when x's heads are not laid out
    contiguously per token."""
    rows, heads, dim = x.shape
    rot = int(cos_table.shape[-1])
    if x.stride(-1) != 1 or x.stride(-2) != dim or cos_table.dtype != torch.float32 or rot > dim or rot % 2:
        return False
    pos = positions.to(torch.int64).contiguous()
    _fn("rope_part", x.dtype)(_ptr(x), ctypes.c_int64(x.stride(0)), _ptr(pos), _ptr(cos_table), _ptr(sin_table),
                              ctypes.c_int64(rows), ctypes.c_int(heads), ctypes.c_int(dim), ctypes.c_int(rot),
                              ctypes.c_int(torch.get_num_threads()))
    return True


def qk_head_norm_(qkv: torch.Tensor, q_heads: int, kv_heads: int, head_dim: int, q_weight: torch.Tensor,
                  k_weight: torch.Tensor, eps: float) -> bool:
    """Per-head RMSNorm of the q and k heads of bf16 qkv rows [T, (q_heads + 2 * kv_heads) * head_dim] in place
    (transformers' order: normalize in float32, round, scale by the weight, round); the v heads are untouched.
    False, touching nothing, when the native path cannot take these tensors (the caller keeps its torch path)."""
    if not (qkv.dim() == 2 and qkv.dtype == torch.bfloat16 and qkv.stride(1) == 1 and available(qkv)
            and qkv.shape[1] >= (q_heads + kv_heads) * head_dim):
        return False
    qw, kw = (w.to(torch.bfloat16).contiguous() for w in (q_weight, k_weight))
    if qw.numel() != head_dim or kw.numel() != head_dim:
        raise ValueError(f"q/k norm weights of {qw.numel()} / {kw.numel()} for head_dim {head_dim}")
    _lib().qk_head_norm_bf16(_ptr(qkv), ctypes.c_int64(qkv.stride(0)), ctypes.c_int64(qkv.shape[0]),
                             ctypes.c_int(q_heads), ctypes.c_int(kv_heads), ctypes.c_int(head_dim), _ptr(qw), _ptr(kw),
                             ctypes.c_float(eps), ctypes.c_int(torch.get_num_threads()))
    return True


def argmax(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) of a 2-D float32 tensor, int64, same index (first maximum; first NaN wins)."""
    x2 = _rows(x)
    rows, cols = x2.shape
    out = torch.empty(rows, dtype=torch.int64)
    if cols == 0:
        return torch.argmax(x, dim=-1)  # torch's error for an empty dimension
    _fn("argmax_rows", torch.float32)(_ptr(x2), ctypes.c_int64(x2.stride(0)), ctypes.c_int64(rows),
                                      ctypes.c_int64(cols), _ptr(out), ctypes.c_int(torch.get_num_threads()))
    return out


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None) -> bool:
    """-inf into `logits[rows[i], t]` (rows None: row i) wherever int32 `bitmask` row i disallows token t, in
    place, columns past the bitmask's width included. False (nothing done) when the native path cannot take
    these tensors: the caller then uses its torch expression."""
    if not (logits.dim() == 2 and logits.dtype == torch.float32 and logits.stride(1) == 1
            and bitmask.dtype == torch.int32 and bitmask.dim() == 2 and available(logits)):
        return False
    mask = bitmask.contiguous()
    index = None
    if rows is not None:
        index = rows.to(torch.int64).contiguous()
        if index.numel() != mask.shape[0]:
            raise ValueError(f"{index.numel()} rows for a bitmask of {mask.shape[0]}")
        if index.numel() and not (int(index.min()) >= 0 and int(index.max()) < logits.shape[0]):
            raise IndexError(f"bitmask rows {index.tolist()} outside logits of {logits.shape[0]} rows")
    elif mask.shape[0] > logits.shape[0]:
        raise ValueError(f"a bitmask of {mask.shape[0]} rows for logits of {logits.shape[0]}")
    _lib().apply_token_bitmask_f32(_ptr(logits), ctypes.c_int64(logits.stride(0)), ctypes.c_int64(logits.shape[1]),
                                   _ptr(mask), ctypes.c_int64(mask.shape[1]), _ptr(index),
                                   ctypes.c_int64(mask.shape[0]))
    return True
