"""What every KV-index builder shares (layers/kv_indices.py's torch path, the native and the Triton kernels):
the request offsets `kv_indptr` from the lengths, and the error for a slice outside `req_to_token`."""

from __future__ import annotations

import torch


def kv_indptr_from_lens(kv_lens: torch.Tensor, total: int | None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(kv_lens as int64, kv_indptr [B+1] int64, total): the part both implementations share."""
    lens = kv_lens if kv_lens.dtype == torch.int64 else kv_lens.to(torch.int64)
    kv_indptr = torch.zeros(lens.numel() + 1, dtype=torch.int64, device=lens.device)
    torch.cumsum(lens, 0, out=kv_indptr[1:])
    if total is None:
        total = int(kv_indptr[-1])
    return lens, kv_indptr, total


def out_of_bounds_error(req_to_token: torch.Tensor, rows: torch.Tensor, lens: torch.Tensor,
                        starts: torch.Tensor | None, i: int) -> IndexError:
    """The error for request i, whose slice does not lie inside `req_to_token`."""
    first = 0 if starts is None else int(starts[i])
    return IndexError(f"request {i}: row {int(rows[i])}, columns [{first}, {first + int(lens[i])}) "
                      f"outside req_to_token of shape {tuple(req_to_token.shape)}")
