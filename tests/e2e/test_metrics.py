"""/metrics on the shared tiny server (`--enable-metrics`): after N real requests over the native and OpenAI
routes, streaming and not, with /health probes in between, the counters moved by exactly N requests and by the
tokens the responses reported, every latency histogram by N observations (inter-token latency by the gaps the
streams had), and the text parses with prometheus_client's parser under SGLang's names."""

from __future__ import annotations

import json
import math
import time
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.server_process import http

SAMPLING = {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True}
HISTOGRAMS = ("time_to_first_token", "time_per_output_token", "e2e_request_latency", "queue_time")


def scrape(url: str) -> dict[str, float]:
    """Every sample of /metrics by name (+ `le`), after checking that each carries the model_name label."""
    status, text = http("GET", url + "/metrics")
    assert status == 200, text
    values = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            assert s.labels.get("model_name"), s
            values[s.name + (f"[{s.labels['le']}]" if "le" in s.labels else "")] = s.value
    return values


def sse(text: str) -> list[dict[str, Any]]:
    events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", text
    return [json.loads(e) for e in events[:-1]]


def test_metrics_count_real_requests_and_not_health_probes(tiny_server):
    url = tiny_server.url
    tiny_server.wait_idle_and_pool_full()
    before = scrape(url)
    usages: list[tuple[int, int]] = []  # (prompt, completion) tokens of each request, as its response says
    gaps, client_time = 0, 0.0

    def timed(method: str, route: str, body: dict, requests: int = 1) -> Any:
        """The reply and the wall-clock bounds of the call; `client_time` bounds the server's e2e sum."""
        nonlocal client_time
        start = time.perf_counter(), time.time()
        status, reply = http(method, url + route, body)
        client_time += requests * (time.perf_counter() - start[0])
        assert status == 200, reply
        return reply, start[1], time.time()

    single, t0, t1 = timed("POST", "/generate", {"text": "The capital city of France is", "sampling_params": SAMPLING})
    meta = single["meta_info"]
    assert 0 <= meta["queue_time"] < t1 - t0 and t0 < meta["prefill_finished_ts"] < t1  # the scheduler's stamps
    batch, _, _ = timed("POST", "/generate", {"text": ["Once upon a time", "1, 2, 3,"], "sampling_params": SAMPLING},
                        requests=2)
    usages += [(out["meta_info"]["prompt_tokens"], len(out["output_ids"])) for out in [single, *batch]]
    assert http("GET", url + "/health")[0] == 200
    stream, _, _ = timed("POST", "/generate", {"text": "Tell me a story", "sampling_params": SAMPLING, "stream": True})
    events = sse(stream)
    final = events[-1]
    usages.append((final["meta_info"]["prompt_tokens"], len(final["output_ids"])))
    gaps += len(final["output_ids"]) - len(events[0]["output_ids"])
    assert http("GET", url + "/health")[0] == 200 and http("GET", url + "/health_generate")[0] == 200
    done, _, _ = timed("POST", "/v1/completions", {"model": "m", "prompt": "Hello", "max_tokens": 4,
                                                   "temperature": 0, "ignore_eos": True})
    usages.append((done["usage"]["prompt_tokens"], done["usage"]["completion_tokens"]))
    chat, _, _ = timed("POST", "/v1/chat/completions", {
        "model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "temperature": 0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})
    usage = sse(chat)[-1]["usage"]
    usages.append((usage["prompt_tokens"], usage["completion_tokens"]))
    gaps += usage["completion_tokens"] - 1  # a stream's first output carries exactly its first token
    assert http("GET", url + "/health")[0] == 200
    tiny_server.wait_idle_and_pool_full()
    after = scrape(url)

    def delta(name: str) -> float:
        return after[f"sglang:{name}"] - before.get(f"sglang:{name}", 0.0)

    n = len(usages)
    assert n == 6 and all(completion >= 2 for _, completion in usages)
    assert delta("num_requests_total") == n and delta("num_aborted_requests_total") == 0
    assert delta("prompt_tokens_total") == sum(p for p, _ in usages)
    assert delta("generation_tokens_total") == sum(c for _, c in usages)
    for name in HISTOGRAMS:
        assert delta(f"{name}_seconds_count") == n, name  # every request has >= 2 tokens: TPOT for each
        assert delta(f"{name}_seconds_bucket[+Inf]") == n, name
    assert delta("inter_token_latency_seconds_count") == gaps > 0
    assert 0 < delta("time_to_first_token_seconds_sum") < delta("e2e_request_latency_seconds_sum") <= client_time
    assert delta("queue_time_seconds_sum") >= 0
    assert after["sglang:num_running_reqs"] == 0 and after["sglang:num_queue_reqs"] == 0
    assert after["sglang:token_usage"] == 0 and after["sglang:max_total_num_tokens"] == 16384
    assert not any(k.startswith("tokenloom:") for k in after) and math.isfinite(after["sglang:cache_hit_rate"])
