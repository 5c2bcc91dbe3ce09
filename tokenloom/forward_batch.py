"""`ForwardMode` and `ForwardBatch`: the device tensors of one forward step.

A `ForwardBatch` is built from a scheduler's plan (or a test) and carries everything the model and the
attention backend read: token ids, positions, request rows, lengths, the KV slots new tokens are written to,
and, for extend, how many tokens of each request are cached prefix vs new. Positions and per-token request
rows are derived here, vectorized, so callers only give lengths.

Invariants: requests appear in the same order in every per-request tensor; the new tokens of request i
occupy `extend_start_loc[i] : extend_start_loc[i] + extend_seq_lens[i]` of `input_ids`; in decode mode
every request contributes exactly one token.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # prefill, possibly on top of a cached prefix (chunked prefill too)
    DECODE = "decode"  # one new token per request
    IDLE = "idle"  # nothing to compute (kept so loops can run empty steps)

    def is_extend(self) -> bool:
        return self is ForwardMode.EXTEND

    def is_decode(self) -> bool:
        return self is ForwardMode.DECODE


@dataclass
class ForwardBatch:
    forward_mode: ForwardMode
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    req_pool_indices: torch.Tensor  # [B] int64
    seq_lens: torch.Tensor  # [B] int64, length after this step
    out_cache_loc: torch.Tensor  # [T] int64, KV slot of each new token
    extend_prefix_lens: torch.Tensor  # [B] int64 (decode: seq_lens - 1)
    extend_seq_lens: torch.Tensor  # [B] int64 (decode: ones)
    extend_start_loc: torch.Tensor  # [B] int64
    token_req_index: torch.Tensor  # [T] int64, which request each token belongs to
    max_seq_len: int
    max_extend_len: int
    return_all_logits: bool = False
    # Extend steps in which some request wants prompt logprobs: the tokens whose logits are computed, in order
    # (executor/prompt_logprobs.py); None: each request's last token (or every token with return_all_logits).
    logit_rows: torch.Tensor | None = None
    # Filled by the attention backend in init_forward_metadata.
    attn_metadata: Any = None
    # Pipeline stages after the first receive hidden states instead of ids.
    pp_proxy: dict[str, torch.Tensor] | None = field(default=None)
    # [B] int64, each request's prompt length (its original input, without generated tokens); None where the
    # builder does not know it. LongRoPE picks its factor set from it as transformers.generate does (rotary.py).
    prompt_lens: torch.Tensor | None = None
    # Decode batches built by `build_decode`: sum(seq_lens), known to the caller (None where not given).
    kv_total: int | None = None

    @property
    def batch_size(self) -> int:
        return int(self.req_pool_indices.numel())

    @classmethod
    def build_decode(cls, input_ids: torch.Tensor, req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor,
                     seq_lens: torch.Tensor, out_cache_loc: torch.Tensor, max_seq_len: int,
                     prompt_lens: torch.Tensor, kv_total: int | None = None) -> ForwardBatch:
        """A decode step's batch from int64 per-request tensors (`prefix_lens` = `seq_lens` - 1), the longest
        `seq_lens` entry and their sum (`kv_total`), which the caller knows: the same fields as `build` gives,
        with no tensor computed but the per-size constants (ones, and 0..B-1, cached per batch size and device;
        nobody writes to them). `positions` is `prefix_lens` itself."""
        batch_size = int(seq_lens.numel())
        if input_ids.numel() != batch_size:
            raise ValueError("decode batches carry exactly one token per request")
        ones, index = _decode_constants(batch_size, input_ids.device)
        return cls(forward_mode=ForwardMode.DECODE, input_ids=input_ids, positions=prefix_lens,
                   req_pool_indices=req_pool_indices, seq_lens=seq_lens, out_cache_loc=out_cache_loc,
                   extend_prefix_lens=prefix_lens, extend_seq_lens=ones, extend_start_loc=index,
                   token_req_index=index, max_seq_len=max_seq_len, max_extend_len=1 if batch_size else 0,
                   prompt_lens=prompt_lens, kv_total=kv_total)

    @classmethod
    def build(cls, mode: ForwardMode, input_ids: torch.Tensor, req_pool_indices: torch.Tensor,
              prefix_lens: torch.Tensor, seq_lens: torch.Tensor, out_cache_loc: torch.Tensor,
              return_all_logits: bool = False, prompt_lens: torch.Tensor | None = None) -> ForwardBatch:
        """Derive positions and per-token request rows from per-request lengths (no Python loop)."""
        device = input_ids.device
        prefix_lens = prefix_lens.to(torch.int64)
        seq_lens = seq_lens.to(torch.int64)
        extend_lens = seq_lens - prefix_lens
        starts = torch.cumsum(extend_lens, 0) - extend_lens
        total = int(input_ids.numel())
        if mode is ForwardMode.DECODE:
            if total != seq_lens.numel():
                raise ValueError("decode batches carry exactly one token per request")
            token_req = torch.arange(total, device=device)
            positions = seq_lens - 1
        else:
            token_req = torch.repeat_interleave(torch.arange(seq_lens.numel(), device=device), extend_lens,
                                                output_size=total)
            positions = prefix_lens[token_req] + torch.arange(total, device=device) - starts[token_req]
        return cls(
            forward_mode=mode,
            input_ids=input_ids.to(torch.int64),
            positions=positions,
            req_pool_indices=req_pool_indices.to(torch.int64),
            seq_lens=seq_lens,
            out_cache_loc=out_cache_loc.to(torch.int64),
            extend_prefix_lens=prefix_lens,
            extend_seq_lens=extend_lens,
            extend_start_loc=starts,
            token_req_index=token_req,
            max_seq_len=int(seq_lens.max()) if seq_lens.numel() else 0,
            max_extend_len=int(extend_lens.max()) if extend_lens.numel() else 0,
            return_all_logits=return_all_logits,
            prompt_lens=None if prompt_lens is None else prompt_lens.to(device=device, dtype=torch.int64),
        )


_DECODE_CONSTANTS: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}


def _decode_constants(batch_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(ones, arange) of `batch_size` int64 entries on `device`, made once per size: read-only by contract."""
    key = (batch_size, device)
    found = _DECODE_CONSTANTS.get(key)
    if found is None:
        found = (torch.ones(batch_size, dtype=torch.int64, device=device),
                 torch.arange(batch_size, dtype=torch.int64, device=device))
        _DECODE_CONSTANTS[key] = found
    return found
