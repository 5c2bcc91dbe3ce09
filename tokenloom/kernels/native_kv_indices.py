"""The CPU's native KV-index builder (csrc/kv_indices.c): one widening copy per request's `req_to_token` slice.

Same contract as `tokenloom.layers.kv_indices.build_kv_indices_torch` (int32 table, int64 results); the kernel
checks every slice against the table before writing and reports the first bad request, which is raised here
as the same `IndexError` the torch path gives. `native_kv_index_builder()` is None when the kernel library
did not build (callers then use the torch path).
"""

from __future__ import annotations

import ctypes

import torch

from tokenloom.kernels.cpu_build import load_library
from tokenloom.kernels.kv_index_common import kv_indptr_from_lens, out_of_bounds_error


def _ptr(t: torch.Tensor | None) -> ctypes.c_void_p:
    return ctypes.c_void_p(None if t is None else t.data_ptr())


def build_kv_indices_native(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, kv_lens: torch.Tensor,
                            kv_start: torch.Tensor | None = None, total: int | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (kv_indptr [B+1] int64, kv_indices [sum(kv_lens)] int64) for CPU tensors and an int32 table."""
    if req_to_token.device.type != "cpu" or req_to_token.dtype != torch.int32:
        raise ValueError(f"the native KV-index builder takes a CPU int32 req_to_token, got "
                         f"{req_to_token.dtype} on {req_to_token.device}")
    lens, kv_indptr, counted = kv_indptr_from_lens(kv_lens, None)
    if total is not None and total != counted:
        raise ValueError(f"total={total} but the kv_lens sum to {counted}")
    table = req_to_token if req_to_token.stride(1) == 1 else req_to_token.contiguous()
    rows = req_pool_indices if req_pool_indices.dtype == torch.int64 and req_pool_indices.is_contiguous() \
        else req_pool_indices.to(torch.int64).contiguous()
    starts = None if kv_start is None else kv_start.to(torch.int64).contiguous()
    kv_indices = torch.empty(max(counted, 0), dtype=torch.int64)  # negative lens: rejected below
    n_rows, width = table.shape
    status = load_library("kernels").build_kv_indices_i32(
        _ptr(table), ctypes.c_int64(n_rows), ctypes.c_int64(width), ctypes.c_int64(table.stride(0)), _ptr(rows),
        _ptr(starts), _ptr(kv_indptr), ctypes.c_int64(lens.numel()), _ptr(kv_indices),
        ctypes.c_int(torch.get_num_threads()))
    if status < 0:
        raise out_of_bounds_error(req_to_token, rows, lens, starts, -status - 1)
    return kv_indptr, kv_indices


def native_kv_index_builder():
    """`build_kv_indices_native`, or None when the native kernels are unavailable on this machine."""
    return None if load_library("kernels") is None else build_kv_indices_native


def store_decode_slots_and_build_indices(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                                         seq_lens: torch.Tensor, out_cache_loc: torch.Tensor, total: int
                                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step's `req_to_token[rows, seq_lens - 1] = out_cache_loc` and its (kv_indptr, kv_indices) over
    each request's whole KV, in one native call (CPU int32 table, contiguous int64 rows, lengths and slots;
    `total` = sum(seq_lens)). Raises IndexError naming a request outside the table (nothing written then) and
    ValueError when `total` is not the lengths' sum. Needs the kernel library (`native_kv_index_builder()`)."""
    batch = int(seq_lens.numel())
    kv_indptr = torch.empty(batch + 1, dtype=torch.int64)
    kv_indices = torch.empty(total, dtype=torch.int64)
    n_rows, width = req_to_token.shape
    status = load_library("kernels").decode_store_and_build_i32(
        _ptr(req_to_token), ctypes.c_int64(n_rows), ctypes.c_int64(width), ctypes.c_int64(req_to_token.stride(0)),
        _ptr(req_pool_indices), _ptr(seq_lens), _ptr(out_cache_loc), ctypes.c_int64(batch), ctypes.c_int64(total),
        _ptr(kv_indptr), _ptr(kv_indices), ctypes.c_int(torch.get_num_threads()))
    if status == -(batch + 1):
        raise ValueError(f"total={total} but the kv_lens sum to {int(seq_lens.sum())}")
    if status < 0:
        i = -status - 1
        raise IndexError(f"request {i}: row {int(req_pool_indices[i])}, length {int(seq_lens[i])}, new slot "
                         f"{int(out_cache_loc[i])} outside req_to_token of shape {tuple(req_to_token.shape)}")
    return kv_indptr, kv_indices
