"""Which prefill ranks write which part of which decode rank's KV pool.

A `RankKV` says what one rank holds: global layers [start_layer, end_layer) (its pipeline stage) and global
KV heads [head_start, head_end) (its TP shard). Heads follow `QKVParallelLinear` (layers/linear.py): with at
least as many KV heads as TP ranks each rank holds `num_kv_heads // tp_size` of them; with fewer, each head is
replicated over `tp_size // num_kv_heads` consecutive TP ranks (2 heads over TP 4: ranks 0, 1 hold head 0,
ranks 2, 3 head 1).

Invariants of `writers_for(decode, prefill_ranks)`: every (layer, head) the decode rank holds is written by
exactly one prefill rank, the lowest TP rank among the prefill ranks holding it (replicas send nothing);
pieces are (layer range, head range) rectangles that do not overlap. `targets_for` is the same relation seen
from one prefill rank (built from `writers_for`, so the two agree). The metadata (aux) slot is written to
every decode rank by `aux_writer`: the last prefill stage's TP rank 0, the rank that samples.
All functions are pure; every rank computes the same answer from the same descriptions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields

from tokenloom.cache.kv_layout import strict_from_json
from tokenloom.distributed.pp_partition import stage_layer_ranges

# (the rank that writes or is written, its layers, its global KV heads)
Piece = tuple["RankKV", range, range]


@dataclass(frozen=True)
class RankKV:
    rank: int  # global rank: pp_rank * tp_size + tp_rank
    pp_rank: int
    tp_rank: int
    start_layer: int
    end_layer: int
    head_start: int  # global KV heads [head_start, head_end) held by this rank
    head_end: int

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"RankKV.{f.name} must be a non-negative int, got {value!r}")
        if self.end_layer <= self.start_layer or self.head_end <= self.head_start:
            raise ValueError(f"RankKV of rank {self.rank} holds no KV: layers [{self.start_layer}, "
                             f"{self.end_layer}), heads [{self.head_start}, {self.head_end})")

    @property
    def layers(self) -> range:
        return range(self.start_layer, self.end_layer)

    @property
    def heads(self) -> range:
        return range(self.head_start, self.head_end)

    def to_json(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, object]) -> RankKV:
        return strict_from_json(cls, data)


def kv_head_range(tp_rank: int, tp_size: int, num_kv_heads: int) -> range:
    """The global KV heads TP rank `tp_rank` holds (the rule of `QKVParallelLinear`)."""
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} outside tp_size {tp_size}")
    if num_kv_heads >= tp_size:
        if num_kv_heads % tp_size:
            raise ValueError(f"kv heads ({num_kv_heads}) is not divisible by tp_size ({tp_size})")
        local = num_kv_heads // tp_size
        return range(tp_rank * local, (tp_rank + 1) * local)
    if tp_size % num_kv_heads:
        raise ValueError(f"tp_size ({tp_size}) is not divisible by kv heads ({num_kv_heads})")
    head = tp_rank // (tp_size // num_kv_heads)
    return range(head, head + 1)


def topology_ranks(num_layers: int, num_kv_heads: int, tp_size: int, pp_size: int,
                   partition: Sequence[int] | None = None) -> list[RankKV]:
    """Every rank of a TP x PP server, by global rank, with the layer split of `stage_layer_ranges`."""
    out = []
    for pp_rank, (start, end) in enumerate(stage_layer_ranges(num_layers, pp_size, partition)):
        for tp_rank in range(tp_size):
            heads = kv_head_range(tp_rank, tp_size, num_kv_heads)
            out.append(RankKV(pp_rank * tp_size + tp_rank, pp_rank, tp_rank, start, end, heads.start, heads.stop))
    return out


def writers_for(decode: RankKV, prefill_ranks: Sequence[RankKV]) -> list[Piece]:
    """The (prefill rank, layers, heads) pieces that together write all of `decode`'s KV, ordered by layer
    then head. Raises ValueError naming the layers and heads no prefill rank holds, or when two prefill
    stages claim the same layer."""
    _check_prefill(prefill_ranks)
    cuts = {decode.start_layer, decode.end_layer}
    for p in prefill_ranks:
        cuts.update(c for c in (p.start_layer, p.end_layer) if decode.start_layer < c < decode.end_layer)
    bounds = sorted(cuts)
    pieces: list[Piece] = []
    open_pieces: dict[tuple[int, int, int], int] = {}  # (writer rank, heads) -> index of a piece ending here
    missing: list[str] = []
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        holders = [p for p in prefill_ranks if p.start_layer <= lo and hi <= p.end_layer]
        for writer, heads in _head_runs(decode.heads, holders):
            if writer is None:
                missing.append(f"layers [{lo}, {hi}) heads [{heads.start}, {heads.stop})")
                continue
            key = (writer.rank, heads.start, heads.stop)
            index = open_pieces.get(key)
            if index is not None and pieces[index][1].stop == lo:
                pieces[index] = (writer, range(pieces[index][1].start, hi), heads)
            else:
                open_pieces[key] = len(pieces)
                pieces.append((writer, range(lo, hi), heads))
    if missing:
        raise ValueError(f"the prefill ranks do not cover decode rank {decode.rank} (layers [{decode.start_layer}, "
                         f"{decode.end_layer}), heads [{decode.head_start}, {decode.head_end})): no prefill rank "
                         f"holds {', '.join(missing)}")
    return sorted(pieces, key=lambda piece: (piece[1].start, piece[2].start))


def targets_for(prefill: RankKV, decode_ranks: Sequence[RankKV], prefill_ranks: Sequence[RankKV]) -> list[Piece]:
    """The (decode rank, layers, heads) pieces `prefill` writes, given all the prefill ranks (which of the
    replicas of a head writes it depends on the others): `writers_for` of each decode rank, kept where the
    writer is `prefill`."""
    if prefill not in prefill_ranks:
        raise ValueError(f"prefill rank {prefill.rank} is not among the prefill ranks given")
    return [(d, layers, heads) for d in decode_ranks for writer, layers, heads in writers_for(d, prefill_ranks)
            if writer == prefill]


def aux_writer(prefill_ranks: Sequence[RankKV]) -> RankKV:
    """The prefill rank that writes the metadata slot to every decode rank: last stage, TP rank 0."""
    if not prefill_ranks:
        raise ValueError("no prefill ranks given")
    last = max(p.pp_rank for p in prefill_ranks)
    found = [p for p in prefill_ranks if p.pp_rank == last and p.tp_rank == 0]
    if len(found) != 1:
        raise ValueError(f"expected one prefill rank at pp_rank {last}, tp_rank 0, found {len(found)}")
    return found[0]


def write_targets(me: RankKV, prefill_ranks: Sequence[RankKV],
                  decode_ranks: Sequence[RankKV]) -> list[tuple[int, list[tuple[range, range]]]]:
    """The decode ranks prefill rank `me` writes into, each with its (layers, heads) pieces: those it holds
    KV for, and every decode rank if `me` writes the metadata slot (then possibly with no pieces)."""
    writes_aux = aux_writer(prefill_ranks).rank == me.rank
    targets = []
    for d in decode_ranks:
        pieces = [(layers, heads) for w, layers, heads in writers_for(d, prefill_ranks) if w.rank == me.rank]
        if pieces or writes_aux:
            targets.append((d.rank, pieces))
    return targets


def senders_for(decode: RankKV, prefill_ranks: Sequence[RankKV]) -> list[int]:
    """Global ranks of the prefill ranks a decode rank hears from (its KV writers and the aux writer)."""
    ranks = {writer.rank for writer, _, _ in writers_for(decode, prefill_ranks)}
    ranks.add(aux_writer(prefill_ranks).rank)
    return sorted(ranks)


def _head_runs(heads: range, holders: list[RankKV]) -> list[tuple[RankKV | None, range]]:
    """`heads` split into runs of one writer each (None where nobody holds the head)."""
    runs: list[tuple[RankKV | None, range]] = []
    for h in heads:
        candidates = [p for p in holders if p.head_start <= h < p.head_end]
        writer = min(candidates, key=lambda p: (p.tp_rank, p.rank)) if candidates else None
        if runs and runs[-1][0] == writer and runs[-1][1].stop == h:
            runs[-1] = (writer, range(runs[-1][1].start, h + 1))
        else:
            runs.append((writer, range(h, h + 1)))
    return runs


def _check_prefill(prefill_ranks: Sequence[RankKV]) -> None:
    by_rank: dict[int, RankKV] = {}
    for p in prefill_ranks:
        if by_rank.setdefault(p.rank, p) != p:
            raise ValueError(f"prefill rank {p.rank} is described twice, differently")
    stages: dict[int, RankKV] = {}
    for p in by_rank.values():
        other = stages.setdefault(p.pp_rank, p)
        if other.layers != p.layers:
            raise ValueError(f"prefill pp stage {p.pp_rank} has ranks with different layers "
                             f"({other.layers} on rank {other.rank}, {p.layers} on rank {p.rank})")
    spans = sorted((p.start_layer, p.end_layer, p.pp_rank) for p in stages.values())
    for (_, end, a), (start, _, b) in zip(spans, spans[1:], strict=False):
        if start < end:
            raise ValueError(f"prefill pp stages {a} and {b} both hold layer {start}")
