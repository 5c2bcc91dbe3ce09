"""`KVPool`: the K and V of every layer this process owns, indexed by KV slot id, in one contiguous buffer.

`buffer` has shape [layers, 2, kv_heads_local, size + page_size, head_dim] for layers [start_layer,
end_layer) only (a pipeline stage holds its own); index 1 picks K (0) or V (1). Slot 0 is the dummy slot
padded tokens write to. `k_buffers[i]` / `v_buffers[i]` are the views `buffer[i, 0]` / `buffer[i, 1]`, each
[kv_heads, rows, head_dim] and contiguous (head-major, so gathering a batch's slots gives [heads, tokens,
dim] that batched matmuls use without copies); the native attention kernels read them with fixed strides
from their data pointers. One allocation lets a transfer engine register the pool as a single buffer;
`layout` describes it as data (cache/kv_layout.py). A page of a layer is still 2 * kv_heads
contiguous runs (K and V of each head), not one (see cache/kv_memory.py).

fp8 pools (`--kv-cache-dtype fp8_e4m3 | fp8_e5m2`, `kv_storage_dtype`): K and V are stored as
torch.float8_e4m3fn / torch.float8_e5m2, one byte per element, as plain casts with scale 1.0 (what SGLang
stores when no scales are given): no per-tensor or per-head scale exists anywhere. Values are rounded to
nearest even and saturate at the format's largest finite value (+-448 for e4m3, +-57344 for e5m2) instead of
becoming NaN or inf; readers widen them exactly (every fp8 value is a bf16 and a float32 value). The native
kernels write the same bytes (csrc/paged_attention.c `f32_to_fp8`), so either path may write a slot the
other reads. torch has no `index_copy_` for fp8, so the pool writes through a uint8 view of the buffer.
"""

from __future__ import annotations

import torch

from tokenloom.cache.kv_layout import KVLayout

# `--kv-cache-dtype` value -> the pool's storage dtype (`auto`: the model's dtype).
FP8_KV_DTYPES: dict[str, torch.dtype] = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the KV pool stores for `--kv-cache-dtype` (config.KV_CACHE_DTYPES) and the model's dtype."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in FP8_KV_DTYPES:
        raise ValueError(f"--kv-cache-dtype must be one of auto, {', '.join(FP8_KV_DTYPES)}; got {kv_cache_dtype!r}")
    return FP8_KV_DTYPES[kv_cache_dtype]


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_KV_DTYPES.values()


def to_kv_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` cast to the pool's dtype; fp8 saturates at the format's largest finite value (see the module
    docstring) rather than relying on the cast's overflow behaviour (inf for e5m2)."""
    if is_fp8(dtype):
        limit = torch.finfo(dtype).max
        return x.float().clamp_(-limit, limit).to(dtype)
    return x.to(dtype)


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
        self.fp8 = is_fp8(dtype)
        # writable views for index_copy_, which torch lacks for fp8 (same memory)
        raw = self.buffer.view(torch.uint8) if self.fp8 else self.buffer
        self._k_write = [raw[i, 0] for i in range(n)]
        self._v_write = [raw[i, 1] for i in range(n)]

    def set_kv(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [T, kv_heads, head_dim] for tokens stored at `slots` (cast to the pool's dtype)."""
        i = layer_id - self.start_layer
        k, v = to_kv_dtype(k.transpose(0, 1), self.dtype), to_kv_dtype(v.transpose(0, 1), self.dtype)
        if self.fp8:
            k, v = k.view(torch.uint8), v.view(torch.uint8)
        self._k_write[i].index_copy_(1, slots, k)
        self._v_write[i].index_copy_(1, slots, v)

    def read_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """Every layer's K and V at `slots`: [layers, 2, kv_heads, len(slots), head_dim] (a copy)."""
        return self.buffer.index_select(3, slots)

    def write_slots(self, slots: torch.Tensor, data: torch.Tensor) -> None:
        """Store `read_slots`' result (of this pool's shape and dtype) at `slots`."""
        if data.dtype != self.dtype:
            raise ValueError(f"KV data of dtype {data.dtype} cannot be written into a {self.dtype} pool")
        data = data.to(self.buffer.device)
        if self.fp8:
            self.buffer.view(torch.uint8).index_copy_(3, slots, data.view(torch.uint8))
        else:
            self.buffer.index_copy_(3, slots, data)

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
