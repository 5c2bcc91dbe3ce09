"""bench/pipeline.py's arithmetic: a stage's share of a run from its cumulative counters, and the cost model
handed to bench/pp_sim.py, against hand-computed values."""

from __future__ import annotations

import math

import pytest

from bench.pipeline import (
    cached_prompt_tokens,
    single_figures,
    stage_costs,
    stage_figures,
    steady_figures,
    steady_window,
)

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


def _info(running: list[int], prefilled: list[int], forward: list[float], waiting: int = 0) -> dict:
    return {"pp_stages": [{"num_running_reqs": n, "num_waiting_reqs": waiting, "stage_prefill_tokens": p,
                           "stage_forward_s": f} for n, p, f in zip(running, prefilled, forward, strict=True)]}


def test_the_steady_window_starts_once_every_prompt_is_prefilled_and_ends_before_the_first_finish():
    samples = [
        (0.5, _info([32, 32], [1100, 100], [5.4, 5.0], waiting=32)),  # lane 0 prefilled on stage 0, 32 wait
        (0.8, _info([64, 64], [2100, 1100], [5.6, 5.3])),  # lane 1's prefill still in the pipe
        (1.0, _info([64, 64], [2100, 2100], [5.9, 5.6])),  # every prompt through both stages: the window starts
        (2.0, _info([64, 64], [2100, 2100], [6.75, 6.5])),
        (3.0, _info([64, 64], [2100, 2100], [7.6, 7.4])),  # the last sample with every request running
        (3.5, _info([32, 64], [2100, 2100], [8.0, 7.8])),  # one lane finished on stage 0
    ]
    window = steady_window(samples, num_requests=64)
    assert window is not None and window[0][0] == 1.0 and window[1][0] == 3.0
    fig = steady_figures(window)
    assert fig["window_s"] == pytest.approx(2.0)
    assert [s["bubble"] for s in fig["stages"]] == pytest.approx([1 - 1.7 / 2, 1 - 1.8 / 2])
    assert fig["bubble_worst"] == pytest.approx(0.15)


def test_a_run_too_short_to_sample_has_no_steady_window():
    samples = [(0.5, _info([64, 64], [2048, 2048], [0.4, 0.4])), (0.9, _info([0, 0], [2048, 2048], [0.8, 0.8]))]
    assert steady_window(samples, num_requests=64) is None
    assert steady_window([], num_requests=64) is None
    fig = steady_figures(None)
    assert fig["window_s"] == 0.0 and math.isnan(fig["bubble_worst"])
