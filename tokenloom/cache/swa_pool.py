"""KV memory for sliding-window models: sliding layers keep only the window's K/V (the idea of SGLang's SWA
memory pool, `SWATokenToKVPoolAllocator`, written anew here).

Two slot spaces. A *full* slot (what the scheduler, `req_to_token` and the prefix cache deal in) indexes the
K/V of the full-attention layers; a *swa* slot indexes the K/V of the sliding layers, in a smaller pool.
`full_to_swa[full slot]` is the swa slot holding the sliding layers' K/V of the same token, 0 (the dummy swa
slot) when there is none: a token out of every window that might still read it ("tombstone": its full-layer
K/V stays, its sliding K/V is gone).

`SWAAllocator` wraps the full allocator so the scheduler sees one allocator: every slot it hands out gets a
fresh swa slot too; `free` gives back both; `free_swa` gives back only the sliding part (the token left the
window). `available_size()` is the smaller of the two free counts (a new token needs one slot of each), as in
SGLang; `full_available_size()` is what the full-pool accounting (free + cached == size) checks.
Page size 1 only (the swa slots are single tokens); KVMemory builds the plain pool for page sizes > 1.

Invariants (`check`): swa slots in use == non-zero entries of `full_to_swa`, each distinct; the dummy slot 0
maps to 0.

`SWAKVPool` keeps KVPool's interface for the attention backends: `get_kv(layer)` returns the layer's
buffers in its own pool, and `set_kv(layer, slots, ...)` takes slots of that pool's space (a backend maps a
sliding layer's slots through `full_to_swa` once per step, not per layer). `k_buffers[i]` are the local
layers' K buffers in layer order (both pools share dtype, heads and head_dim). `layout` describes both buffers
for a PD transfer (cache/pool_layout.py); `read_slots` / `write_slots` move a request's KV of both pools
(decode-side retraction to host memory).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from tokenloom.cache.allocator import TokenAllocator
from tokenloom.cache.kv_pool import KVPool
from tokenloom.cache.pool_layout import PoolLayout


class SWAAllocator:
    page_size = 1

    def __init__(self, full: TokenAllocator, swa_size: int) -> None:
        if full.page_size != 1:
            raise ValueError("the sliding-window KV pool needs page size 1")
        self.full = full
        self.size = full.size
        self.device = full.device
        self.swa = TokenAllocator(swa_size, full.device, decode_run=1)
        self.swa_size = swa_size
        self.full_to_swa = torch.zeros(full.size + 2, dtype=torch.int64, device=full.device)

    def clear(self) -> None:
        self.full.clear()
        self.swa.clear()
        self.full_to_swa.zero_()

    def available_size(self) -> int:
        return min(self.full.available_size(), self.swa.available_size())

    def full_available_size(self) -> int:
        return self.full.available_size()

    def swa_in_use(self) -> int:
        return self.swa_size - self.swa.available_size()

    def free_slot_ids(self) -> torch.Tensor:
        return self.full.free_slot_ids()

    def _pair(self, full: torch.Tensor | None) -> torch.Tensor | None:
        if full is None:
            return None
        swa = self.swa.alloc(int(full.numel()))
        if swa is None:  # checked before taking full slots; kept as a guard
            self.full.free(full)
            return None
        self.full_to_swa[full] = swa
        return full

    def _swa_fits(self, n: int) -> bool:
        return n <= self.swa.available_size()

    def alloc(self, n: int) -> torch.Tensor | None:
        return self._pair(self.full.alloc(n)) if self._swa_fits(n) else None

    def alloc_extend(self, prefix_lens: torch.Tensor, seq_lens: torch.Tensor,
                     last_slots: torch.Tensor) -> torch.Tensor | None:
        if not self._swa_fits(int((seq_lens - prefix_lens).sum())):
            return None
        return self._pair(self.full.alloc_extend(prefix_lens, seq_lens, last_slots))

    def alloc_decode(self, seq_lens: torch.Tensor, last_slots: torch.Tensor) -> torch.Tensor | None:
        if not self._swa_fits(int(seq_lens.numel())):
            return None
        return self._pair(self.full.alloc_decode(seq_lens, last_slots))

    def alloc_tail(self, n: int, tail: int) -> torch.Tensor | None:
        """Full slots for `n` tokens of which only the last `tail` get swa slots: KV of a whole prompt arriving
        from elsewhere, whose earlier positions are out of every window its next queries read (SGLang's
        tail pre-allocation for PD, sgl-project/sglang#24036)."""
        tail = min(n, tail)
        if not self._swa_fits(tail):
            return None
        full = self.full.alloc(n)
        if full is not None and tail:
            self.full_to_swa[full[n - tail:]] = self.swa.alloc(tail)
        return full

    def free_swa(self, full_slots: torch.Tensor) -> int:
        """Give back the sliding-layer slots of `full_slots` (those still present); returns how many."""
        if not full_slots.numel():
            return 0
        full_slots = full_slots.to(torch.int64)
        swa = self.full_to_swa[full_slots]
        swa = swa[swa > 0]
        if swa.numel():
            self.swa.free(swa)
            self.full_to_swa[full_slots] = 0
        return int(swa.numel())

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel():
            self.free_swa(slots)
            self.full.free(slots)

    def check(self) -> None:
        mapped = self.full_to_swa[self.full_to_swa > 0]
        if int(self.full_to_swa[0]) != 0:
            raise AssertionError("the dummy full slot 0 maps to a swa slot")
        if mapped.numel() != self.swa_in_use():
            raise AssertionError(f"swa leak: {self.swa_in_use()} swa slots in use, {mapped.numel()} mapped")
        if torch.unique(mapped).numel() != mapped.numel():
            raise AssertionError("a swa slot is mapped from two full slots")


class SWAKVPool:
    """Full layers in one KVPool of `size` slots, sliding layers in another of `swa_size` slots."""

    def __init__(self, size: int, swa_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, start_layer: int, end_layer: int, sliding: Sequence[bool]) -> None:
        self.size, self.swa_size, self.page_size = size, swa_size, 1
        self.dtype, self.num_kv_heads, self.head_dim = dtype, num_kv_heads, head_dim
        self.start_layer, self.end_layer = start_layer, end_layer
        layers = range(start_layer, end_layer)
        self.model_sliding = tuple(bool(s) for s in sliding)  # by global layer
        self.sliding = self.model_sliding[start_layer:end_layer]  # by local layer
        n_swa = sum(self.sliding)
        self.full_pool = KVPool(size, 1, num_kv_heads, head_dim, dtype, device, 0, len(layers) - n_swa)
        self.swa_pool = KVPool(swa_size, 1, num_kv_heads, head_dim, dtype, device, 0, n_swa)
        self._where: list[tuple[KVPool, int]] = []
        counts = [0, 0]
        for s in self.sliding:
            self._where.append((self.swa_pool if s else self.full_pool, counts[s]))
            counts[s] += 1
        self.k_buffers = [pool.k_buffers[i] for pool, i in self._where]
        self.v_buffers = [pool.v_buffers[i] for pool, i in self._where]
        self.full_to_swa: torch.Tensor | None = None  # set by KVMemory to the allocator's map

    def is_sliding(self, layer_id: int) -> bool:
        return self.sliding[layer_id - self.start_layer]

    def set_kv(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """`slots` are swa slots for a sliding layer, full slots otherwise."""
        pool, i = self._where[layer_id - self.start_layer]
        pool.set_kv(i, slots, k, v)

    def get_kv(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        pool, i = self._where[layer_id - self.start_layer]
        return pool.get_kv(i)

    def nbytes(self) -> int:
        return self.full_pool.nbytes() + self.swa_pool.nbytes()

    def bytes_per_token(self) -> tuple[int, int]:
        """(bytes one full slot holds over the full layers, bytes one swa slot holds over the sliding ones)."""
        def per(pool: KVPool) -> int:
            return pool.nbytes() // pool.rows if pool.rows else 0
        return per(self.full_pool), per(self.swa_pool)

    def read_slots(self, full_slots: torch.Tensor) -> torch.Tensor:
        """Every local layer's K and V of the tokens at `full_slots` (a copy): the full layers' rows, then the
        sliding layers' at the mapped swa slots ([layers, 2, kv_heads, len, head_dim]; a token out of every window
        reads the dummy slot, never read back as anything that matters)."""
        swa = self._swa_map()[full_slots.to(torch.int64)]
        return torch.cat((self.full_pool.read_slots(full_slots), self.swa_pool.read_slots(swa)))

    def write_slots(self, full_slots: torch.Tensor, data: torch.Tensor) -> None:
        """Store `read_slots`' result at `full_slots`; the sliding layers' rows only where a full slot has a swa
        slot (the others are out of every window: nothing reads them)."""
        n_full = self.full_pool.end_layer - self.full_pool.start_layer
        swa = self._swa_map()[full_slots.to(torch.int64)]
        self.full_pool.write_slots(full_slots, data[:n_full])
        has = swa > 0
        self.swa_pool.write_slots(swa[has], data[n_full:, :, :, has.to(data.device)])

    def _swa_map(self) -> torch.Tensor:
        if self.full_to_swa is None:
            raise RuntimeError("the sliding-window pool has no full_to_swa map (KVMemory sets it)")
        return self.full_to_swa

    def layout(self, head_start: int) -> PoolLayout:
        """Both buffers as data for a transfer peer: each in the numbering of its own layer kind
        (cache/pool_layout.py), with the model's per-layer pattern."""
        pattern = self.model_sliding
        n_swa_before = sum(pattern[:self.start_layer])
        n_full_before = self.start_layer - n_swa_before
        n_swa = sum(self.sliding)
        full = dataclasses.replace(self.full_pool.layout(head_start), start_layer=n_full_before,
                                   end_layer=n_full_before + len(self.sliding) - n_swa)
        swa = dataclasses.replace(self.swa_pool.layout(head_start), start_layer=n_swa_before,
                                  end_layer=n_swa_before + n_swa)
        return PoolLayout(full, swa, pattern)
