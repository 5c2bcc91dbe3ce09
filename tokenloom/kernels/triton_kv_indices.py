"""Triton kernel for `build_kv_indices` (the contract is in tokenloom/layers/kv_indices.py): one program per
request copies its row slice `req_to_token[row, start : start + len]` into `kv_indices[kv_indptr[i]:]`,
widened to int64, in blocks of `BLOCK` columns.

This module imports triton at the top; tokenloom/layers/kv_indices.py imports it only when the Triton path is
picked (CUDA tensors, or `backend="triton"`), so nothing else needs triton installed. On the CPU the kernel
runs only under Triton's interpreter (`TRITON_INTERPRET=1`, set before this module is imported), which is how
tests/unit/test_kv_indices_triton.py checks it against the torch path.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from tokenloom.kernels.kv_index_common import kv_indptr_from_lens

BLOCK = 512  # columns per loop iteration; lengths are often a few hundred to a few thousand


@triton.jit
def _kv_indices_kernel(req_to_token, req_pool_indices, kv_lens, kv_start, kv_indptr, kv_indices,
                       stride_row, stride_col, HAS_START: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    pid = tl.program_id(0)
    row = tl.load(req_pool_indices + pid).to(tl.int64)
    length = tl.load(kv_lens + pid).to(tl.int32)
    out_offset = tl.load(kv_indptr + pid)
    src = req_to_token + row * stride_row
    if HAS_START:
        src += tl.load(kv_start + pid).to(tl.int64) * stride_col
    dst = kv_indices + out_offset
    for block in range(tl.cdiv(length, BLOCK_SIZE)):
        cols = block * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        mask = cols < length
        slots = tl.load(src + cols.to(tl.int64) * stride_col, mask=mask)
        tl.store(dst + cols, slots.to(tl.int64), mask=mask)


def build_kv_indices_triton(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, kv_lens: torch.Tensor,
                            kv_start: torch.Tensor | None = None, total: int | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract and result as `build_kv_indices_torch`; tensors on CUDA (or any device under
    TRITON_INTERPRET=1). Bounds are not checked (as in the torch path on CUDA)."""
    device = kv_lens.device
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"the Triton KV-index kernel needs CUDA tensors (got {device}) or TRITON_INTERPRET=1")
    _, kv_indptr, total = kv_indptr_from_lens(kv_lens, total)
    kv_indices = torch.empty(total, dtype=torch.int64, device=device)
    batch = kv_lens.numel()
    if batch == 0 or total == 0:
        return kv_indptr, kv_indices
    starts = kv_lens if kv_start is None else kv_start.contiguous()  # unused when HAS_START is false
    _kv_indices_kernel[(batch,)](
        req_to_token, req_pool_indices.contiguous(), kv_lens.contiguous(), starts, kv_indptr, kv_indices,
        req_to_token.stride(0), req_to_token.stride(1), HAS_START=kv_start is not None, BLOCK_SIZE=BLOCK)
    return kv_indptr, kv_indices
