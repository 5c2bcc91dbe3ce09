"""`torch_native` attention: batched attention over each request's KV gathered from the paged pool.

Metadata per step: ragged `kv_indptr`/`kv_indices` from `req_to_token` (kv_indices.py), turned into a
[B, max_len] slot matrix and a validity mask. Per layer the new K/V are stored with `index_copy_`, then the
request's K/V rows are gathered with one `index_select` per tensor (a row copy, ~5x faster than advanced
indexing).

- Decode: one query per request; scores = q·K in float32 with padding masked, softmax, weighted sum of V
  (matmul/softmax/matmul; measured faster than the masked SDPA kernel at this shape).
- Extend, requests of similar lengths: queries are scattered into [B, Qmax]; when no request has a cached
  prefix (plain prefill), SDPA runs with `is_causal`; otherwise with an explicit causal-with-prefix mask.
- Extend, requests of mixed lengths (padding would more than `PADDING_WASTE_LIMIT`-fold the attention
  area): one SDPA call per request over exactly its own K/V, `is_causal` without a cached prefix, else a
  causal mask aligned to the end of its keys. Padding every request to the longest one doubled the
  attention time of a typical chunked-prefill step (bench: 7 prompts of 140-500 tokens, 12.4 vs 5.9 ms
  per layer).

GQA without copying K/V per query head: the query heads of one KV group are folded into the query axis.

Sliding-window layers (`layer_windows`): the same gathered K/V with the window's rule added to the mask
(key position > query position - window), one mask per distinct window built once per step. A window no
shorter than the batch's longest sequence cannot bind, so such steps use the full-attention path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenloom.forward_batch import ForwardBatch
from tokenloom.layers.attention.base import AttentionBackend
from tokenloom.layers.kv_indices import build_kv_indices, padded_kv_indices

# Extend attention runs request by request when padding to [B, Qmax, max_len] would cover more than this
# many times the area the requests' own (query x key) blocks cover.
PADDING_WASTE_LIMIT = 1.25


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
    # extend run request by request: per request (first token, new tokens, cached prefix, its KV slots)
    per_request: list[tuple[int, int, int, torch.Tensor]] | None = None
    request_masks: dict = None  # (new, prefix, group, window) -> boolean mask, built on first use
    # sliding-window pool: the step's new-token slots and KV slots mapped to the sliding layers' pool
    swa_out_loc: torch.Tensor | None = None
    swa_slots_flat: torch.Tensor | None = None
    swa_per_request: list[torch.Tensor] | None = None
    # window -> that window's mask (the layout of `mask`); only windows that bind in this step
    window_masks: dict[int, torch.Tensor] | None = None
    grouped_window_masks: dict[int, torch.Tensor] | None = None


class TorchNativeBackend(AttentionBackend):
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        seq_lens = batch.seq_lens
        kv_indptr, kv_indices = build_kv_indices(
            self.req_to_token_pool.req_to_token, batch.req_pool_indices, seq_lens)
        max_len = batch.max_seq_len
        kv_slots, valid = padded_kv_indices(kv_indptr, kv_indices, seq_lens, max_len)
        device = seq_lens.device
        bsz = batch.batch_size
        windows = [w for w in self.windows if w < max_len]  # a window >= every length never binds
        kv_pos = torch.arange(max_len, device=device)
        if batch.forward_mode.is_decode():
            md = _decode_metadata(kv_indptr, kv_indices, kv_slots, valid, seq_lens, max_len, windows)
        else:
            q_max = batch.max_extend_len
            per_request = self._per_request_plan(batch, kv_indptr, kv_indices, q_max, max_len)
            if per_request is not None:
                md = TorchNativeMetadata(kv_indptr, kv_indices, kv_slots.view(-1), bsz, max_len, q_max, None,
                                         None, per_request=per_request, request_masks={})
                batch.attn_metadata = self._map_swa(md, batch)
                return
            offset_in_req = torch.arange(batch.input_ids.numel(), device=device) - batch.extend_start_loc[
                batch.token_req_index]
            query_slot = batch.token_req_index * q_max + offset_in_req
            mask = None
            window_masks = {}
            no_prefix = int(batch.extend_prefix_lens.max()) == 0
            if not no_prefix or windows:  # query i of request b sits at position prefix_b + i
                q_pos = (batch.extend_prefix_lens[:, None] + torch.arange(q_max, device=device)[None, :])[:, :, None]
                causal = (kv_pos[None, None, :] <= q_pos) & valid[:, None, :]
                # No cached prefix anywhere: query and key positions coincide, padding sits at the end of
                # each row, so plain causal attention is exact for every real token of a full layer.
                mask = None if no_prefix else causal[:, None]
                window_masks = {w: (causal & (kv_pos[None, None, :] > q_pos - w))[:, None] for w in windows}
            md = TorchNativeMetadata(kv_indptr, kv_indices, kv_slots.view(-1), bsz, max_len, q_max, mask,
                                     query_slot, window_masks=window_masks)
        md.grouped_window_masks = {}
        batch.attn_metadata = self._map_swa(md, batch)

    def _map_swa(self, md: TorchNativeMetadata, batch: ForwardBatch) -> TorchNativeMetadata:
        if self.full_to_swa is not None:
            md.swa_out_loc = self.full_to_swa[batch.out_cache_loc]
            md.swa_slots_flat = self.full_to_swa[md.kv_slots_flat]
            if md.per_request is not None:
                md.swa_per_request = [self.full_to_swa[slots] for _, _, _, slots in md.per_request]
        return md

    @staticmethod
    def _per_request_plan(batch: ForwardBatch, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, q_max: int,
                          max_len: int) -> list[tuple[int, int, int, torch.Tensor]] | None:
        """The per-request extend plan when padding would waste more than PADDING_WASTE_LIMIT, else None."""
        if batch.batch_size < 2:
            return None
        new = batch.extend_seq_lens.tolist()
        total = batch.seq_lens.tolist()
        own_area = sum(n * t for n, t in zip(new, total, strict=True))
        if batch.batch_size * q_max * max_len <= PADDING_WASTE_LIMIT * own_area:
            return None
        starts = batch.extend_start_loc.tolist()
        bounds = kv_indptr.tolist()
        return [(starts[b], new[b], total[b] - new[b], kv_indices[bounds[b]: bounds[b + 1]])
                for b in range(batch.batch_size)]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, scaling: float,
                batch: ForwardBatch, logit_cap: float = 0.0) -> torch.Tensor:
        return self._attend(q, k, v, layer_id, scaling, batch, batch.attn_metadata, logit_cap)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, scaling: float,
                batch: ForwardBatch, md: TorchNativeMetadata, logit_cap: float) -> torch.Tensor:
        swa = self.in_swa_pool(layer_id)
        self.kv_pool.set_kv(layer_id, md.swa_out_loc if swa else batch.out_cache_loc, k, v)
        k_buf, v_buf = self.kv_pool.get_kv(layer_id)  # [Hkv, rows, D]
        window = self.window_of(layer_id)
        if md.per_request is not None:
            slots = md.swa_per_request if swa else [r[3] for r in md.per_request]
            return self._extend_per_request(q, k_buf, v_buf, md, scaling, window, slots, logit_cap)
        num_kv_heads, head_dim = k_buf.shape[0], k_buf.shape[2]
        group = q.shape[1] // num_kv_heads
        shape = (num_kv_heads, md.batch_size, md.max_len, head_dim)
        flat = md.swa_slots_flat if swa else md.kv_slots_flat
        k_g = k_buf.index_select(1, flat).view(shape).to(q.dtype)  # [Hkv, B, L, D], contiguous
        v_g = v_buf.index_select(1, flat).view(shape).to(q.dtype)
        window = window if window in (md.window_masks or {}) else 0
        if batch.forward_mode.is_decode():
            return _decode(q, k_g, v_g, md.window_masks[window] if window else md.mask, scaling, group, logit_cap)
        return self._extend(q, k_g.transpose(0, 1), v_g.transpose(0, 1), md, scaling, group, window, logit_cap)

    def _extend(self, q: torch.Tensor, k_pad: torch.Tensor, v_pad: torch.Tensor, md: TorchNativeMetadata,
                scaling: float, group: int, window: int = 0, logit_cap: float = 0.0) -> torch.Tensor:
        bsz, num_kv_heads, _, head_dim = k_pad.shape
        num_heads = q.shape[1]
        q_pad = q.new_zeros(bsz * md.q_max, num_heads, head_dim)
        q_pad[md.query_slot] = q
        if md.mask is None and not window:  # no prefix: plain causal attention, GQA handled by SDPA
            q4 = q_pad.view(bsz, md.q_max, num_heads, head_dim).transpose(1, 2)
            out = _sdpa(q4, k_pad, v_pad, is_causal=True, scale=scaling, enable_gqa=True, softcap=logit_cap)
            return out.transpose(1, 2).reshape(bsz * md.q_max, num_heads * head_dim)[md.query_slot]
        # [B, Qmax, Hkv, G, D] -> [B, Hkv, Qmax * G, D]
        q_pad = q_pad.view(bsz, md.q_max, num_kv_heads, group, head_dim).permute(0, 2, 1, 3, 4)
        q_pad = q_pad.reshape(bsz, num_kv_heads, md.q_max * group, head_dim)
        if window:
            mask = md.grouped_window_masks.get(window)
            if mask is None:
                mask = md.window_masks[window]
                mask = md.grouped_window_masks[window] = mask if group == 1 else mask.repeat_interleave(group, 2)
        else:
            if md.grouped_mask is None:
                md.grouped_mask = md.mask if group == 1 else md.mask.repeat_interleave(group, dim=2)
            mask = md.grouped_mask
        out = _sdpa(q_pad, k_pad, v_pad, attn_mask=mask, scale=scaling, softcap=logit_cap)
        out = out.view(bsz, num_kv_heads, md.q_max, group, head_dim).permute(0, 2, 1, 3, 4)
        return out.reshape(bsz * md.q_max, num_heads * head_dim)[md.query_slot]


    @staticmethod
    def _extend_per_request(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, md: TorchNativeMetadata,
                            scaling: float, window: int, request_slots: list[torch.Tensor],
                            logit_cap: float = 0.0) -> torch.Tensor:
        """Each request's queries against exactly its own K/V (`request_slots[b]`, in the layer's pool):
        q [T, Hq, D] -> [T, Hq * D]."""
        num_kv_heads, head_dim = k_buf.shape[0], k_buf.shape[2]
        num_heads = q.shape[1]
        group = num_heads // num_kv_heads
        out = q.new_empty(q.shape[0], num_heads * head_dim)
        for (start, new, prefix, _), slots in zip(md.per_request, request_slots, strict=True):
            # 4-D [1, H, L, D]: with 3-D inputs SDPA falls back from its flash kernel to the slow math path
            k_r = k_buf.index_select(1, slots).to(q.dtype).unsqueeze(0)  # [1, Hkv, L, D]
            v_r = v_buf.index_select(1, slots).to(q.dtype).unsqueeze(0)
            q_r = q[start: start + new]  # [n, Hq, D]
            w = window if window < prefix + new else 0  # a window covering every key does not bind
            if prefix == 0 and not w:  # keys and queries coincide: plain causal attention, GQA handled by SDPA
                o = _sdpa(q_r.transpose(0, 1).unsqueeze(0), k_r, v_r, is_causal=True, scale=scaling,
                          enable_gqa=True, softcap=logit_cap)  # [1, Hq, n, D]
                out[start: start + new] = o[0].transpose(0, 1).reshape(new, num_heads * head_dim)
                continue
            # query i sits at position prefix + i and sees keys <= it (and > it - w in a window layer); a KV
            # group's heads fold into the rows
            key = (new, prefix, group, w)
            mask = md.request_masks.get(key)
            if mask is None:
                q_pos = (prefix + torch.arange(new, device=q.device).repeat_interleave(group))[:, None]
                kv_pos = torch.arange(prefix + new, device=q.device)[None, :]
                mask = kv_pos <= q_pos
                if w:
                    mask &= kv_pos > q_pos - w
                md.request_masks[key] = mask
            q_g = q_r.view(new, num_kv_heads, group, head_dim).permute(1, 0, 2, 3).reshape(
                1, num_kv_heads, new * group, head_dim)
            o = _sdpa(q_g, k_r, v_r, attn_mask=mask, scale=scaling, softcap=logit_cap)
            out[start: start + new] = o.view(num_kv_heads, new, group, head_dim).permute(1, 0, 2, 3).reshape(
                new, num_heads * head_dim)
        return out


def _decode_metadata(kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_slots: torch.Tensor,
                     valid: torch.Tensor, seq_lens: torch.Tensor, max_len: int, windows: list[int]
                     ) -> TorchNativeMetadata:
    """A decode step's metadata: the padding mask, and per binding window its mask (the query sits at
    seq_len - 1 and sees keys > seq_len - 1 - w)."""
    bsz = seq_lens.numel()
    mask = torch.zeros(bsz, 1, 1, max_len, dtype=torch.float32, device=kv_slots.device)
    mask.masked_fill_(~valid[:, None, None, :], float("-inf"))
    md = TorchNativeMetadata(kv_indptr, kv_indices, kv_slots.view(-1), bsz, max_len, 1, mask, None)
    kv_pos = torch.arange(max_len, device=kv_slots.device)
    md.window_masks = {w: mask.masked_fill(kv_pos[None, None, None, :] < (seq_lens - w).view(-1, 1, 1, 1),
                                           float("-inf")) for w in windows}
    md.grouped_window_masks = {}
    return md


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
          is_causal: bool = False, scale: float = 1.0, enable_gqa: bool = False, softcap: float = 0.0
          ) -> torch.Tensor:
    """`F.scaled_dot_product_attention`; with `softcap` > 0 the same attention with the scaled scores
    soft-capped before the mask, which SDPA cannot do: explicit float32 scores, softmax, weighted sum."""
    if not softcap:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                                              enable_gqa=enable_gqa)
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)).mul_(scale / softcap).tanh_().mul_(softcap)
    if is_causal:  # top-left aligned, as SDPA's is_causal
        attn_mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool \
            else scores + attn_mask
    return torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), v)


def _decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scaling: float,
            group: int, logit_cap: float = 0.0) -> torch.Tensor:
    """q [B, Hq, D]; k/v [Hkv, B, L, D] contiguous; mask [B, 1, 1, L] additive -> [B, Hq * D].

    Batched over (Hkv, B) with the query heads of a KV group as rows: no copy of K or V."""
    num_kv_heads, bsz, _, head_dim = k.shape
    qg = q.view(bsz, num_kv_heads, group, head_dim).transpose(0, 1)  # [Hkv, B, G, D]
    scores = torch.matmul(qg, k.transpose(2, 3)).float()  # [Hkv, B, G, L]
    scores = scores.mul_(scaling)
    if logit_cap:
        scores = scores.div_(logit_cap).tanh_().mul_(logit_cap)
    scores = scores.add_(mask.view(1, bsz, 1, -1))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    out = torch.matmul(probs, v)  # [Hkv, B, G, D]
    return out.transpose(0, 1).reshape(bsz, num_kv_heads * group * head_dim)
