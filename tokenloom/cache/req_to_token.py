"""`ReqToTokenPool`: the table that maps (request slot, token position) to a KV slot id.

Lifecycle of a row: `alloc` hands out free rows when requests start running, the model runner writes the
KV slot of every new token into its row before the forward, `free` returns the row when the request
finishes (or is retracted). A chunked request keeps its row between chunks.
Invariant: `available_size() + rows in use == size`.
"""

from __future__ import annotations

import torch


class ReqToTokenPool:
    def __init__(self, size: int, max_context_len: int, device: torch.device) -> None:
        self.size = size
        self.max_context_len = max_context_len
        self.device = device
        self.req_to_token = torch.zeros(size, max_context_len, dtype=torch.int32, device=device)
        self._free_rows: list[int] = list(range(size))

    def available_size(self) -> int:
        return len(self._free_rows)

    def alloc(self, n: int) -> list[int] | None:
        """Take `n` rows, or None (taking nothing) when fewer are free."""
        if n > len(self._free_rows):
            return None
        rows, self._free_rows = self._free_rows[:n], self._free_rows[n:]
        return rows

    def free(self, rows: int | list[int]) -> None:
        self._free_rows.extend([rows] if isinstance(rows, int) else rows)

    def write(self, rows: torch.Tensor, positions: torch.Tensor, kv_slots: torch.Tensor) -> None:
        """req_to_token[rows[i], positions[i]] = kv_slots[i] for every i, in one indexed store."""
        long = torch.int64  # (a no-op conversion still costs a dispatch: skipped, like every one on the decode path)
        rows = rows if rows.dtype == long else rows.long()
        positions = positions if positions.dtype == long else positions.long()
        self.req_to_token[rows, positions] = kv_slots.to(torch.int32)

    def clear(self) -> None:
        self._free_rows = list(range(self.size))
