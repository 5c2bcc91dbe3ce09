"""`KVPool`: per-layer K and V tensors indexed by KV slot id, for the layers this process owns.

Shape per layer: [size + page_size, kv_heads_local, head_dim]; slot 0 is the dummy slot padded tokens write
to, and the pool is allocated for layers [start_layer, end_layer) only (a pipeline stage holds its own).
"""

from __future__ import annotations

import torch


class KVPool:
    def __init__(self, size: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, start_layer: int, end_layer: int) -> None:
        self.size = size
        self.page_size = page_size
        self.dtype = dtype
        self.start_layer = start_layer
        self.end_layer = end_layer
        rows = size + page_size
        n = end_layer - start_layer
        self.k_buffers = [torch.zeros(rows, num_kv_heads, head_dim, dtype=dtype, device=device) for _ in range(n)]
        self.v_buffers = [torch.zeros(rows, num_kv_heads, head_dim, dtype=dtype, device=device) for _ in range(n)]

    def set_kv(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        i = layer_id - self.start_layer
        self.k_buffers[i][slots] = k.to(self.dtype)
        self.v_buffers[i][slots] = v.to(self.dtype)

    def get_kv(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = layer_id - self.start_layer
        return self.k_buffers[i], self.v_buffers[i]

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.k_buffers + self.v_buffers)
