"""Flattened KV indices for a batch: which pool slots each request's attention reads.

`kv_indptr[i]:kv_indptr[i+1]` spans request i's slots in `kv_indices`, which are
`req_to_token[req_pool_indices[i], start[i] : start[i] + kv_lens[i]]`. Built with one gather, no Python loop
over requests. `padded_kv_indices` turns the ragged form into a [batch, max_len] matrix (padding points at
the dummy slot 0) for backends that run dense batched attention.
"""

from __future__ import annotations

import torch


def build_kv_indices(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, kv_lens: torch.Tensor,
                     kv_start: torch.Tensor | None = None, total: int | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (kv_indptr [B+1] int64, kv_indices [sum(kv_lens)] int64).

    `total` (= sum(kv_lens)) may be passed when the caller knows it, which avoids a device sync on CUDA.
    """
    kv_lens = kv_lens.to(torch.int64)
    device = kv_lens.device
    kv_indptr = torch.zeros(kv_lens.numel() + 1, dtype=torch.int64, device=device)
    torch.cumsum(kv_lens, 0, out=kv_indptr[1:])
    if total is None:
        total = int(kv_indptr[-1])
    req = torch.repeat_interleave(torch.arange(kv_lens.numel(), device=device), kv_lens, output_size=total)
    cols = torch.arange(total, device=device) - kv_indptr[req]
    if kv_start is not None:
        cols = cols + kv_start.to(torch.int64)[req]
    rows = req_pool_indices.to(torch.int64)[req]
    return kv_indptr, req_to_token[rows, cols].to(torch.int64)


def padded_kv_indices(kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_lens: torch.Tensor,
                      max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (indices [B, max_len] with 0 in padding, valid mask [B, max_len])."""
    batch = kv_lens.numel()
    valid = torch.arange(max_len, device=kv_lens.device)[None, :] < kv_lens.to(torch.int64)[:, None]
    padded = torch.zeros(batch, max_len, dtype=torch.int64, device=kv_lens.device)
    padded[valid] = kv_indices  # boolean assignment walks rows in order, matching the ragged layout
    return padded, valid
