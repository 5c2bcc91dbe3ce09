"""Paged decode attention on the CPU (csrc/paged_attention.c): reads each request's K/V rows in place from
the KV pool through `kv_indptr`/`kv_indices`, so a decode step reads every KV byte once instead of
gathering a padded copy first. The same call can first store the step's new K/V rows in the pool.

`available(dtype, group, head_dim)` says whether the native kernel can run; `decode(...)` runs it.
"""

from __future__ import annotations

import ctypes

import torch

from tokenloom.kernels.cpu_build import load_library

_FUNCS = {torch.float32: "paged_decode_attention_f32", torch.bfloat16: "paged_decode_attention_bf16"}


def _lib() -> ctypes.CDLL | None:
    return load_library("kernels")


def available(dtype: torch.dtype, group: int, head_dim: int) -> bool:
    lib = _lib()
    if lib is None or dtype not in _FUNCS:
        return False
    max_group, max_dim = ctypes.c_int(), ctypes.c_int()
    lib.kernel_limits(ctypes.byref(max_group), ctypes.byref(max_dim))
    return group <= max_group.value and head_dim <= max_dim.value


def _ptr(t: torch.Tensor | None) -> ctypes.c_void_p:
    return ctypes.c_void_p(None if t is None else t.data_ptr())


def _rows_of_heads(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [B, H, D] with each token's heads contiguous (any stride between tokens), in `dtype`."""
    x = x.to(dtype)
    if x.stride(-1) != 1 or x.stride(-2) != x.shape[-1]:
        x = x.contiguous()
    return x


def decode(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, kv_indptr: torch.Tensor,
           kv_indices: torch.Tensor, scale: float, k_new: torch.Tensor | None = None,
           v_new: torch.Tensor | None = None, out_loc: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, Hq, D]; k_pool/v_pool [Hkv, rows, D] (q is cast to their dtype) -> [B, Hq * D] in that dtype.

    With `k_new`/`v_new` [B, Hkv, D] and `out_loc` [B], those rows are first written into the pools at
    row `out_loc[b]` (which the indices of request b are expected to include). q, k_new and v_new may be
    views into a packed qkv tensor: only each token's heads need to be contiguous."""
    lib = _lib()
    dtype = k_pool.dtype
    q = _rows_of_heads(q, dtype)
    batch, num_heads, head_dim = q.shape
    num_kv_heads, rows = k_pool.shape[0], k_pool.shape[1]
    out = torch.empty(batch, num_heads, head_dim, dtype=dtype)
    indptr = kv_indptr.to(torch.int64).contiguous()
    indices = kv_indices.to(torch.int64).contiguous()
    k_stride = v_stride = 0
    if k_new is not None:
        if v_new is None or out_loc is None:
            raise ValueError("k_new needs v_new and out_loc")
        k_new, v_new = _rows_of_heads(k_new, dtype), _rows_of_heads(v_new, dtype)
        if k_new.shape != (batch, num_kv_heads, head_dim) or v_new.shape != k_new.shape:
            raise ValueError(f"k_new/v_new must both be {(batch, num_kv_heads, head_dim)}")
        k_stride, v_stride = k_new.stride(0), v_new.stride(0)
        out_loc = out_loc.to(torch.int64).contiguous()
    fn = getattr(lib, _FUNCS[dtype])
    rc = fn(_ptr(q), ctypes.c_int64(q.stride(0)), _ptr(k_pool), _ptr(v_pool), _ptr(indptr), _ptr(indices),
            _ptr(out), ctypes.c_int(batch), ctypes.c_int(num_heads), ctypes.c_int(num_kv_heads),
            ctypes.c_int(head_dim), ctypes.c_int64(rows), ctypes.c_float(scale),
            ctypes.c_int(torch.get_num_threads()), _ptr(k_new), ctypes.c_int64(k_stride), _ptr(v_new),
            ctypes.c_int64(v_stride), _ptr(out_loc))
    if rc != 0:
        raise MemoryError("paged decode attention could not allocate its work buffers")
    return out.view(batch, num_heads * head_dim)
