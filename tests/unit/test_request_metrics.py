"""The request metrics (frontend/request_metrics.py) fed outputs with known times, and the /metrics text
(entrypoints/metrics.py) parsed back with prometheus_client's own parser."""

from __future__ import annotations

import math

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tokenloom.entrypoints.metrics import render_metrics
from tokenloom.frontend.request_metrics import ServingMetrics


def out(tokens: int, finish: dict | None = None, **meta) -> dict:
    return {"text": "", "output_ids": list(range(tokens)), "meta_info": {"finish_reason": finish, **meta}}


def value(m: ServingMetrics, name: str, **labels) -> float:
    return m.registry.get_sample_value(name, labels) or 0.0


def timer(m: ServingMetrics, rid: str, stream: bool, sent: float = 0.0, sent_wall: float = 1000.0):
    t = m.track(rid, stream)
    t.sent, t.sent_wall = sent, sent_wall
    return t


LENGTH = {"type": "length", "length": 5}
FINAL = {"prompt_tokens": 7, "completion_tokens": 5, "cached_tokens": 3, "queue_time": 0.25}


def test_streaming_request_histograms_from_output_arrivals():
    m = ServingMetrics()
    t = timer(m, "r1", stream=True)
    t.on_output(out(0), now=0.2)  # e.g. prompt logprobs alone: no token yet
    t.on_output(out(1), now=0.5)
    t.on_output(out(2), now=0.6)
    t.on_output(out(4), now=0.9)  # two tokens in one output: two observations of 0.15
    t.on_output(out(5, LENGTH, **FINAL), now=1.0)
    assert value(m, "sglang:time_to_first_token_seconds_count") == 1
    assert value(m, "sglang:time_to_first_token_seconds_sum") == pytest.approx(0.5)
    assert value(m, "sglang:time_to_first_token_seconds_bucket", le="0.4") == 0
    assert value(m, "sglang:time_to_first_token_seconds_bucket", le="0.6") == 1
    assert value(m, "sglang:inter_token_latency_seconds_count") == 4  # 5 tokens: 4 gaps
    assert value(m, "sglang:inter_token_latency_seconds_sum") == pytest.approx(0.5)  # last token - first token
    assert value(m, "sglang:inter_token_latency_seconds_bucket", le="0.1") == 2  # 0.1, 0.1
    assert value(m, "sglang:inter_token_latency_seconds_bucket", le="0.2") == 4  # and 0.15 twice
    assert value(m, "sglang:time_per_output_token_seconds_sum") == pytest.approx((1.0 - 0.5) / 4)
    assert value(m, "sglang:e2e_request_latency_seconds_sum") == pytest.approx(1.0)
    assert value(m, "sglang:queue_time_seconds_sum") == pytest.approx(0.25)
    assert value(m, "sglang:queue_time_seconds_bucket", le="0.2") == 0
    assert value(m, "sglang:queue_time_seconds_bucket", le="0.5") == 1
    assert (value(m, "sglang:num_requests_total"), value(m, "sglang:num_aborted_requests_total")) == (1, 0)
    assert (value(m, "sglang:prompt_tokens_total"), value(m, "sglang:generation_tokens_total"),
            value(m, "sglang:cached_tokens_total")) == (7, 5, 3)


def test_non_streaming_first_token_time_comes_from_the_scheduler():
    m = ServingMetrics()
    t = timer(m, "r2", stream=False, sent=10.0, sent_wall=1000.0)
    t.on_output(out(3, LENGTH, prompt_tokens=4, completion_tokens=3, prefill_finished_ts=1000.5), now=12.0)
    assert value(m, "sglang:time_to_first_token_seconds_sum") == pytest.approx(0.5)
    assert value(m, "sglang:time_per_output_token_seconds_sum") == pytest.approx((12.0 - 10.5) / 2)
    assert value(m, "sglang:e2e_request_latency_seconds_sum") == pytest.approx(2.0)
    assert value(m, "sglang:inter_token_latency_seconds_count") == 0  # its per-token gaps are not known here
    assert value(m, "sglang:queue_time_seconds_count") == 0  # none reported


def test_request_without_tokens_has_no_ttft_or_tpot():
    m = ServingMetrics()
    for stream in (False, True):
        timer(m, f"s{stream}", stream).on_output(out(0, {"type": "length", "length": 0}, prompt_tokens=4), now=1.0)
    timer(m, "one", True).on_output(out(1, LENGTH, completion_tokens=1), now=1.0)  # 1 token: TTFT, no TPOT
    assert value(m, "sglang:num_requests_total") == 3 and value(m, "sglang:e2e_request_latency_seconds_count") == 3
    assert value(m, "sglang:time_to_first_token_seconds_count") == 1
    assert value(m, "sglang:time_per_output_token_seconds_count") == 0


def test_aborts_and_abandoned_requests():
    m = ServingMetrics()
    abort = {"type": "abort", "message": "The request queue is full.", "status_code": 503}
    timer(m, "full", False).on_output(out(0, abort, prompt_tokens=4), now=0.01)
    gone = timer(m, "gone", True)
    gone.on_output(out(1), now=0.5)
    gone.on_abandoned()
    gone.on_abandoned()
    gone.on_output(out(2, LENGTH, prompt_tokens=4, completion_tokens=2), now=1.0)  # after closing: ignored
    assert (value(m, "sglang:num_requests_total"), value(m, "sglang:num_aborted_requests_total")) == (2, 2)
    assert value(m, "sglang:prompt_tokens_total") == 4  # the refused one's; the abandoned one reports none
    assert value(m, "sglang:e2e_request_latency_seconds_count") == 1
    assert value(m, "sglang:time_to_first_token_seconds_count") == 1  # the abandoned stream's first token


@pytest.mark.parametrize("rid", ["HEALTH_CHECK_0123abcd", "WARMUP_0123abcd"])
def test_health_probes_and_warm_up_are_not_measured(rid):
    m = ServingMetrics()
    for stream in (False, True):
        t = timer(m, rid, stream)
        t.on_output(out(1), now=0.1)
        t.on_output(out(2, LENGTH, **FINAL, prefill_finished_ts=1000.1), now=0.2)
        timer(m, rid, stream).on_abandoned()
    samples = [s for f in m.registry.collect() for s in f.samples if not s.name.endswith("_created")]
    assert samples and all(s.value == 0 for s in samples)


SGLANG_TTFT_BOUNDS = [0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400]
SGLANG_QUEUE_BOUNDS_HEAD = [0.0, 0.1, 0.2, 0.5, 1, 2, 3, 4, 5, 10]
STATE = {"num_running_reqs": 2, "num_waiting_reqs": 1, "max_total_num_tokens": 100, "kv_tokens_in_use": 25,
         "last_gen_throughput": 12.5, "cache_hit_rate": 0.1, "num_retracted_reqs": 3}


def families(text: bytes) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text.decode())}


def sample(fams: dict, family: str, name: str, **labels) -> float:
    return next(s.value for s in fams[family].samples if s.name == name and labels.items() <= s.labels.items())


def test_metrics_text_has_sglang_names_labels_and_buckets():
    m = ServingMetrics()
    timer(m, "r", True).on_output(out(2, LENGTH, **FINAL), now=0.3)
    fams = families(render_metrics(STATE, m, 'my"model'))
    assert all(s.labels.get("model_name") == 'my"model' for f in fams.values() for s in f.samples)
    assert sample(fams, "sglang:num_running_reqs", "sglang:num_running_reqs") == 2
    assert sample(fams, "sglang:num_queue_reqs", "sglang:num_queue_reqs") == 1
    assert sample(fams, "sglang:num_used_tokens", "sglang:num_used_tokens") == 25
    assert sample(fams, "sglang:token_usage", "sglang:token_usage") == 0.25
    assert sample(fams, "sglang:gen_throughput", "sglang:gen_throughput") == 12.5
    assert sample(fams, "sglang:cache_hit_rate", "sglang:cache_hit_rate") == 0.1
    assert fams["sglang:num_retracted_requests"].type == "counter"
    assert sample(fams, "sglang:num_retracted_requests", "sglang:num_retracted_requests_total") == 3
    assert sample(fams, "sglang:num_requests", "sglang:num_requests_total") == 1
    assert fams["sglang:prompt_tokens"].type == "counter" and fams["sglang:num_aborted_requests"].type == "counter"
    for name in ("time_to_first_token", "inter_token_latency", "time_per_output_token", "e2e_request_latency",
                 "queue_time"):
        assert fams[f"sglang:{name}_seconds"].type == "histogram", name
        expected = 0 if name == "inter_token_latency" else 1  # both tokens came in one output: no gap seen
        assert sample(fams, f"sglang:{name}_seconds", f"sglang:{name}_seconds_count") == expected, name
    bounds = [float(s.labels["le"]) for s in fams["sglang:time_to_first_token_seconds"].samples
              if s.name.endswith("_bucket")]
    assert bounds == [*map(float, SGLANG_TTFT_BOUNDS), math.inf]
    queue = [float(s.labels["le"]) for s in fams["sglang:queue_time_seconds"].samples if s.name.endswith("_bucket")]
    assert queue[:10] == SGLANG_QUEUE_BOUNDS_HEAD and queue[-2:] == [3000, math.inf]
    assert not any("prealloc" in name or "transfer" in name for name in fams)  # PD gauges on PD servers only


def test_pd_gauges_and_separate_registries():
    pd = {**STATE, "num_bootstrap_reqs": 4, "num_inflight_transfer_reqs": 1, "num_failed_transfer_reqs": 2}
    first, second = ServingMetrics(), ServingMetrics()
    timer(first, "r", False).on_output(out(1, LENGTH, completion_tokens=1), now=0.1)
    fams = families(render_metrics(pd, first, "m"))
    assert sample(fams, "sglang:num_prefill_prealloc_queue_reqs", "sglang:num_prefill_prealloc_queue_reqs") == 4
    assert sample(fams, "sglang:num_prefill_inflight_queue_reqs", "sglang:num_prefill_inflight_queue_reqs") == 1
    assert sample(fams, "sglang:num_transfer_failed_reqs", "sglang:num_transfer_failed_reqs_total") == 2
    assert value(first, "sglang:num_requests_total") == 1 and value(second, "sglang:num_requests_total") == 0


def test_a_server_without_enable_metrics_measures_nothing():
    """As SGLang, the tokenizer-side histograms are only kept with --enable-metrics: without it every timer is
    inert (a streamed token pays for no histogram) and the registry stays at zero."""
    on, off = ServingMetrics(), ServingMetrics(enabled=False)
    for m in (on, off):
        t = timer(m, "r", True)
        t.on_output(out(1), now=0.1)
        t.on_output(out(2), now=0.2)
        t.on_output(out(3, LENGTH, completion_tokens=3), now=0.3)
        timer(m, "gone", True).on_abandoned()
    assert value(on, "sglang:num_requests_total") == 2 and value(on, "sglang:num_aborted_requests_total") == 1
    assert value(on, "sglang:inter_token_latency_seconds_count") == 2
    assert value(off, "sglang:num_requests_total") == 0 and value(off, "sglang:num_aborted_requests_total") == 0
    assert value(off, "sglang:inter_token_latency_seconds_count") == 0
    assert value(off, "sglang:time_to_first_token_seconds_count") == 0
