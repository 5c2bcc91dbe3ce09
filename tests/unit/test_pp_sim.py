"""bench/pp_sim.py, the discrete-event model of the pipeline loop, against hand-computed timelines: pp=1 makespan =
sum of forwards (depth 0/1, chunked or not), a cached prompt prefix, idle gaps, a chunked prompt's TTFT, the
batcher's caps, the pp=2 single-request critical path, one send in flight per channel, a forward thread's proxy
send leaving when its forward ends, the depth-1 bubble, the two send optimizations (the early output send and
overlapped sends: never slower, in pipeline_loop.py's forms and with a CPU-posted proxy; the CPU-blocking form
of the early output send is), the `--scenario seed` (PP4 x TP8) shape's margin, and `--validate` on a
bench/pipeline.py-shaped JSON."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace

import pytest

from bench.pp_batcher import Batcher, make_workload
from bench.pp_sim import (
    OFF,
    PipelineSim,
    Req,
    SimConfig,
    StageCost,
    explain_gap,
    loop_forms,
    main,
    run_config_from_json,
    seed_config,
    seed_workload,
    simulate,
)

# pp=1 references: two requests of 10 prompt tokens and 3 output tokens, lane cap 2. Forwards cost
# prefill a + b * tokens and decode c + d * batch + e * kv (kv = prompt + tokens generated so far).
COST = StageCost(a=1.0, b=0.1, c=0.5, d=0.01, e=0.001)
TOGETHER = (1.0 + 20 * 0.1) + (0.5 + 2 * 0.01 + 22 * 0.001) + (0.5 + 2 * 0.01 + 24 * 0.001)  # one 20-token chunk
PREFILL_10 = 1.0 + 10 * 0.1
# chunk 10, depth 0: the second prompt's prefill (priority) comes before the first request decodes, then both
# decode together. Depth 1: the second prompt goes to lane 1, and the two requests decode alone, alternately.
DEPTH0_CHUNK10 = 2 * PREFILL_10 + (0.5 + 2 * 0.01 + 22 * 0.001) + (0.5 + 2 * 0.01 + 24 * 0.001)
DEPTH1_CHUNK10 = 2 * PREFILL_10 + 2 * ((0.5 + 0.01 + 11 * 0.001) + (0.5 + 0.01 + 12 * 0.001))
PP1_SUM = TOGETHER


@pytest.mark.parametrize("depth,chunk,expected", [(0, 100, TOGETHER), (1, 100, TOGETHER), (0, 10, DEPTH0_CHUNK10),
                                                  (1, 10, DEPTH1_CHUNK10)])
def test_pp1_without_cpu_costs_runs_for_the_sum_of_its_forwards(depth, chunk, expected):
    cfg = SimConfig(stages=(COST,), depth=depth, max_running_requests=2, chunk_size=chunk)
    m = simulate(cfg, [Req(0.0, 10, 3), Req(0.0, 10, 3)])
    assert m["duration_s"] == pytest.approx(expected, rel=1e-12)
    assert m["output_throughput"] == pytest.approx(6 / expected, rel=1e-12)
    assert m["bubble_fraction"] == [pytest.approx(0.0, abs=1e-12)]


@pytest.mark.parametrize("cached", [8, 50])
def test_a_cached_prompt_prefix_is_not_prefilled_but_is_attended(cached):
    # the two 10-token prompts each find `cached` tokens in the prefix cache, capped at 9 (the engine matches all
    # but the last token): one prefill forward of the uncached tokens, then decodes over the whole prompt's KV
    prefilled = 2 * (10 - min(cached, 9))
    expected = (1.0 + prefilled * 0.1) + (0.5 + 2 * 0.01 + 22 * 0.001) + (0.5 + 2 * 0.01 + 24 * 0.001)
    cfg = SimConfig(stages=(COST,), max_running_requests=2, chunk_size=100)
    m = simulate(cfg, make_workload(2, 10, 3, cached_len=cached))
    assert m["duration_s"] == pytest.approx(expected, rel=1e-12)
    assert m["ttft_ms"]["mean"] == pytest.approx(1e3 * (1.0 + prefilled * 0.1), rel=1e-12)


def test_idle_gaps_between_arrivals_are_not_bubbles():
    # pp=1, no CPU costs: each request is a 1.0 s prefill then two 0.5 s decodes; the second arrives at t = 10
    cfg = SimConfig(stages=(StageCost(a=1.0, c=0.5),))
    m = simulate(cfg, [Req(0.0, 4, 3), Req(10.0, 4, 3)])
    assert m["ttft_ms"]["p50"] == pytest.approx(1e3, rel=1e-12)
    assert m["duration_s"] == pytest.approx(12.0, rel=1e-12)
    assert m["bubble_fraction"] == [pytest.approx(0.0, abs=1e-12)]  # only 4 s of the 12 have work
    assert m["busy_fraction"] == [pytest.approx(1.0, rel=1e-12)]
    assert m["itl_ms"]["mean"] == pytest.approx(500.0, rel=1e-12)


def test_chunked_prompt_takes_one_forward_per_chunk():
    cfg = SimConfig(stages=(StageCost(a=1.0, b=0.01),), chunk_size=64)
    m = simulate(cfg, [Req(0.0, 150, 1)])
    # chunks of 64, 64 and 22 tokens; the single output token comes with the last chunk
    assert m["ttft_ms"]["mean"] == pytest.approx(1e3 * (1.64 + 1.64 + 1.22), rel=1e-12)
    assert m["duration_s"] == pytest.approx(4.5, rel=1e-12)


def test_batcher_caps_each_lane_and_the_total():
    # pp=2, depth 1: three lanes, lane cap 5 // 2 = 2, global cap 5; six 10-token prompts, chunk 25
    cfg = SimConfig(stages=(COST, COST), depth=1, max_running_requests=5, chunk_size=25)
    bat = Batcher(cfg, [Req(0.0, 10, 4) for _ in range(6)])
    bat.read_inbox(0.0)
    b0 = bat.decide(0, 0)  # the lane cap stops it at two prompts, with 5 tokens of budget left
    assert [(r.prefilled, done) for r, done in b0.prefill] == [(10, True), (10, True)] and b0.tokens == 20
    b1 = bat.decide(1, 1)
    assert b1.tokens == 20 and bat.running == 4
    b2 = bat.decide(2, 2)  # the global cap of 5 leaves one more
    assert b2.tokens == 10 and bat.running == 5 and len(bat.waiting) == 1
    bat.apply(b0, 1.0)
    b3 = bat.decide(3, 0)  # lane 0 is full: its two requests decode, kv = 2 * (10 + 1)
    assert b3.prefill == [] and len(b3.decode) == 2
    assert b3.durations == (COST.decode(2, 22), COST.decode(2, 22))


# pp=2 balanced, one request: forward f per stage, link latency lam, bandwidth bw, per-message CPU mu, sched sig,
# process p. From stage 0 stamping token k: request list to stage 1 (mu), schedule (sig), forward (f), proxy send
# (mu, 4 * hidden bytes, lam), stage 1 receives it (mu), forwards (f), the output leaves behind that forward (mu,
# 8 bytes, lam), stage 0 receives it (mu) and processes it (p). The other stage-1 CPU work (its request receive,
# its schedule, its processing of the previous result) finishes before the data it waits for arrives (sig < mu +
# 2 lam), so it is off the critical path.
F, LAM, MU, SIG, P, HIDDEN = 0.010, 0.001, 0.0001, 0.0005, 0.0003, 1024
BW = 4096 / 0.0002  # the one-token proxy (2 * 1024 * 2 bytes) takes 0.2 ms on the wire
CRITICAL = 2 * F + 2 * LAM + 5 * MU + SIG + P + 4 * HIDDEN / BW + 8 / BW


def _pp2(**kw) -> SimConfig:
    st = StageCost(a=F, c=F)
    return SimConfig(stages=(st, st), sched_s=SIG, process_s=P, msg_cpu_s=MU, link_latency_s=LAM,
                     link_bytes_per_s=BW, hidden_size=HIDDEN, **kw)


def test_pp2_single_request_itl_is_the_hand_computed_critical_path():
    sim = PipelineSim(_pp2(), [Req(0.0, 1, 6)])
    m = sim.run()
    assert len(sim.batcher.itl) == 5
    assert sim.batcher.itl == [pytest.approx(CRITICAL, rel=1e-9)] * 5
    # the one-token prefill costs f per stage too, so the first token follows the same path from t = 0
    assert m["ttft_ms"]["mean"] == pytest.approx(1e3 * CRITICAL, rel=1e-9)
    assert m["duration_s"] == pytest.approx(6 * CRITICAL, rel=1e-9)


def test_one_send_in_flight_per_channel_holds_a_link_bound_stage_back():
    # 1 ms forwards, 10 ms on the wire per proxy token: at depth 2 stage 0 could run ahead, but each proxy send
    # waits until stage 1 took the previous one, so stage 0 spends nearly the whole run waiting on its sends.
    st = StageCost(a=0.001, c=0.001)
    cfg = SimConfig(stages=(st, st), depth=2, max_running_requests=8, chunk_size=16, hidden_size=1024,
                    link_bytes_per_s=4096 / 0.01)
    sim = PipelineSim(cfg, [Req(0.0, 1, 20) for _ in range(8)])
    m = sim.run()
    assert sim.send_wait[0] > 0.9 * m["duration_s"]
    assert sim.send_wait[1] == 0.0


def test_a_forward_thread_posts_its_proxy_when_the_forward_ends_not_when_the_cpu_gets_there():
    # pp=2, depth 0, two one-request lanes: stage 0 forwards in 1 ms, stage 1 in 10 ms (it is the bottleneck),
    # link latency 2 ms, processing 1 ms. Stage 0's CPU submits lane A's step, then waits for lane B's output
    # (it leaves stage 1 when B's forward ends, E). Posted by the forward thread (pipeline_loop.py with point 2),
    # A's proxy left at its forward's end, long before E: stage 1 starts A at E and never idles, one token per
    # lane every 2 x 10 ms. Posted by the CPU after it processed B's output, A's proxy reaches stage 1 at
    # E + 2 + 1 + 2 ms: every step of stage 1 waits 5 ms, a token every 2 x 15 ms.
    stages = (StageCost(a=0.001, c=0.001), StageCost(a=0.010, c=0.010))
    for stream_ordered, itl in ((True, 0.020), (False, 0.030)):
        cfg = SimConfig(stages=stages, stream_ordered_proxy=stream_ordered, link_latency_s=0.002, process_s=0.001,
                        max_running_requests=2)
        sim = PipelineSim(cfg, [Req(0.0, 1, 20), Req(0.0, 1, 20)])
        sim.run()
        assert sim.batcher.itl == [pytest.approx(itl, rel=1e-9)] * 38


def test_depth1_hides_the_processing_that_depth0_leaves_on_the_ring():
    # zero link and scheduling costs; processing 0.3 f per result. At depth 0 stage 0 cannot process lane nxt's
    # result before stage 1 finished it (about when stage 0's own forward ends): period f + p, bubble p / (f + p).
    st = StageCost(a=0.01, c=0.01)
    reqs = [Req(0.0, 16, 64) for _ in range(96)]
    bubble = {}
    for depth in (0, 1):
        cfg = SimConfig(stages=(st, st), depth=depth, process_s=0.003, max_running_requests=96, chunk_size=64)
        bubble[depth] = simulate(cfg, reqs)["bubble_fraction"]
    assert bubble[0][0] == pytest.approx(0.3 / 1.3, abs=0.01)
    assert max(bubble[1]) < 0.01


def _grid():
    for pp, last_mult, proc, lat in itertools.product((2, 3), (1.0, 1.5), (0.0, 0.02), (0.0, 1e-3)):
        stages = tuple(StageCost(a=0.01, b=1e-5, c=0.01 * (last_mult if s == pp - 1 else 1.0), d=1e-4)
                       for s in range(pp))
        yield SimConfig(stages=stages, process_s=proc, sched_s=5e-4, msg_cpu_s=5e-5, link_latency_s=lat,
                        max_running_requests=24, chunk_size=64)


@pytest.mark.parametrize("forms", ["loop", "cpu_proxy"])
@pytest.mark.parametrize("point", ["early_output_send", "grouped_sends"])
def test_each_point_on_is_never_slower_than_off(point, forms):
    # "loop": pipeline_loop.py's forms (point 2 ON also moves the proxy send to the forward thread); "cpu_proxy":
    # the proxy is always posted by the CPU once the forward is done
    reqs = [Req(0.0, 20 + i, 30 + 2 * i) for i in range(24)]
    gains = []
    for cfg in _grid():
        for other in (True, False):
            points = {"early_output_send": other, "grouped_sends": other}
            runs = {}
            for value in (True, False):
                points[point] = value
                kw = loop_forms(**points) if forms == "loop" else points
                runs[value] = simulate(replace(cfg, **kw), reqs)["duration_s"]
            assert runs[True] <= runs[False] * (1 + 1e-12)
            gains.append(runs[False] / runs[True])
    assert max(gains) > 1.05  # and it matters somewhere in the grid


def test_point1_blocking_the_cpu_puts_the_last_stages_processing_in_series():
    # pp=3: with the CPU waiting for the forward before the early send, the last stage's processing (0.3 f) no
    # longer overlaps its forward; at pp=2 stage 0's processing is on the ring anyway and hides it.
    stages = tuple(StageCost(a=0.01, c=0.01) for _ in range(3))
    cfg = SimConfig(stages=stages, process_s=0.003, sched_s=5e-4, max_running_requests=24, chunk_size=64)
    reqs = [Req(0.0, 16, 40) for _ in range(24)]
    off = simulate(replace(cfg, early_output_send=False), reqs)["request_throughput"]
    blocking = simulate(replace(cfg, early_send_blocking=True), reqs)["request_throughput"]
    assert blocking < 0.9 * off


def test_seed_scenario_on_beats_off_by_about_the_seeds_margin():
    # seed_config's defaults: point 1 non-blocking, the proxy posted by the CPU once the forward is done, the form
    # whose gain matches the reported one (pipeline_loop.py's forward-thread proxy gains more: --scenario seed)
    reqs = seed_workload(256)
    off = simulate(seed_config(**OFF), reqs)["request_throughput"]
    on = simulate(seed_config(), reqs)["request_throughput"]
    assert 1.002 < on / off < 1.03  # reported for this shape: 4.61 -> 4.65 req/s (+0.9%)


def test_validate_reads_the_pipeline_benchmark_schema(tmp_path, capsys):
    base = {"prefill_a_s": 1.0, "prefill_b_s_per_token": 0.1, "decode_c_s": 0.5, "decode_d_s_per_req": 0.01,
            "decode_e_s_per_kv_token": 0.001, "sched_s": 0.0, "process_s": 0.0, "link_latency_s": 0.0,
            "link_bytes_per_s": 1e12, "hidden_size": 64}
    pp2 = {**base, "prefill_a_s": [F, F], "prefill_b_s_per_token": 0.0, "decode_c_s": [F, F], "decode_d_s_per_req": 0,
           "decode_e_s_per_kv_token": 0, "sched_s": SIG, "process_s": P, "msg_cpu_s": MU, "link_latency_s": LAM,
           "link_bytes_per_s": BW, "hidden_size": HIDDEN}
    runs = [
        {"pp": 1, "depth": 0, "early_output_send": True, "grouped_sends": True, "num_requests": 2, "input_len": 10,
         "output_len": 3, "max_running_requests": 2, "chunked_prefill_size": 100,
         "measured": {"output_throughput": 3 / PP1_SUM, "bubble_fraction": [0.0], "itl_ms_median": 1.0},
         "stage_costs": base},
        {"pp": 2, "depth": 0, "early_output_send": True, "grouped_sends": False, "num_requests": 1, "input_len": 1,
         "output_len": 6, "max_running_requests": 1,
         "measured": {"output_throughput": 6 / (6 * CRITICAL), "bubble_fraction": [0.5, 0.5],
                      "itl_ms_median": 1e3 * CRITICAL},
         "stage_costs": pp2},
    ]
    cached = {**runs[0], "cached_prompt_tokens": 8, "measured": {"output_throughput": 6 / CACHED_8,
                                                                  "itl_ms_mean": 1e3 * (0.542 + 0.544) / 2}}
    path = tmp_path / "pipeline.json"
    path.write_text(json.dumps({"runs": [*runs, cached]}))
    res = main(["--validate", str(path), "--json"])
    out = capsys.readouterr().out
    assert json.loads(out.strip().splitlines()[-1]) == json.loads(json.dumps(res))
    first, second, third = res["runs"]
    assert first["throughput_ratio"] == pytest.approx(2.0, rel=1e-12)  # measured half the hand-computed rate
    # the two requests' gaps are the two decode forwards, mean (d1 + d2) / 2, against 1 ms under the old key
    assert first["itl_ratio"] == pytest.approx(1e3 * (0.542 + 0.544) / 2, rel=1e-12)
    assert "no cached_prompt_tokens" in first["explanation"][0]
    assert second["throughput_ratio"] == pytest.approx(1.0, rel=1e-9)
    assert second["itl_ratio"] == pytest.approx(1.0, rel=1e-9)
    # 8 of each 10-token prompt cached: one 4-token prefill, then the same decodes
    assert third["throughput_ratio"] == pytest.approx(1.0, rel=1e-12) and third["itl_ratio"] == pytest.approx(1.0)
    assert third["explanation"] == [f"duration {CACHED_8:.2f} s predicted, {CACHED_8:.2f} s measured (+0.00 s): "
                                    "within 5%"]
    assert "pp2 d0 p1=1 p2=0" in out


CACHED_8 = (1.0 + 4 * 0.1) + (0.5 + 2 * 0.01 + 22 * 0.001) + (0.5 + 2 * 0.01 + 24 * 0.001)


@pytest.mark.parametrize("early,grouped", list(itertools.product((True, False), repeat=2)))
def test_validate_simulates_pipeline_loops_forms(early, grouped):
    costs = {"prefill_a_s": 0.0, "prefill_b_s_per_token": [1e-3, 2e-3], "decode_c_s": 0.0,
             "decode_d_s_per_req": [1e-3, 3e-3], "decode_e_s_per_kv_token": 0.0, "sched_s": 1e-4, "process_s": 2e-4,
             "link_latency_s": 1e-4, "link_bytes_per_s": 1e9, "hidden_size": 1024}
    run = {"pp": 2, "depth": 0, "early_output_send": early, "grouped_sends": grouped, "num_requests": 4,
           "input_len": 32, "output_len": 4, "max_running_requests": 4, "cached_prompt_tokens": 31,
           "measured": {}, "stage_costs": costs}
    cfg, reqs = run_config_from_json(run)
    # the executor posts point 1's send (never the CPU waiting for the forward), and the proxy with point 2
    assert (cfg.early_output_send, cfg.grouped_sends, cfg.early_send_blocking) == (early, grouped, False)
    assert cfg.stream_ordered_proxy == grouped
    assert cfg.chunk_size == 2048  # tokenloom's --chunked-prefill-size default
    assert cfg.stages == (StageCost(b=1e-3, d=1e-3), StageCost(b=2e-3, d=3e-3))
    assert [r.input_len - r.prefilled for r in reqs] == [1] * 4
    cfg, _ = run_config_from_json({**run, "early_send_blocking": True, "stream_ordered_proxy": not grouped})
    assert cfg.early_send_blocking and cfg.stream_ordered_proxy == (not grouped)


def test_the_gap_is_split_into_the_itl_and_the_rest():
    # pp=1, no cache, chunk 100: predicted 4.086 s (TOGETHER) and a mean ITL of 543 ms. Measured 1 s longer with
    # a mean ITL 300 ms longer: 2 decode steps x 0.3 s from the ITL, 0.4 s outside the decode span.
    cfg = SimConfig(stages=(COST,), max_running_requests=2, chunk_size=100)
    predicted = simulate(cfg, [Req(0.0, 10, 3), Req(0.0, 10, 3)])
    run = {"num_requests": 2, "output_len": 3, "max_running_requests": 2, "cached_prompt_tokens": 0,
           "measured": {"output_throughput": 6 / (TOGETHER + 1.0), "itl_ms_median": 1e3 * 0.543 + 300,
                        "bubble_fraction": [0.1]}}
    (line,) = explain_gap(run, cfg, predicted)
    assert line == (f"duration {TOGETHER:.2f} s predicted, {TOGETHER + 1:.2f} s measured (+1.00 s): +0.60 s from the "
                    "ITL (2 x +300.0 ms = +300.0 ms per iteration, 1 per token; scheduler CPU 0.0 ms per iteration), "
                    "+0.40 s outside the decode span; every stage idles more than predicted")
