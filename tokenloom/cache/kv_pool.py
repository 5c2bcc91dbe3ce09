"""`KVPool`: the K and V of every layer this process owns, indexed by KV slot id, in one contiguous buffer.

`buffer` has shape [layers, 2, kv_heads_local, size + page_size, head_dim] for layers [start_layer,
end_layer) only (a pipeline stage holds its own); index 1 picks K (0) or V (1). Slot 0 is the dummy slot
padded tokens write to. `k_buffers[i]` / `v_buffers[i]` are the views `buffer[i, 0]` / `buffer[i, 1]`, each
[kv_heads, rows, head_dim] and contiguous (head-major, so gathering a batch's slots gives [heads, tokens,
dim] that batched matmuls use without copies); the native attention kernels read them with fixed strides
from their data pointers. One allocation lets a transfer engine register the pool as a single buffer;
`layout` describes it as data (cache/kv_layout.py). A page of a layer is still 2 * kv_heads
contiguous runs (K and V of each head), not one (see cache/kv_memory.py).
"""

from __future__ import annotations

import torch

from tokenloom.cache.kv_layout import KVLayout


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
        self.rows = size + page_size
        n = end_layer - start_layer
        self.buffer = torch.zeros(n, 2, num_kv_heads, self.rows, head_dim, dtype=dtype, device=device)
        self.k_buffers = [self.buffer[i, 0] for i in range(n)]
        self.v_buffers = [self.buffer[i, 1] for i in range(n)]

    def set_kv(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [T, kv_heads, head_dim] for tokens stored at `slots`."""
        i = layer_id - self.start_layer
        self.k_buffers[i].index_copy_(1, slots, k.transpose(0, 1).to(self.dtype))
        self.v_buffers[i].index_copy_(1, slots, v.transpose(0, 1).to(self.dtype))

    def get_kv(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = layer_id - self.start_layer
        return self.k_buffers[i], self.v_buffers[i]

    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def layout(self, head_start: int) -> KVLayout:
        """`buffer` as data for a peer; `head_start` is the global index of this rank's first KV head (the
        pool does not know its TP shard; disaggregation/pairing.py computes it)."""
        return KVLayout(base_addr=self.buffer.data_ptr(), start_layer=self.start_layer, end_layer=self.end_layer,
                        num_heads=self.num_kv_heads, head_start=head_start, rows=self.rows, head_dim=self.head_dim,
                        itemsize=self.buffer.element_size(), page_size=self.page_size,
                        dtype=str(self.dtype).removeprefix("torch."))
