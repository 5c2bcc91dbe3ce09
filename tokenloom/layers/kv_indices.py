"""Flattened KV indices for a batch: which pool slots each request's attention reads.

`kv_indptr[i]:kv_indptr[i+1]` spans request i's slots in `kv_indices`, which are
`req_to_token[req_pool_indices[i], start[i] : start[i] + kv_lens[i]]`. `padded_kv_indices` turns the ragged
form into a [batch, max_len] matrix (padding points at the dummy slot 0) for backends that run dense batched
attention.

Three implementations share that contract, picked by `build_kv_indices(..., backend=)`:
- `native` (tokenloom/kernels/native_kv_indices.py): one widening copy per request in C; the default on the
  CPU when the kernel library builds.
- `torch` (`build_kv_indices_torch`): vectorized, no Python loop over requests; the CPU fallback, and any
  device's path when nothing faster applies.
- `triton` (tokenloom/kernels/triton_kv_indices.py): one program per request; the default for CUDA tensors
  when triton imports. It is imported only when picked (an optional engine), so a CPU install never needs triton.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from tokenloom.kernels.kv_index_common import kv_indptr_from_lens, out_of_bounds_error
from tokenloom.kernels.native_kv_indices import native_kv_index_builder

KV_INDEX_BACKENDS = ("auto", "native", "torch", "triton")

KvIndexBuilder = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def build_kv_indices(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, kv_lens: torch.Tensor,
                     kv_start: torch.Tensor | None = None, total: int | None = None, backend: str = "auto"
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (kv_indptr [B+1] int64, kv_indices [sum(kv_lens)] int64).

    `total` (= sum(kv_lens)) may be passed when the caller knows it, which avoids a device sync on CUDA.
    `backend`: "auto" (Triton for CUDA tensors when triton imports; the native kernel for a CPU int32 table
    when it builds; else torch), "native", "torch" or "triton".
    """
    if backend == "auto":
        backend = _auto_backend(req_to_token)
    if backend == "torch":
        return build_kv_indices_torch(req_to_token, req_pool_indices, kv_lens, kv_start, total)
    if backend == "native":
        native = native_kv_index_builder()
        if native is None:
            raise RuntimeError("KV-index backend 'native' needs the CPU kernel library, which did not build")
        return native(req_to_token, req_pool_indices, kv_lens, kv_start, total)
    if backend == "triton":
        builder = triton_kv_index_builder()
        if builder is None:
            raise RuntimeError("KV-index backend 'triton' needs the triton package, which did not import")
        return builder(req_to_token, req_pool_indices, kv_lens, kv_start, total)
    raise ValueError(f"unknown KV-index backend {backend!r}; expected one of {KV_INDEX_BACKENDS}")


def _auto_backend(req_to_token: torch.Tensor) -> str:
    if req_to_token.device.type == "cuda":
        return "triton" if triton_kv_index_builder() is not None else "torch"
    if req_to_token.device.type == "cpu" and req_to_token.dtype == torch.int32 and native_kv_index_builder():
        return "native"
    return "torch"


@functools.cache  # the answer cannot change within a process, and a failed import is slow to retry each step
def triton_kv_index_builder() -> KvIndexBuilder | None:
    """The Triton implementation, or None when triton does not import."""
    try:
        from tokenloom.kernels.triton_kv_indices import build_kv_indices_triton
    except ImportError:
        return None
    return build_kv_indices_triton


def build_kv_indices_torch(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, kv_lens: torch.Tensor,
                           kv_start: torch.Tensor | None = None, total: int | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The vectorized torch path: one flat index per output element, one gather, one widening copy.

    Output element k of request i reads flat position `row_i * stride + start_i + (k - kv_indptr[i])`, i.e.
    `base_i + k`. That index is built in the output buffer itself as a running sum of its steps: +1 inside a
    request, `base_i - base_{i-1} + 1` where request i begins. Empty requests begin where the next one does;
    their steps telescope, so `index_add_` over all requests needs no filtering (and no sync on CUDA). This
    costs ~5 passes over the output against ~12 for repeat_interleave + arange + per-element 2-D indexing.
    """
    lens, kv_indptr, total = kv_indptr_from_lens(kv_lens, total)
    device = lens.device
    rows = req_pool_indices.to(torch.int64)
    starts = None if kv_start is None else kv_start.to(torch.int64)
    if device.type == "cpu":  # on CUDA the check would cost a device sync per step
        _check_bounds(req_to_token, rows, lens, starts, kv_indptr, total)
    kv_indices = torch.empty(total, dtype=torch.int64, device=device)
    if total == 0:
        return kv_indptr, kv_indices
    table = req_to_token.contiguous()
    base = rows * table.stride(0) - kv_indptr[:-1]
    if starts is not None:
        base += starts
    step = torch.diff(base, prepend=base.new_ones(1))  # element 0 is then 1 + (base_0 - 1) = base_0
    step.masked_fill_(kv_indptr[:-1] >= total, 0)  # trailing empty requests begin past the end
    kv_indices.fill_(1)
    kv_indices.index_add_(0, kv_indptr[:-1].clamp(max=total - 1), step)
    kv_indices.cumsum_(0)
    kv_indices.copy_(table.view(-1).index_select(0, kv_indices))
    return kv_indptr, kv_indices


def _check_bounds(req_to_token: torch.Tensor, rows: torch.Tensor, lens: torch.Tensor, starts: torch.Tensor | None,
                  kv_indptr: torch.Tensor, total: int) -> None:
    """Reject what would otherwise read a neighbouring row silently (the flat index does not see row ends)."""
    if total != int(kv_indptr[-1]):
        raise ValueError(f"total={total} but the kv_lens sum to {int(kv_indptr[-1])}")
    if lens.numel() == 0:
        return
    first = torch.zeros_like(lens) if starts is None else starts
    n_rows, width = req_to_token.shape
    bad = (lens < 0) | (first < 0) | (first + lens > width) | (rows < 0) | (rows >= n_rows)
    if bool(bad.any()):
        raise out_of_bounds_error(req_to_token, rows, lens, starts, int(bad.nonzero()[0]))


def padded_kv_indices(kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_lens: torch.Tensor,
                      max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (indices [B, max_len] with 0 in padding, valid mask [B, max_len])."""
    batch = kv_lens.numel()
    valid = torch.arange(max_len, device=kv_lens.device)[None, :] < kv_lens.to(torch.int64)[:, None]
    padded = torch.zeros(batch, max_len, dtype=torch.int64, device=kv_lens.device)
    padded[valid] = kv_indices  # boolean assignment walks rows in order, matching the ragged layout
    return padded, valid
