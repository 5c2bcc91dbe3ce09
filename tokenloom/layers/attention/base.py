"""The `AttentionBackend` interface every attention kernel family implements.

Per forward: `init_forward_metadata(batch)` once (index building, masks), then `forward(...)` once per
layer. Invariants every backend keeps:
- `forward` first stores the new tokens' K and V into the KV pool at `batch.out_cache_loc`, then attends
  each new query to the request's KV positions [0, seq_len), causally (query at position p sees <= p);
- a sliding-window layer (`layer_windows[layer_id]` = w > 0, from `ModelConfig.layer_window`) lets the query
  at position p see only positions (p - w, p] (transformers' `sliding_window_overlay`: kv > q - w);
- over a sliding-window pool (cache/swa_pool.py: `kv_pool.full_to_swa` set), a sliding layer's K/V lives in
  its own slot space: the backend maps the step's slots through `full_to_swa` once per step (positions out
  of the window may map to the dummy slot 0: they are masked or not read);
- outputs come back in the token order of `batch.input_ids`, shape [T, num_heads * head_dim];
- no Python loop over requests on the per-step path;
- `logit_cap` > 0 soft-caps the scaled scores, s -> cap * tanh(s / cap), before the mask and softmax
  (Gemma 2's attn_logit_softcapping); 0 leaves them alone.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from tokenloom.cache.kv_pool import KVPool
from tokenloom.cache.req_to_token import ReqToTokenPool
from tokenloom.forward_batch import ForwardBatch


class AttentionBackend(ABC):
    def __init__(self, req_to_token_pool: ReqToTokenPool, kv_pool: KVPool,
                 layer_windows: Sequence[int] = ()) -> None:
        """`layer_windows[layer_id]`: the sliding window of that (global) layer, 0 = full attention; layers
        past the end of the sequence are full."""
        self.req_to_token_pool = req_to_token_pool
        self.kv_pool = kv_pool
        self.layer_windows = tuple(int(w) for w in layer_windows)
        self.windows = sorted({w for w in self.layer_windows if w > 0})  # the distinct windows
        self.full_to_swa: torch.Tensor | None = getattr(kv_pool, "full_to_swa", None)  # sliding-window pool

    def in_swa_pool(self, layer_id: int) -> bool:
        """Whether the layer's K/V is addressed by swa slots (a sliding layer over a sliding-window pool)."""
        return self.full_to_swa is not None and self.window_of(layer_id) > 0

    def window_of(self, layer_id: int) -> int:
        return self.layer_windows[layer_id] if layer_id < len(self.layer_windows) else 0

    @abstractmethod
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Precompute what every layer of this step needs; store it on `batch.attn_metadata`."""

    def stores_new_slots(self, batch: ForwardBatch) -> bool:
        """Whether `init_forward_metadata(batch)` also writes the batch's new tokens' slots into `req_to_token`
        (the runner then does not write them first). The same answer every time for the same batch."""
        return False

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, scaling: float,
                batch: ForwardBatch, logit_cap: float = 0.0) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D] for the new tokens -> attention output [T, Hq * D]."""
