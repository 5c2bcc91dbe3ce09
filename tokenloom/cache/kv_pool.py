"""`KVPool`: per-layer K and V tensors indexed by KV slot id, for the layers this process owns.

Shape per layer: [kv_heads_local, size + page_size, head_dim] (head-major, so gathering a batch's slots
gives [heads, tokens, dim] that batched matmuls use without copies); slot 0 is the dummy slot padded tokens
write to, and the pool is allocated for layers [start_layer, end_layer) only (a pipeline stage holds its own).
The native attention kernels read this layout with fixed strides; so a page of a layer is 2 * kv_heads
contiguous runs (K and V of each head), not one (see cache/kv_memory.py).
"""

from __future__ import annotations

import torch


class KVPool:
    def __init__(self, size: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, start_layer: int, end_layer: int) -> None:
        self.size = size
        self.page_size = page_size
        self.dtype = dtype
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.start_layer = start_layer
        self.end_layer = end_layer
        rows = size + page_size
        n = end_layer - start_layer
        self.k_buffers = [torch.zeros(num_kv_heads, rows, head_dim, dtype=dtype, device=device) for _ in range(n)]
        self.v_buffers = [torch.zeros(num_kv_heads, rows, head_dim, dtype=dtype, device=device) for _ in range(n)]

    def set_kv(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [T, kv_heads, head_dim] for tokens stored at `slots`."""
        i = layer_id - self.start_layer
        self.k_buffers[i].index_copy_(1, slots, k.transpose(0, 1).to(self.dtype))
        self.v_buffers[i].index_copy_(1, slots, v.transpose(0, 1).to(self.dtype))

    def get_kv(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = layer_id - self.start_layer
        return self.k_buffers[i], self.v_buffers[i]

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.k_buffers + self.v_buffers)
