"""`torch_native` attention: dense batched SDPA over each request's KV gathered from the paged pool.

Metadata per step: ragged `kv_indptr`/`kv_indices` from `req_to_token` (kv_indices.py), turned into a
[B, max_len] slot matrix, plus a [B, 1, Qmax, max_len] boolean mask (causal with each request's prefix
offset, padding masked). Per layer: gather K/V rows by slot, scatter the ragged queries into [B, Qmax],
run `scaled_dot_product_attention`, and pick the valid rows back out.

GQA without copying K/V per query head: queries of one KV group are folded into the query-length axis,
so the SDPA call sees Hkv heads of Qmax * group rows each.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenloom.executor.forward_batch import ForwardBatch
from tokenloom.layers.attention.base import AttentionBackend
from tokenloom.layers.kv_indices import build_kv_indices, padded_kv_indices


@dataclass
class TorchNativeMetadata:
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_slots: torch.Tensor  # [B, L] slot ids, 0 in padding
    mask: torch.Tensor  # [B, 1, Qmax, L] True where attention is allowed
    query_slot: torch.Tensor  # [T] flat index of each token in the [B * Qmax] padded query layout
    q_max: int
    grouped_mask: torch.Tensor | None = None  # mask repeated over the GQA group, built on first use


class TorchNativeBackend(AttentionBackend):
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        seq_lens = batch.seq_lens
        kv_indptr, kv_indices = build_kv_indices(
            self.req_to_token_pool.req_to_token, batch.req_pool_indices, seq_lens)
        max_len = batch.max_seq_len
        kv_slots, valid = padded_kv_indices(kv_indptr, kv_indices, seq_lens, max_len)
        q_max = batch.max_extend_len
        device = seq_lens.device
        if batch.forward_mode.is_decode():
            mask = valid[:, None, None, :]
            query_slot = torch.arange(batch.batch_size, device=device)
        else:
            # query i of request b sits at position prefix_b + i and may see kv positions <= it.
            q_pos = batch.extend_prefix_lens[:, None] + torch.arange(q_max, device=device)[None, :]
            kv_pos = torch.arange(max_len, device=device)
            mask = (kv_pos[None, None, :] <= q_pos[:, :, None]) & valid[:, None, :]
            mask = mask[:, None]
            offset_in_req = torch.arange(batch.input_ids.numel(), device=device) - batch.extend_start_loc[
                batch.token_req_index]
            query_slot = batch.token_req_index * q_max + offset_in_req
        batch.attn_metadata = TorchNativeMetadata(kv_indptr, kv_indices, kv_slots, mask, query_slot, q_max)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, scaling: float,
                batch: ForwardBatch) -> torch.Tensor:
        md: TorchNativeMetadata = batch.attn_metadata
        self.kv_pool.set_kv(layer_id, batch.out_cache_loc, k, v)
        k_buf, v_buf = self.kv_pool.get_kv(layer_id)
        bsz, max_len = md.kv_slots.shape
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = k_buf.shape[1]
        group = num_heads // num_kv_heads
        # [B, L, Hkv, D] -> [B, Hkv, L, D]
        k_pad = k_buf[md.kv_slots].transpose(1, 2)
        v_pad = v_buf[md.kv_slots].transpose(1, 2)
        q_pad = q.new_zeros(bsz * md.q_max, num_heads, head_dim)
        q_pad[md.query_slot] = q
        # [B, Qmax, Hkv, G, D] -> [B, Hkv, Qmax * G, D]
        q_pad = q_pad.view(bsz, md.q_max, num_kv_heads, group, head_dim).permute(0, 2, 1, 3, 4)
        q_pad = q_pad.reshape(bsz, num_kv_heads, md.q_max * group, head_dim)
        if md.grouped_mask is None:
            md.grouped_mask = md.mask if group == 1 else md.mask.repeat_interleave(group, dim=2)
        mask = md.grouped_mask
        out = F.scaled_dot_product_attention(q_pad, k_pad.to(q.dtype), v_pad.to(q.dtype), attn_mask=mask,
                                             scale=scaling)
        # [B, Hkv, Qmax * G, D] -> [B * Qmax, Hkv * G * D]
        out = out.view(bsz, num_kv_heads, md.q_max, group, head_dim).permute(0, 2, 1, 3, 4)
        out = out.reshape(bsz * md.q_max, num_heads * head_dim)
        return out[md.query_slot]
