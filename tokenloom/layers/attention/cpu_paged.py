"""`cpu` attention: `torch_native` for extend, and the native paged decode kernel
(tokenloom/kernels/paged_attention.py) for decode, which reads K/V in place from the pool through
`kv_indptr`/`kv_indices` instead of gathering a padded copy. Used when the kernel builds on this machine.

Cascade decode: once per step, `init_forward_metadata` finds decode requests whose KV index lists start with
the same slots (a prefix they share through the radix cache) and plans groups; every layer's kernel call then
reads each shared prefix once for the whole group. `cascade=False` (`--disable-cascade-attention`) turns it off.

Sliding-window layers: `init_forward_metadata` also builds, once per step and per distinct window w that
binds (w < some request's length), index lists holding each request's last w positions only; a window layer's
kernel call reads those (no cascade: windows of different lengths rarely start on the same slots).
Over a sliding-window pool those lists are built for every window (they must be mapped to the sliding
layers' slots even where the window does not bind) and mapped through `full_to_swa`, as are the new tokens'
slots.

Soft-capped scores (`logit_cap`, Gemma 2's `attn_logit_softcapping`) are applied by the native kernel too
(`decode(..., logit_cap=...)`: every scaled score, cascade prefixes and windows included), so a capped layer's
decode reads the same indices as any other.

Extend (prefill, chunked prefill, prefixes from the radix cache): the native extend kernel
(tokenloom/kernels/extend_attention.py) where it has a path (a bf16 pool, head_dim 64 or 128, an AVX-512 CPU)
and the model has no sliding-window layer; it reads K/V in place through the same index lists and skips the
causal upper triangle instead of masking it. Elsewhere `torch_native`'s SDPA path, caps included.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tokenloom.cache.kv_pool import KVPool
from tokenloom.cache.req_to_token import ReqToTokenPool
from tokenloom.forward_batch import ForwardBatch
from tokenloom.kernels import extend_attention, paged_attention
from tokenloom.kernels.native_kv_indices import native_kv_index_builder, store_decode_slots_and_build_indices
from tokenloom.layers.attention.torch_native import TorchNativeBackend
from tokenloom.layers.kv_indices import build_kv_indices


@dataclass
class CpuDecodeMetadata:
    kv_indptr: torch.Tensor  # [B + 1] int64
    kv_indices: torch.Tensor  # [sum of lengths] int64
    shared: paged_attention.SharedPrefixPlan | None  # None: every request attends its own KV
    # window -> (kv_indptr, kv_indices) over each request's last `window` positions; windows that bind only
    windowed: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    swa_out_loc: torch.Tensor | None = None  # the new tokens' slots in the sliding layers' pool


@dataclass
class CpuExtendMetadata:
    kv_indptr: torch.Tensor  # [B + 1] int64
    kv_indices: torch.Tensor  # [sum of lengths] int64: each request's prefix, then its new tokens
    q_start: torch.Tensor  # [B] int64: first new token's row in the step's tokens
    q_len: torch.Tensor  # [B] int64: new tokens


class CpuPagedBackend(TorchNativeBackend):
    def __init__(self, req_to_token_pool: ReqToTokenPool, kv_pool: KVPool, num_heads: int | None = None,
                 cascade: bool = True, layer_windows: Sequence[int] = ()) -> None:
        super().__init__(req_to_token_pool, kv_pool, layer_windows)
        kv_heads = kv_pool.k_buffers[0].shape[0] if kv_pool.k_buffers else 1
        self.group = max(1, (num_heads or kv_heads) // kv_heads)
        self.cascade = cascade
        head_dim = kv_pool.k_buffers[0].shape[2] if kv_pool.k_buffers else 0
        self.native_extend = (bool(kv_pool.k_buffers) and kv_pool.k_buffers[0].dtype == torch.bfloat16
                              and not self.windows and self.full_to_swa is None
                              and extend_attention.available(torch.bfloat16, self.group, head_dim))

    def stores_new_slots(self, batch: ForwardBatch) -> bool:
        """A decode batch that knows its KV total (the scheduler's steady state, `ForwardBatch.build_decode`),
        with no sliding windows, over a CPU int32 table: one native call stores the new slots and builds the
        index lists (`store_decode_slots_and_build_indices`), instead of a store and a build with the tensor ops
        between them, each costing tens of microseconds right after a step's weight stream."""
        table = self.req_to_token_pool.req_to_token
        return (batch.forward_mode.is_decode() and batch.kv_total is not None and not self.windows
                and self.full_to_swa is None and table.device.type == "cpu" and table.dtype == torch.int32
                and table.stride(1) == 1 and native_kv_index_builder() is not None
                and all(t.dtype == torch.int64 and t.is_contiguous()
                        for t in (batch.req_pool_indices, batch.seq_lens, batch.out_cache_loc)))

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        if not batch.forward_mode.is_decode():
            if not self.native_extend:
                super().init_forward_metadata(batch)
                return
            kv_indptr, kv_indices = build_kv_indices(self.req_to_token_pool.req_to_token, batch.req_pool_indices,
                                                     batch.seq_lens)
            batch.attn_metadata = CpuExtendMetadata(kv_indptr, kv_indices, batch.extend_start_loc,
                                                    batch.extend_seq_lens)
            return
        table, rows, seq_lens = self.req_to_token_pool.req_to_token, batch.req_pool_indices, batch.seq_lens
        if self.stores_new_slots(batch):
            kv_indptr, kv_indices = store_decode_slots_and_build_indices(table, rows, seq_lens, batch.out_cache_loc,
                                                                         batch.kv_total)
        else:
            kv_indptr, kv_indices = build_kv_indices(table, rows, seq_lens)
        shared = paged_attention.plan_shared_prefixes(kv_indptr, kv_indices, self.group) if self.cascade else None
        windowed = {}
        swa = self.full_to_swa
        for w in self.windows:
            if w < batch.max_seq_len or swa is not None:  # the query at seq_len - 1 sees [seq_len - w, seq_len)
                indptr, indices = build_kv_indices(table, rows, seq_lens.clamp(max=w), (seq_lens - w).clamp(min=0))
                windowed[w] = (indptr, indices if swa is None else swa[indices])
        swa_out_loc = None if swa is None else swa[batch.out_cache_loc]
        batch.attn_metadata = CpuDecodeMetadata(kv_indptr, kv_indices, shared, windowed, swa_out_loc)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, scaling: float,
                batch: ForwardBatch, logit_cap: float = 0.0) -> torch.Tensor:
        if not batch.forward_mode.is_decode():
            if not isinstance(batch.attn_metadata, CpuExtendMetadata):
                return super().forward(q, k, v, layer_id, scaling, batch, logit_cap)
            ext: CpuExtendMetadata = batch.attn_metadata
            self.kv_pool.set_kv(layer_id, batch.out_cache_loc, k, v)
            k_buf, v_buf = self.kv_pool.get_kv(layer_id)
            out = extend_attention.extend(q, k_buf, v_buf, ext.kv_indptr, ext.kv_indices, ext.q_start, ext.q_len,
                                          scaling, logit_cap)
            return out.to(q.dtype)
        md: CpuDecodeMetadata = batch.attn_metadata
        k_buf, v_buf = self.kv_pool.get_kv(layer_id)
        window = md.windowed.get(self.window_of(layer_id))
        kv_indptr, kv_indices, shared = (md.kv_indptr, md.kv_indices, md.shared) if window is None \
            else (*window, None)
        out_loc = md.swa_out_loc if self.in_swa_pool(layer_id) else batch.out_cache_loc
        out = paged_attention.decode(q, k_buf, v_buf, kv_indptr, kv_indices, scaling, k_new=k, v_new=v,
                                     out_loc=out_loc, shared=shared, logit_cap=logit_cap)  # stores k/v, then attends
        return out.to(q.dtype)

    @staticmethod
    def supported(dtype: torch.dtype, device: torch.device, group: int, head_dim: int) -> bool:
        return device.type == "cpu" and paged_attention.available(dtype, group, head_dim)
