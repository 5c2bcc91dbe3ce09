"""Paged decode attention on the CPU (csrc/paged_attention.c): reads each request's K/V rows in place from
the KV pool through `kv_indptr`/`kv_indices`, so a decode step reads every KV byte once instead of
gathering a padded copy first.

`available(dtype, group, head_dim)` says whether the native kernel can run; `decode(...)` runs it.
"""

from __future__ import annotations

import ctypes

import torch

from tokenloom.kernels.cpu_build import load_library

_FUNCS = {torch.float32: "paged_decode_attention_f32", torch.bfloat16: "paged_decode_attention_bf16"}


def _lib() -> ctypes.CDLL | None:
    return load_library("paged_attention")


def available(dtype: torch.dtype, group: int, head_dim: int) -> bool:
    lib = _lib()
    if lib is None or dtype not in _FUNCS:
        return False
    max_group, max_dim = ctypes.c_int(), ctypes.c_int()
    lib.kernel_limits(ctypes.byref(max_group), ctypes.byref(max_dim))
    return group <= max_group.value and head_dim <= max_dim.value


def decode(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, kv_indptr: torch.Tensor,
           kv_indices: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, Hq, D]; k_pool/v_pool [Hkv, rows, D] (same dtype as q) -> [B, Hq * D]."""
    lib = _lib()
    q = q.contiguous()
    batch, num_heads, head_dim = q.shape
    num_kv_heads, rows = k_pool.shape[0], k_pool.shape[1]
    out = torch.empty_like(q)
    indptr = kv_indptr.to(torch.int64).contiguous()
    indices = kv_indices.to(torch.int64).contiguous()
    fn = getattr(lib, _FUNCS[q.dtype])
    ptr = ctypes.c_void_p
    fn(ptr(q.data_ptr()), ptr(k_pool.data_ptr()), ptr(v_pool.data_ptr()), ptr(indptr.data_ptr()),
       ptr(indices.data_ptr()), ptr(out.data_ptr()), ctypes.c_int(batch), ctypes.c_int(num_heads),
       ctypes.c_int(num_kv_heads), ctypes.c_int(head_dim), ctypes.c_int64(rows), ctypes.c_float(scale),
       ctypes.c_int(torch.get_num_threads()))
    return out.view(batch, num_heads * head_dim)
