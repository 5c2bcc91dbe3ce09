"""bench/disagg.py part (1): the runs of one request (checked against addresses computed by hand from the
pool shape), the argument rules, and a `--quick` run end to end with the fake engine (two processes).
Part (2), `--mode serve` (bench/disagg_serve.py): its argument rules and its pure aggregation and reporting
functions against hand-computed figures; nothing here starts a server."""

from __future__ import annotations

import json
import os

import pytest

from bench.disagg import bytes_per_token, main, parse_args, pool_layout, request_runs
from bench.disagg_serve import (
    counter_deltas,
    format_counters,
    format_table,
    median_over_rounds,
    pd_problems,
    summarize,
    workload_kinds,
)
from tokenloom.bench.metrics import RequestOutput

ROW = 64 * 2  # bytes of one token slot of one (layer, K/V, head)


def test_one_run_per_layer_kv_head_at_hand_computed_addresses():
    rows, tokens = 100, 37
    src, dst = pool_layout(10_000_000, rows), pool_layout(90_000_000, rows)
    runs = request_runs(src, dst, tokens)
    expected = [(10_000_000 + piece * rows * ROW + 1 * ROW, 90_000_000 + piece * rows * ROW + 7 * ROW, tokens * ROW)
                for piece in range(30 * 2 * 3)]  # piece = (layer * 2 + kv) * 3 + head
    assert runs == expected
    assert bytes_per_token() == 23040 and sum(n for _, _, n in runs) == tokens * 23040


def test_arguments():
    ns = parse_args([])
    assert ns.backends == ["mooncake", "nixl"] and ns.tokens == [1024, 4096, 16384, 32768] and ns.repeats == 3
    ns = parse_args(["--quick"])
    assert ns.tokens == [256] and ns.repeats == 1
    ns = parse_args(["--backends", "nixl,fake", "--tokens", "8,16", "--repeats", "5"])
    assert ns.backends == ["nixl", "fake"] and ns.tokens == [8, 16] and ns.repeats == 5
    for bad in (["--repeats", "2"], ["--backends", "rdma"], ["--tokens", "0"], ["--tokens", "a,b"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_quick_fake_run_writes_its_json(tmp_path, capsys):
    out = tmp_path / "disagg.json"
    report = main(["--quick", "--backends", "fake", "--json-out", str(out)])
    assert json.loads(out.read_text()) == report
    (row,) = report["rows"]
    assert row["backend"] == "fake" and row["tokens"] == 256 and row["runs"] == 180
    assert row["bytes"] == 256 * 23040 and row["verified"] is None and row["memcpy_gbps"] > 0
    assert "fake" in capsys.readouterr().out


# --- part (2), `--mode serve`: argument rules and the pure aggregation / reporting functions (no servers) ---

def test_transfer_is_the_default_mode():
    assert parse_args([]).mode == "transfer" and parse_args(["--mode", "transfer", "--quick"]).tokens == [256]
    with pytest.raises(SystemExit):
        parse_args(["--mode", "both"])


def test_serve_arguments():
    ns = parse_args(["--mode", "serve"])
    assert ns.mode == "serve" and ns.backend == "mooncake" and ns.rounds == 3 and not ns.quick and ns.model is None
    assert (ns.num_requests, ns.long_every, ns.short_input_len, ns.short_output_len, ns.long_input_len,
            ns.long_output_len, ns.request_rate) == (24, 6, 64, 128, 1024, 16, 1.0)
    assert ns.dtype == "bfloat16" and ns.unified_threads == (os.cpu_count() or 1)
    assert ns.pd_threads == max(1, (os.cpu_count() or 1) // 2)
    ns = parse_args(["--mode", "serve", "--quick", "--backend", "nixl", "--num-requests", "7"])
    assert ns.quick and ns.backend == "nixl" and ns.rounds == 1 and ns.num_requests == 7  # explicit wins
    assert (ns.long_every, ns.short_output_len, ns.long_input_len, ns.request_rate) == (5, 32, 512, 4.0)
    ns = parse_args(["--mode", "serve", "--rounds", "5", "--pd-threads", "2", "--json-out", "x.json"])
    assert ns.rounds == 5 and ns.pd_threads == 2 and ns.json_out == "x.json"
    for bad in (["--rounds", "2"], ["--backend", "fake"], ["--long-every", "1"], ["--long-every", "25"],
                ["--request-rate", "0"], ["--num-requests", "0"], ["--pd-threads", "0"], ["--backends", "nixl"]):
        with pytest.raises(SystemExit):
            parse_args(["--mode", "serve", *bad])


def test_every_nth_request_is_long():
    assert workload_kinds(12, 6) == ["short"] * 5 + ["long"] + ["short"] * 5 + ["long"]
    assert workload_kinds(5, 2) == ["short", "long", "short", "long", "short"]


def _out(ttft: float, itl: list[float], start: float = 0.0) -> RequestOutput:
    latency = ttft + sum(itl)
    return RequestOutput(success=True, prompt_len=8, output_len=len(itl) + 1, ttft=ttft, latency=latency, itl=itl,
                         start_time=start, token_times=[start + latency] * (len(itl) + 1))


def test_summarize_splits_the_kinds_and_takes_linear_percentiles():
    outs = [_out(0.1, [0.01] * 9), _out(0.2, [0.02] * 9), _out(0.3, [0.01] * 8 + [1.0]), _out(2.0, [0.05])]
    failed = RequestOutput(success=False, error="HTTP 500: boom")
    s = summarize([*outs, failed], ["short", "short", "short", "long", "short"], duration=10.0)
    short, long, every = s["short"], s["long"], s["all"]
    assert (short["completed"], short["failed"], long["completed"], every["failed"]) == (3, 1, 1, 1)
    # TTFTs 100, 200, 300 ms: the p-th percentile interpolates linearly between order statistics
    assert short["ttft_p50_ms"] == pytest.approx(200) and short["ttft_p90_ms"] == pytest.approx(280)
    assert short["ttft_p99_ms"] == pytest.approx(298)
    # with the long one's 2000 ms: ranks 1.5, 2.7, 2.97 of [100, 200, 300, 2000]
    assert every["ttft_p50_ms"] == pytest.approx(250) and every["ttft_p90_ms"] == pytest.approx(300 + 0.7 * 1700)
    assert every["ttft_p99_ms"] == pytest.approx(300 + 0.97 * 1700)
    # 27 short gaps: 17 of 10 ms, 9 of 20 ms, one stall of 1000 ms (rank 25.74 is between 20 and 1000)
    assert short["itl_p50_ms"] == pytest.approx(10) and short["itl_p90_ms"] == pytest.approx(20)
    assert short["itl_p99_ms"] == pytest.approx(20 + 0.74 * 980)
    assert long["itl_p50_ms"] == pytest.approx(50)
    assert short["output_tok_s"] == pytest.approx(30 / 10) and long["output_tok_s"] == pytest.approx(2 / 10)
    assert every["output_tok_s"] == pytest.approx(short["output_tok_s"] + long["output_tok_s"])
    assert short["tpot_p50_ms"] == pytest.approx((0.2 + 9 * 0.02 - 0.2) / 9 * 1000)


def test_counter_deltas():
    before = {"num_transferred_reqs": 3, "num_failed_transfer_reqs": 1, "decode_steps": 10, "decode_tokens": 40,
              "decode_period_s": 1.0, "forward_busy_s": 5.0, "num_running_reqs": 0}
    after = {"num_transferred_reqs": 27, "num_failed_transfer_reqs": 1, "decode_steps": 110, "decode_tokens": 840,
             "decode_period_s": 4.0, "forward_busy_s": 11.0, "num_running_reqs": 0}
    d = counter_deltas(before, after, wall_s=20.0)
    assert d == {"num_transferred_reqs": 24, "num_failed_transfer_reqs": 0, "decode_steps": 100,
                 "decode_tokens": 800, "decode_step_ms": pytest.approx(30.0), "decode_batch": 8.0,
                 "forward_busy": pytest.approx(0.3)}
    prefill = counter_deltas({"decode_steps": 0, "decode_period_s": 0.0}, {"decode_steps": 0, "decode_period_s": 0.0},
                             wall_s=1.0)
    assert prefill == {"decode_steps": 0}  # no steps: no period or batch to report


def test_median_over_rounds_is_element_wise():
    runs = [{"pd": {"x": 1, "y": 9.0}, "name": "a", "ok": True}, {"pd": {"x": 5, "y": 1.0}, "name": "b", "ok": False},
            {"pd": {"x": 3, "y": 4.0}, "name": "c", "ok": False}]
    assert median_over_rounds(runs) == {"pd": {"x": 3, "y": 4.0}, "name": "a", "ok": True}
    assert median_over_rounds([{"x": 1.0}, {"x": 2.0}]) == {"x": 1.5}


def test_pd_problems_name_what_is_missing():
    good = {"prefill": {"num_transferred_reqs": 24, "num_failed_transfer_reqs": 0},
            "decode": {"num_received_reqs": 24, "num_failed_transfer_reqs": 0}}
    assert pd_problems(good, 24) == []
    bad = {"prefill": {"num_transferred_reqs": 23, "num_failed_transfer_reqs": 1},
           "decode": {"num_received_reqs": 22, "num_failed_transfer_reqs": 2}}
    assert pd_problems(bad, 24) == ["prefill transferred 23 of 24 requests", "decode received 22 of 24 requests",
                                    "prefill: 1 failed transfers", "decode: 2 failed transfers"]


def test_table_rows_and_ratios():
    keys = ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p90_ms", "itl_p99_ms", "tpot_p50_ms")

    def fig(scale: float, tok_s: float) -> dict:
        return {**{k: scale * (i + 1) for i, k in enumerate(keys)}, "output_tok_s": tok_s, "completed": 20,
                "failed": 0}

    summary = {"unified": {k: fig(100.0, 50.0) for k in ("all", "short", "long")},
               "pd": {k: fig(50.0, 75.0) for k in ("all", "short", "long")}}
    lines = format_table(summary).splitlines()
    assert len(lines) == 1 + 3 * 3
    pd_all = next(line for line in lines if line.split()[:2] == ["all", "pd"]).split()
    assert pd_all[2:] == ["50.0", "100.0", "150.0", "200.0", "250.0", "300.0", "350.0", "75.0", "20/0"]
    ratios = next(line for line in lines if line.split()[:2] == ["long", "pd/uni"]).split()
    assert ratios[2:] == ["0.50x"] * 7 + ["1.50x"]
    text = format_counters("decode", {"num_received_reqs": 24, "decode_steps": 100, "decode_step_ms": 30.0,
                                      "decode_batch": 8.0, "forward_busy": 0.3, "cpu_cores": 0.75})
    assert "received 24" in text and "mean decode period 30.0 ms, batch 8.0" in text and "busy 30%" in text
