"""Prefill -> decode pairing: every (layer, head) of every decode rank written exactly once, by the lowest TP
rank holding it, checked by brute-force counting over the shapes disaggregation meets."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from tokenloom.disaggregation.pairing import (
    RankKV,
    aux_writer,
    kv_head_range,
    senders_for,
    targets_for,
    topology_ranks,
    writers_for,
)
from tokenloom.distributed.parallel_state import ParallelContext
from tokenloom.layers.linear import QKVParallelLinear

# (layers, kv heads, prefill (tp, pp, partition), decode (tp, pp, partition))
SHAPES = {
    "pp2->pp1": (8, 4, (1, 2, None), (1, 1, None)),
    "pp1->pp2": (8, 4, (1, 1, None), (1, 2, None)),
    "pp2->pp2": (8, 4, (1, 2, None), (1, 2, None)),
    "pp3->pp2 uneven": (7, 4, (1, 3, None), (1, 2, None)),
    "pp3->pp2 partition": (9, 4, (1, 3, [5, 1, 3]), (1, 2, [2, 7])),
    "tp2->tp1": (4, 4, (2, 1, None), (1, 1, None)),
    "tp1->tp2": (4, 4, (1, 1, None), (2, 1, None)),
    "tp4 replicated->tp1": (4, 2, (4, 1, None), (1, 1, None)),
    "tp2->tp4 replicated": (4, 2, (2, 1, None), (4, 1, None)),
    "tp8 replicated->tp2": (4, 2, (8, 1, None), (2, 1, None)),
    "tp4pp2 replicated->tp2pp3": (6, 2, (4, 2, None), (2, 3, [1, 2, 3])),
    "tp2pp3->tp4pp2 replicated": (7, 2, (2, 3, None), (4, 2, None)),
}


def build(shape: str) -> tuple[list[RankKV], list[RankKV]]:
    layers, kv, (ptp, ppp, ppart), (dtp, dpp, dpart) = SHAPES[shape]
    return topology_ranks(layers, kv, ptp, ppp, ppart), topology_ranks(layers, kv, dtp, dpp, dpart)


@pytest.mark.parametrize("shape", SHAPES)
def test_every_layer_and_head_is_written_exactly_once_by_its_lowest_tp_holder(shape):
    prefill, decode = build(shape)
    for d in decode:
        count: Counter[tuple[int, int]] = Counter()
        for writer, layers, heads in writers_for(d, prefill):
            for layer in layers:
                for head in heads:
                    count[layer, head] += 1
                    assert layer in writer.layers and head in writer.heads
                    holders = [p.tp_rank for p in prefill if layer in p.layers and head in p.heads]
                    assert writer.tp_rank == min(holders)
        assert count == Counter({(layer, head): 1 for layer in d.layers for head in d.heads})


@pytest.mark.parametrize("shape", SHAPES)
def test_targets_are_the_inverse_of_writers(shape):
    prefill, decode = build(shape)
    by_writer = Counter((w.rank, d.rank, layer, head) for d in decode for w, ls, hs in writers_for(d, prefill)
                        for layer in ls for head in hs)
    by_target = Counter((p.rank, d.rank, layer, head) for p in prefill for d, ls, hs in targets_for(p, decode, prefill)
                        for layer in ls for head in hs)
    assert by_writer == by_target
    assert sum(by_target.values()) == sum(len(d.layers) * len(d.heads) for d in decode)


def test_replicated_heads_have_one_designated_writer():
    prefill = topology_ranks(4, 2, tp_size=4, pp_size=1)  # ranks 0, 1 hold head 0; ranks 2, 3 head 1
    (decode,) = topology_ranks(4, 2, tp_size=1, pp_size=1)
    pieces = [(w.rank, ls, hs) for w, ls, hs in writers_for(decode, prefill)]
    assert pieces == [(0, range(0, 4), range(0, 1)), (2, range(0, 4), range(1, 2))]
    assert targets_for(prefill[1], [decode], prefill) == [] and targets_for(prefill[3], [decode], prefill) == []
    # decode replicas each get their copy
    decode4 = topology_ranks(4, 2, tp_size=4, pp_size=1)
    assert [[(w.rank, hs) for w, _, hs in writers_for(d, prefill)] for d in decode4] == \
        [[(0, range(0, 1))], [(0, range(0, 1))], [(2, range(1, 2))], [(2, range(1, 2))]]


def test_pipeline_split_pieces():
    prefill = topology_ranks(7, 4, tp_size=1, pp_size=3)  # layers [0, 2), [2, 4), [4, 7)
    decode = topology_ranks(7, 4, tp_size=1, pp_size=2)  # layers [0, 3), [3, 7)
    assert [(w.rank, ls) for w, ls, _ in writers_for(decode[0], prefill)] == [(0, range(0, 2)), (1, range(2, 3))]
    assert [(w.rank, ls) for w, ls, _ in writers_for(decode[1], prefill)] == [(1, range(3, 4)), (2, range(4, 7))]
    assert [(d.rank, ls) for d, ls, _ in targets_for(prefill[1], decode, prefill)] == \
        [(0, range(2, 3)), (1, range(3, 4))]


def test_aux_writer_and_senders():
    prefill = topology_ranks(8, 4, tp_size=2, pp_size=3)
    assert (aux_writer(prefill).pp_rank, aux_writer(prefill).tp_rank, aux_writer(prefill).rank) == (2, 0, 4)
    decode = topology_ranks(8, 4, tp_size=2, pp_size=3)
    # decode stage 0 (layers [0, 2)) gets KV from prefill stage 0 only, the aux slot from rank 4
    assert senders_for(decode[0], prefill) == [0, 4] and senders_for(decode[1], prefill) == [1, 4]
    assert senders_for(decode[4], prefill) == [4] and senders_for(decode[5], prefill) == [4, 5]
    with pytest.raises(ValueError, match="pp_rank 2, tp_rank 0"):
        aux_writer([p for p in prefill if p.rank != 4])
    with pytest.raises(ValueError):
        aux_writer([])


def test_missing_coverage_is_named():
    (decode,) = topology_ranks(8, 4, tp_size=1, pp_size=1)
    first_stage = topology_ranks(8, 4, tp_size=1, pp_size=2)[:1]
    with pytest.raises(ValueError, match=r"no prefill rank holds layers \[4, 8\) heads \[0, 4\)"):
        writers_for(decode, first_stage)
    tp0_only = topology_ranks(8, 4, tp_size=2, pp_size=1)[:1]
    with pytest.raises(ValueError, match=r"layers \[0, 8\) heads \[2, 4\)"):
        writers_for(decode, tp0_only)
    with pytest.raises(ValueError, match="decode rank 0"):
        targets_for(first_stage[0], [decode], first_stage)


def test_inconsistent_prefill_descriptions_are_refused():
    prefill = topology_ranks(8, 4, tp_size=1, pp_size=2)
    (decode,) = topology_ranks(8, 4, tp_size=1, pp_size=1)
    overlap = [prefill[0], RankKV(1, 1, 0, 3, 8, 0, 4)]
    with pytest.raises(ValueError, match="both hold layer 3"):
        writers_for(decode, overlap)
    with pytest.raises(ValueError, match="described twice"):
        writers_for(decode, [prefill[0], RankKV(0, 0, 0, 0, 3, 0, 4), prefill[1]])
    with pytest.raises(ValueError, match="different layers"):
        writers_for(decode, [prefill[0], RankKV(5, 0, 1, 0, 3, 0, 4), prefill[1]])
    with pytest.raises(ValueError, match="not among"):
        targets_for(RankKV(9, 0, 0, 0, 4, 0, 4), [decode], prefill)


def test_rank_kv_json_round_trip_and_refusals():
    rank = topology_ranks(6, 2, tp_size=4, pp_size=2)[6]
    assert (rank.rank, rank.pp_rank, rank.tp_rank, rank.layers, rank.heads) == (6, 1, 2, range(3, 6), range(1, 2))
    data = json.loads(json.dumps(rank.to_json()))
    assert RankKV.from_json(data) == rank
    with pytest.raises(ValueError, match="missing \\['head_end'\\]"):
        RankKV.from_json({k: v for k, v in data.items() if k != "head_end"})
    with pytest.raises(ValueError, match="unknown"):
        RankKV.from_json({**data, "x": 0})
    with pytest.raises(ValueError, match="holds no KV"):
        RankKV.from_json({**data, "head_end": data["head_start"]})
    with pytest.raises(ValueError, match="non-negative int"):
        RankKV.from_json({**data, "rank": -1})


@pytest.mark.parametrize(("tp", "kv"), [(1, 4), (2, 4), (4, 4), (4, 2), (8, 2), (2, 1)])
def test_head_ranges_match_the_qkv_weight_shards(tp, kv):
    head_dim = 2
    k_weight = torch.arange(kv).repeat_interleave(head_dim).float()[:, None].expand(kv * head_dim, 16)
    for tp_rank in range(tp):
        lin = QKVParallelLinear(16, head_dim, 8, kv, False, ParallelContext(tp_rank=tp_rank, tp_size=tp),
                                torch.float32)
        lin.load_part("k_proj", 1, k_weight.contiguous())
        held = lin.weight.narrow(0, lin.offsets[1], lin.local_sizes[1])[::head_dim, 0].long().tolist()
        assert held == list(kv_head_range(tp_rank, tp, kv))


def test_head_ranges_refuse_indivisible_shapes():
    with pytest.raises(ValueError, match="not divisible"):
        kv_head_range(0, 3, 4)
    with pytest.raises(ValueError, match="not divisible"):
        kv_head_range(0, 4, 3)
    with pytest.raises(ValueError, match="outside"):
        kv_head_range(2, 2, 4)
