"""The arithmetic of bench/tensor_parallel.py: bytes through the collectives, the per-round ratio pairing, and
the step = compute + communication projection (checked against hand-computed values)."""

from __future__ import annotations

import pytest
import torch

from bench.tensor_parallel import (
    CollectiveRecorder,
    paired_min_sum,
    payload_bytes,
    projection,
    round_ratios,
    summary,
    tensor_nbytes,
)


def test_payload_bytes_sums_every_collective_tensor():
    records = [("all_reduce", (64, 576), 2), ("all_reduce", (64, 576), 2), ("all_gather", (64, 24576), 4)]
    assert tensor_nbytes((64, 576), 2) == 73728
    assert payload_bytes(records) == 2 * 73728 + 64 * 24576 * 4
    assert payload_bytes([]) == 0


def test_recorder_records_shape_itemsize_and_time():
    rec = CollectiveRecorder()
    rec.add("all_reduce", torch.zeros(3, 5, dtype=torch.bfloat16), 0.25)
    rec.add("all_gather", torch.zeros(2, 7, dtype=torch.float32), 0.5)
    assert rec.records == [("all_reduce", (3, 5), 2), ("all_gather", (2, 7), 4)]
    assert rec.seconds == 0.75 and rec.per_call == [0.25, 0.5] and payload_bytes(rec.records) == 30 + 56
    rec.reset()
    assert rec.records == [] and rec.per_call == [] and rec.seconds == 0.0 and rec.dtypes == []


def test_round_ratios_pair_the_same_round():
    tp2 = [[2.0, 4.0, 3.0], [10.0, 10.0, 12.0]]
    tp1 = [[1.0, 1.0, 2.0], [5.0, 4.0, 6.0]]
    assert round_ratios(tp2, tp1) == [3.0, 2.0]  # medians 3/1 and 10/5, not a pooled median
    with pytest.raises(ValueError):
        round_ratios(tp2, tp1[:1])


def test_projection_reproduces_the_measured_ratio_and_scales_communication():
    # TP=1 10 ms; TP=2 7 ms of which 2 ms collectives -> compute 5 ms = eff 0.5 of TP=1's step
    p = projection(0.010, 0.007, 0.002, cores_per_rank=(1, 4))
    assert p["eff"] == pytest.approx(0.5)
    assert p["same_total"]["P=1"] == pytest.approx(0.7)  # = 7 / 10, the measured ratio
    # 4 cores per rank: TP=1 on 8 cores 2.5 ms; TP=2 0.5 * 2.5 + 2 = 3.25 ms
    assert p["same_total"]["P=4"] == pytest.approx(3.25 / 2.5)
    # vs TP=1 on one rank's 4 cores (5 ms)
    assert p["gain_per_rank_cores"]["P=4"] == pytest.approx(5.0 / 3.25)
    assert p["gain_per_rank_cores"]["P=1"] == pytest.approx(20.0 / 7.0)


def test_paired_min_sum_takes_each_collectives_shorter_rank():
    # rank 0 waited in the first collective, rank 1 in the second: the transfer is 1 + 2 ms
    assert paired_min_sum([0.005, 0.002], [0.001, 0.006]) == pytest.approx(0.003)
    with pytest.raises(ValueError):
        paired_min_sum([0.001], [0.001, 0.002])


def test_summary_judges_the_targets_at_batch_64_and_flags_a_noisy_machine():
    point = dict(kind="decode", batch=64, ratio_tp2_over_tp1=1.3, ratio_tp2_over_tp1_modular=1.2, comm_share=0.4,
                 comm_over_bare=1.5, transfer_over_bare=1.2, other_cpu_share=0.05)
    prefill = dict(point, kind="prefill", batch=4, comm_over_bare=2.5, other_cpu_share=0.3)
    head = summary({"m": [point, prefill]})["m"]
    assert head["target_step_met"] is False and head["target_step_met_modular"] is True
    assert head["target_comm_vs_bare_met"] is False and head["comm_over_bare_max"] == 2.5  # any point over 2x
    assert head["machine_quiet"] is False  # the prefill ran with 30% of the CPUs taken by others
    assert summary({"m": [point]})["m"]["machine_quiet"] is True
