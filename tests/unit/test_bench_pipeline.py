"""bench/pipeline.py's arithmetic: a stage's share of a run from its cumulative counters, and the cost model
handed to bench/pp_sim.py, against hand-computed values."""

from __future__ import annotations

import math

import pytest

from bench.pipeline import cached_prompt_tokens, single_figures, stage_costs, stage_figures

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
    assert fig["prefill_token_s"] == pytest.approx(1.0 / 500) and fig["prefill_tokens"] == 500
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
    other = [{**stages[0], "decode_step_s": 0.05, "scheduler_cpu_per_step_s": 0.004},
             {**stages[1], "prefill_token_s": 0.005, "scheduler_cpu_per_step_s": 0.006}]
    runs = [{"stages": stages}, {"stages": other}, {"stages": stages}]
    costs = stage_costs(runs, {"link_latency_s": 1e-4, "link_bytes_per_s": 1e9})
    # per stage, the median over the three runs (the last stage, which samples, keeps its own cost)
    assert costs["decode_d_s_per_req"] == pytest.approx([0.04 / 32, 0.06 / 32])
    assert costs["prefill_b_s_per_token"] == pytest.approx([0.001, 0.003])
    assert costs["sched_s"] + costs["process_s"] == pytest.approx(0.004)  # median of 2, 4, 4, 6, 2, 4 ms
    assert costs["link_latency_s"] == 1e-4 and costs["hidden_size"] == 1024


def test_cached_prompt_tokens_are_the_prompt_less_what_stage_0_prefilled():
    # 64 requests of 32 prompt tokens; runs that hit the prefix cache prefill 1 token each (one run 2 each)
    runs = [{"stages": [{"prefill_tokens": n}, {"prefill_tokens": 0}]} for n in (64, 128, 64)]
    assert cached_prompt_tokens(runs, num_requests=64, input_len=32) == 31
    cold = [{"stages": [{"prefill_tokens": 64 * 32}]}]
    assert cached_prompt_tokens(cold, num_requests=64, input_len=32) == 0
