"""`PoolLayout`: a rank's whole KV memory as data for a transfer peer — one `KVLayout` (cache/kv_layout.py) for a
plain pool, two for a sliding-window pool (cache/swa_pool.py) — and the byte runs that copy tokens between two
such memories.

A sliding-window pool keeps the full-attention layers' KV in one buffer, indexed by *full* slots, and the sliding
layers' KV in a second, smaller one, indexed by *swa* slots (`full_to_swa`). Each buffer is described by a
`KVLayout` whose layer numbers count only the layers of its own kind: global layer g is full layer
`nf(g)` = the number of full layers before g, or sliding layer `ns(g)`. A pipeline stage's global layers [a, b)
are then the contiguous ranges [nf(a), nf(b)) and [ns(a), ns(b)) of the two kinds, so `transfer_runs` pairs
stages of different pipeline shapes per kind exactly as it pairs plain pools (the idea of SGLang's separate
SWA state buffer in PD transfers, e.g. sgl-project/sglang#23773; written anew here).

Invariants: `swa` is None exactly when `sliding` is empty (a plain pool: `full` holds every layer, numbered
globally); both sides of a transfer are plain or both hybrid with the same per-layer pattern (`runs` raises
ValueError otherwise, and the decode side refuses such a prefill server at bootstrap). A plain layout's JSON is
the `KVLayout` JSON itself, so plain pools keep their wire format.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tokenloom.cache.kv_layout import KVLayout, Slots, transfer_runs_array


@dataclass(frozen=True)
class PoolLayout:
    full: KVLayout  # the full-attention layers (every layer of a plain pool)
    swa: KVLayout | None = None  # the sliding layers' pool (hybrid only), in sliding-layer numbering
    sliding: tuple[bool, ...] = ()  # per global layer of the model: a sliding layer (hybrid only)

    def __post_init__(self) -> None:
        if (self.swa is None) != (not self.sliding):
            raise ValueError("PoolLayout: a sliding-window pool needs both its swa layout and its layer pattern")
        if self.swa is not None:
            for name in ("head_dim", "dtype", "itemsize", "page_size", "num_heads", "head_start"):
                if getattr(self.full, name) != getattr(self.swa, name):
                    raise ValueError(f"PoolLayout: the full and swa layouts disagree on {name}")

    @classmethod
    def of(cls, layout: KVLayout | PoolLayout) -> PoolLayout:
        return layout if isinstance(layout, PoolLayout) else cls(layout)

    @property
    def hybrid(self) -> bool:
        return self.swa is not None

    # the properties every layout of one rank shares (what compatibility checks compare)
    @property
    def head_dim(self) -> int:
        return self.full.head_dim

    @property
    def itemsize(self) -> int:
        return self.full.itemsize

    @property
    def dtype(self) -> str:
        return self.full.dtype

    def regions(self) -> list[tuple[int, int]]:
        """(address, bytes) of every buffer a transfer engine must register."""
        return [(x.base_addr, x.nbytes) for x in (self.full, self.swa) if x is not None and x.nbytes]

    def kind_ranges(self, layers: range) -> tuple[range, range]:
        """Global layers [a, b) as (full-layer numbers, sliding-layer numbers)."""
        if not self.sliding:
            return layers, range(0)
        if layers.start < 0 or layers.stop > len(self.sliding) or layers.step != 1:
            raise ValueError(f"layers {layers} outside the model's {len(self.sliding)} layers")
        ns_a, ns_b = sum(self.sliding[:layers.start]), sum(self.sliding[:layers.stop])
        return range(layers.start - ns_a, layers.stop - ns_b), range(ns_a, ns_b)

    def runs(self, dst: PoolLayout, src_slots: Slots, dst_slots: Slots, src_swa: Slots | None,
             dst_swa: Slots | None, *, layers: range, heads: range | None = None) -> list[tuple[int, int, int]]:
        """The (src_addr, dst_addr, nbytes) runs that copy tokens `src_slots[i]` -> `dst_slots[i]` of the global
        `layers` (and `heads`) both hold; for hybrid pools the sliding layers go `src_swa[i]` -> `dst_swa[i]`,
        skipping tokens either side has no swa slot for (0: out of every window a query still to come reads —
        the source dropped them, or the destination reserved only the window's tail)."""
        if self.hybrid != dst.hybrid or self.sliding != dst.sliding:
            raise ValueError("the two servers' KV pools differ in their sliding-window layers (start both with "
                             "or both without --disable-hybrid-swa-memory)")
        full_layers, swa_layers = self.kind_ranges(layers)
        out = [transfer_runs_array(self.full, dst.full, src_slots, dst_slots, layers=full_layers, heads=heads)]
        if self.swa is not None and dst.swa is not None and len(swa_layers):
            if src_swa is None or dst_swa is None:
                raise ValueError("a sliding-window pool transfer needs the swa slots of both sides")
            s, d = np.asarray(src_swa, dtype=np.int64), np.asarray(dst_swa, dtype=np.int64)
            if len(s) != len(d):
                raise ValueError(f"src swa slots {len(s)} but dst swa slots {len(d)}")
            keep = (s > 0) & (d > 0)
            out.append(transfer_runs_array(self.swa, dst.swa, s[keep], d[keep], layers=swa_layers, heads=heads))
        runs = np.concatenate(out)
        return list(zip(runs[:, 0].tolist(), runs[:, 1].tolist(), runs[:, 2].tolist(), strict=True))

    def to_json(self) -> dict[str, Any]:
        if self.swa is None:
            return self.full.to_json()
        return {"full": self.full.to_json(), "swa": self.swa.to_json(), "sliding": [int(s) for s in self.sliding]}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PoolLayout:
        if "full" not in data:
            return cls(KVLayout.from_json(data))
        unknown = set(data) - {"full", "swa", "sliding"}
        if unknown or not isinstance(data.get("sliding"), list):
            raise ValueError(f"bad PoolLayout JSON: keys {sorted(data)}")
        return cls(KVLayout.from_json(data["full"]), KVLayout.from_json(data["swa"]),
                   tuple(bool(s) for s in data["sliding"]))


def swa_slots_of(kv_pool: Any, full_slots: Sequence[int] | Any) -> list[int] | None:
    """The swa slots of `full_slots` in a sliding-window pool (None for a plain pool): what a transfer sends
    with them. Read on the scheduler thread, before anything may free them."""
    full_to_swa = getattr(kv_pool, "full_to_swa", None)
    if full_to_swa is None:
        return None
    return full_to_swa[full_slots].tolist()
