"""`KVLayout`: a rank's KV pool buffer described as plain data, and `transfer_runs`: the byte runs that copy
token slots of one pool into token slots of another.

A `KVLayout` is what a peer needs to address the pool (`cache/kv_pool.py`) across processes: one contiguous
buffer at `base_addr` of shape [layers, 2 (K, V), num_heads, rows, head_dim] with `itemsize` bytes per element,
holding global layers [start_layer, end_layer) and global KV heads [head_start, head_start + num_heads). It is
frozen and round-trips through `to_json` / `from_json` (a dict of ints and one string).

`transfer_runs(src, dst, src_slots, dst_slots)` moves token slot `src_slots[i]` of `src` to `dst_slots[i]` of
`dst` for every layer both hold and every global head both hold, K and V. Its runs are maximal: two runs merge
whenever they are adjacent in both address spaces, so a stretch of tokens consecutive on both sides is one run
per (layer, K/V, head), and runs cross head / K-V / layer boundaries only when whole rows are moved (merging
is then byte-for-byte the same copy). Runs never overlap on the destination as long as `dst_slots` has no
repeats (the caller's invariant: a decode slot receives one token).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np
import torch

Slots = Sequence[int] | np.ndarray | torch.Tensor | range


@dataclass(frozen=True)
class KVLayout:
    base_addr: int
    start_layer: int
    end_layer: int
    num_heads: int  # KV heads held locally
    head_start: int  # global index of local head 0
    rows: int  # token slots per (layer, K/V, head), the dummy slot and padding page included
    head_dim: int
    itemsize: int  # bytes per element
    page_size: int
    dtype: str  # e.g. "bfloat16"; two layouts must agree on it to exchange bytes

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "dtype":
                if not isinstance(value, str) or not value:
                    raise ValueError(f"KVLayout.dtype must be a non-empty string, got {value!r}")
            elif not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"KVLayout.{f.name} must be a non-negative int, got {value!r}")
        if self.end_layer < self.start_layer:
            raise ValueError(f"KVLayout layers [{self.start_layer}, {self.end_layer}) are reversed")
        for name in ("num_heads", "rows", "head_dim", "itemsize", "page_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"KVLayout.{name} must be at least 1, got {getattr(self, name)}")

    @property
    def head_end(self) -> int:
        return self.head_start + self.num_heads

    @property
    def layers(self) -> range:
        return range(self.start_layer, self.end_layer)

    @property
    def heads(self) -> range:
        return range(self.head_start, self.head_end)

    @property
    def row_bytes(self) -> int:
        """Bytes of one token slot of one (layer, K/V, head)."""
        return self.head_dim * self.itemsize

    @property
    def head_bytes(self) -> int:
        """Bytes of one (layer, K/V, head): its `rows` slots, contiguous."""
        return self.rows * self.row_bytes

    @property
    def nbytes(self) -> int:
        return (self.end_layer - self.start_layer) * 2 * self.num_heads * self.head_bytes

    def addr(self, layer: int, kv: int, head: int, slot: int) -> int:
        """Address of token `slot` of global `layer`, K (`kv` 0) or V (1), global KV `head`."""
        if layer not in self.layers or kv not in (0, 1) or head not in self.heads or not 0 <= slot < self.rows:
            raise IndexError(f"(layer {layer}, kv {kv}, head {head}, slot {slot}) outside layers "
                             f"[{self.start_layer}, {self.end_layer}), heads [{self.head_start}, "
                             f"{self.head_end}), slots [0, {self.rows})")
        piece = ((layer - self.start_layer) * 2 + kv) * self.num_heads + head - self.head_start
        return self.base_addr + piece * self.head_bytes + slot * self.row_bytes

    def to_json(self) -> dict[str, int | str]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, object]) -> KVLayout:
        return strict_from_json(cls, data)


def strict_from_json(cls: Any, data: Mapping[str, object]) -> Any:
    """A frozen dataclass from its `asdict` JSON: exactly its fields (else ValueError naming the missing and
    unknown ones); its `__post_init__` checks the values' types."""
    names = {f.name for f in fields(cls)}
    missing, unknown = names - data.keys(), data.keys() - names
    if missing or unknown:
        raise ValueError(f"bad {cls.__name__} JSON: missing {sorted(missing)}, unknown {sorted(unknown)}")
    return cls(**data)


def aligned_prefix(n_tokens: int, page_size: int) -> int:
    """The tokens of the first `n_tokens` that fill whole pages (what a partial chunk can send now)."""
    if n_tokens < 0 or page_size < 1:
        raise ValueError(f"aligned_prefix needs n_tokens >= 0 and page_size >= 1, got {n_tokens}, {page_size}")
    return n_tokens - n_tokens % page_size


def transfer_runs(src: KVLayout, dst: KVLayout, src_slots: Slots, dst_slots: Slots, *,
                  layers: range | None = None, heads: range | None = None) -> list[tuple[int, int, int]]:
    """`transfer_runs_array` as a list of (src_addr, dst_addr, nbytes) tuples of Python ints."""
    runs = transfer_runs_array(src, dst, src_slots, dst_slots, layers=layers, heads=heads)
    return list(zip(runs[:, 0].tolist(), runs[:, 1].tolist(), runs[:, 2].tolist(), strict=True))


def transfer_runs_array(src: KVLayout, dst: KVLayout, src_slots: Slots, dst_slots: Slots, *,
                        layers: range | None = None, heads: range | None = None) -> np.ndarray:
    """The maximal runs, an int64 array [N, 3] of (src_addr, dst_addr, nbytes), ordered by (layer, K/V,
    head, token). Copies the layers and global heads both layouts hold, narrowed further to `layers` /
    `heads` when given (the piece `pairing.writers_for` assigns a writer). Raises ValueError when the
    layouts cannot exchange bytes (head_dim, dtype, itemsize, page size differ), the slot lists differ in
    length or a slot is outside its pool."""
    _check_compatible(src, dst)
    s = _slot_array(src_slots, "src_slots", src.rows)
    d = _slot_array(dst_slots, "dst_slots", dst.rows)
    if len(s) != len(d):
        raise ValueError(f"src_slots has {len(s)} slots but dst_slots has {len(d)}")
    lay = _intersect(_intersect(src.layers, dst.layers), layers, "layers")
    hd = _intersect(_intersect(src.heads, dst.heads), heads, "heads")
    if len(s) == 0 or not lay or not hd:
        return np.empty((0, 3), dtype=np.int64)
    # Token segments consecutive on both sides; identical for every (layer, K/V, head).
    breaks = np.flatnonzero((s[1:] != s[:-1] + 1) | (d[1:] != d[:-1] + 1)) + 1
    starts = np.concatenate((np.zeros(1, dtype=np.int64), breaks))
    lengths = np.diff(np.append(starts, len(s)))
    row = src.row_bytes
    src_base = _piece_bases(src, lay, hd)
    dst_base = _piece_bases(dst, lay, hd)
    runs = np.empty((len(src_base), len(starts), 3), dtype=np.int64)
    np.add(src_base[:, None], (s[starts] * row)[None, :], out=runs[:, :, 0])
    np.add(dst_base[:, None], (d[starts] * row)[None, :], out=runs[:, :, 1])
    runs[:, :, 2] = (lengths * row)[None, :]
    runs = runs.reshape(-1, 3)
    # Within a piece the segments are already maximal; a run can only continue into the next piece when the
    # tokens end at the last row and restart at row 0 on both sides.
    if s[0] == 0 and d[0] == 0 and s[-1] == src.rows - 1 and d[-1] == dst.rows - 1:
        runs = _coalesce(runs)
    return runs


def _check_compatible(src: KVLayout, dst: KVLayout) -> None:
    for name in ("head_dim", "dtype", "itemsize", "page_size"):
        a, b = getattr(src, name), getattr(dst, name)
        if a != b:
            raise ValueError(f"KV layouts disagree on {name}: src {a!r}, dst {b!r}")


def _slot_array(slots: Slots, name: str, rows: int) -> np.ndarray:
    if isinstance(slots, torch.Tensor):
        slots = slots.detach().cpu().numpy()
    arr = np.asarray(slots)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        return arr.astype(np.int64)
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{name} must hold integers, got {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= rows:
        raise ValueError(f"{name} holds slots in [{lo}, {hi}] but its pool has rows [0, {rows})")
    return arr


def _intersect(a: range, b: range | None, what: str = "") -> range:
    if b is None:
        return a
    if b.step != 1:
        raise ValueError(f"{what} must be a range with step 1, got {b}")
    return range(max(a.start, b.start), max(max(a.start, b.start), min(a.stop, b.stop)))


def _piece_bases(layout: KVLayout, lay: range, hd: range) -> np.ndarray:
    """Start address of every (layer, K/V, head) piece in `lay` x (K, V) x `hd`, in that order."""
    layer = np.arange(lay.start, lay.stop, dtype=np.int64)[:, None, None] - layout.start_layer
    kv = np.arange(2, dtype=np.int64)[None, :, None]
    head = np.arange(hd.start, hd.stop, dtype=np.int64)[None, None, :] - layout.head_start
    return (layout.base_addr + ((layer * 2 + kv) * layout.num_heads + head) * layout.head_bytes).reshape(-1)


def _coalesce(runs: np.ndarray) -> np.ndarray:
    """Merge each run into the previous one when it continues it in both address spaces."""
    cont = (runs[:-1, 0] + runs[:-1, 2] == runs[1:, 0]) & (runs[:-1, 1] + runs[:-1, 2] == runs[1:, 1])
    firsts = np.flatnonzero(np.concatenate(([True], ~cont)))
    out = runs[firsts].copy()
    out[:, 2] = np.add.reduceat(runs[:, 2], firsts)
    return out
