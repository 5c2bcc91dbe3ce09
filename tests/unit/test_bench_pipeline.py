"""bench/pipeline.py's arithmetic: a stage's share of a run from its cumulative counters, and the cost model
handed to bench/pp_sim.py, against hand-computed values."""

from __future__ import annotations

import math

import pytest

from bench.pipeline import single_figures, stage_costs, stage_figures

BEFORE = {"stage_forward_s": 1.0, "stage_decode_s": 0.5, "stage_decode_steps": 10, "stage_decode_reqs": 80,
          "stage_prefill_s": 0.5, "stage_prefill_tokens": 100, "recv_wait_s": 0.1, "send_wait_s": 0.0,
          "forward_wait_s": 0.2, "scheduler_cpu_s": 0.05, "iterations": 20}


def _after(**delta) -> dict:
    return {k: v + delta.get(k, 0) for k, v in BEFORE.items()}


def test_stage_figures_are_differences_over_the_run():
    after = _after(stage_forward_s=3.0, stage_decode_s=2.0, stage_decode_steps=40, stage_decode_reqs=1280,
                   stage_prefill_s=1.0, stage_prefill_tokens=500, recv_wait_s=0.4, send_wait_s=0.05,
                   forward_wait_s=0.3, scheduler_cpu_s=0.1, iterations=50)
    fig = stage_figures(BEFORE, after, wall_s=4.0)
    assert fig["busy"] == pytest.approx(0.75) and fig["bubble"] == pytest.approx(0.25)
    assert fig["decode_step_s"] == pytest.approx(2.0 / 40) and fig["decode_batch"] == pytest.approx(32)
    assert fig["prefill_token_s"] == pytest.approx(1.0 / 500)
    assert fig["recv_wait_s"] == pytest.approx(0.4) and fig["send_wait_s"] == pytest.approx(0.05)
    assert fig["scheduler_cpu_per_step_s"] == pytest.approx(0.1 / 50)


def test_a_run_without_decode_steps_reports_nan_not_a_division_error():
    fig = stage_figures(BEFORE, _after(stage_forward_s=0.5), wall_s=1.0)
    assert math.isnan(fig["decode_step_s"]) and fig["bubble"] == pytest.approx(0.5)


def test_single_process_bubble_and_stage_costs():
    assert single_figures({"forward_busy_s": 1.0}, {"forward_busy_s": 1.9}, 1.0)["bubble"] == pytest.approx(0.1)
    stages = [{"decode_step_s": 0.04, "decode_batch": 32, "prefill_token_s": 0.001,
               "scheduler_cpu_per_step_s": 0.002}, {"decode_step_s": 0.06, "decode_batch": 32,
                                                    "prefill_token_s": 0.003, "scheduler_cpu_per_step_s": 0.004}]
    costs = stage_costs([{"stages": stages}], {"link_latency_s": 1e-4, "link_bytes_per_s": 1e9})
    assert costs["decode_d_s_per_req"] == pytest.approx(0.05 / 32)
    assert costs["prefill_b_s_per_token"] == pytest.approx(0.002)
    assert costs["sched_s"] + costs["process_s"] == pytest.approx(0.003)
    assert costs["link_latency_s"] == 1e-4 and costs["hidden_size"] == 1024
