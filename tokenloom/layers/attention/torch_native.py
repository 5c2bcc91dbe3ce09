"""`torch_native` attention: batched attention over each request's KV gathered from the paged pool.

Metadata per step: ragged `kv_indptr`/`kv_indices` from `req_to_token` (kv_indices.py), turned into a
[B, max_len] slot matrix and a validity mask. Per layer the new K/V are stored with `index_copy_`, then the
request's K/V rows are gathered with one `index_select` per tensor (a row copy, ~5x faster than advanced
indexing).

- Decode: one query per request; scores = q·K in float32 with padding masked, softmax, weighted sum of V
  (matmul/softmax/matmul; measured faster than the masked SDPA kernel at this shape).
- Extend: queries are scattered into [B, Qmax]; when no request has a cached prefix (plain prefill), SDPA
  runs with `is_causal`; otherwise with an explicit causal-with-prefix mask.

GQA without copying K/V per query head: the query heads of one KV group are folded into the query axis.
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
    kv_slots_flat: torch.Tensor  # [B * L] slot ids, 0 in padding
    batch_size: int
    max_len: int
    q_max: int
    # Decode: additive float32 mask [B, 1, 1, L] (0 or -inf). Extend: boolean mask [B, 1, Qmax, L], or None
    # when plain causal attention is exact (single request, no cached prefix).
    mask: torch.Tensor | None
    query_slot: torch.Tensor | None  # extend: flat index of each token in the [B * Qmax] query layout
    grouped_mask: torch.Tensor | None = None  # extend mask repeated over the GQA group, built on first use


class TorchNativeBackend(AttentionBackend):
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        seq_lens = batch.seq_lens
        kv_indptr, kv_indices = build_kv_indices(
            self.req_to_token_pool.req_to_token, batch.req_pool_indices, seq_lens)
        max_len = batch.max_seq_len
        kv_slots, valid = padded_kv_indices(kv_indptr, kv_indices, seq_lens, max_len)
        device = seq_lens.device
        bsz = batch.batch_size
        if batch.forward_mode.is_decode():
            mask = torch.zeros(bsz, 1, 1, max_len, dtype=torch.float32, device=device)
            mask.masked_fill_(~valid[:, None, None, :], float("-inf"))
            md = TorchNativeMetadata(kv_indptr, kv_indices, kv_slots.view(-1), bsz, max_len, 1, mask, None)
        else:
            q_max = batch.max_extend_len
            offset_in_req = torch.arange(batch.input_ids.numel(), device=device) - batch.extend_start_loc[
                batch.token_req_index]
            query_slot = batch.token_req_index * q_max + offset_in_req
            if int(batch.extend_prefix_lens.max()) == 0:
                # No cached prefix anywhere: query and key positions coincide, padding sits at the end of
                # each row, so plain causal attention is exact for every real token.
                mask = None
            else:  # query i of request b sits at position prefix_b + i and sees kv positions <= it
                q_pos = batch.extend_prefix_lens[:, None] + torch.arange(q_max, device=device)[None, :]
                kv_pos = torch.arange(max_len, device=device)
                mask = ((kv_pos[None, None, :] <= q_pos[:, :, None]) & valid[:, None, :])[:, None]
            md = TorchNativeMetadata(kv_indptr, kv_indices, kv_slots.view(-1), bsz, max_len, q_max, mask,
                                     query_slot)
        batch.attn_metadata = md

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, scaling: float,
                batch: ForwardBatch) -> torch.Tensor:
        md: TorchNativeMetadata = batch.attn_metadata
        self.kv_pool.set_kv(layer_id, batch.out_cache_loc, k, v)
        k_buf, v_buf = self.kv_pool.get_kv(layer_id)  # [Hkv, rows, D]
        num_kv_heads, head_dim = k_buf.shape[0], k_buf.shape[2]
        group = q.shape[1] // num_kv_heads
        shape = (num_kv_heads, md.batch_size, md.max_len, head_dim)
        k_g = k_buf.index_select(1, md.kv_slots_flat).view(shape).to(q.dtype)  # [Hkv, B, L, D], contiguous
        v_g = v_buf.index_select(1, md.kv_slots_flat).view(shape).to(q.dtype)
        if batch.forward_mode.is_decode():
            return _decode(q, k_g, v_g, md.mask, scaling, group)
        return self._extend(q, k_g.transpose(0, 1), v_g.transpose(0, 1), md, scaling, group)

    def _extend(self, q: torch.Tensor, k_pad: torch.Tensor, v_pad: torch.Tensor, md: TorchNativeMetadata,
                scaling: float, group: int) -> torch.Tensor:
        bsz, num_kv_heads, _, head_dim = k_pad.shape
        num_heads = q.shape[1]
        q_pad = q.new_zeros(bsz * md.q_max, num_heads, head_dim)
        q_pad[md.query_slot] = q
        if md.mask is None:  # no prefix: plain causal attention, GQA handled by SDPA
            q4 = q_pad.view(bsz, md.q_max, num_heads, head_dim).transpose(1, 2)
            out = F.scaled_dot_product_attention(q4, k_pad, v_pad, is_causal=True, scale=scaling, enable_gqa=True)
            return out.transpose(1, 2).reshape(bsz * md.q_max, num_heads * head_dim)[md.query_slot]
        # [B, Qmax, Hkv, G, D] -> [B, Hkv, Qmax * G, D]
        q_pad = q_pad.view(bsz, md.q_max, num_kv_heads, group, head_dim).permute(0, 2, 1, 3, 4)
        q_pad = q_pad.reshape(bsz, num_kv_heads, md.q_max * group, head_dim)
        if md.grouped_mask is None:
            md.grouped_mask = md.mask if group == 1 else md.mask.repeat_interleave(group, dim=2)
        out = F.scaled_dot_product_attention(q_pad, k_pad, v_pad, attn_mask=md.grouped_mask, scale=scaling)
        out = out.view(bsz, num_kv_heads, md.q_max, group, head_dim).permute(0, 2, 1, 3, 4)
        return out.reshape(bsz * md.q_max, num_heads * head_dim)[md.query_slot]


def _decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scaling: float,
            group: int) -> torch.Tensor:
    """q [B, Hq, D]; k/v [Hkv, B, L, D] contiguous; mask [B, 1, 1, L] additive -> [B, Hq * D].

    Batched over (Hkv, B) with the query heads of a KV group as rows: no copy of K or V."""
    num_kv_heads, bsz, _, head_dim = k.shape
    qg = q.view(bsz, num_kv_heads, group, head_dim).transpose(0, 1)  # [Hkv, B, G, D]
    scores = torch.matmul(qg, k.transpose(2, 3)).float()  # [Hkv, B, G, L]
    scores = scores.mul_(scaling).add_(mask.view(1, bsz, 1, -1))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    out = torch.matmul(probs, v)  # [Hkv, B, G, D]
    return out.transpose(0, 1).reshape(bsz, num_kv_heads * group * head_dim)
