"""Per-request serving metrics, kept by the TokenizerManager on `prometheus_client` objects with SGLang's names
(sglang/srt/metrics/collector.py, `TokenizerMetricsCollector`) and bucket boundaries, so SGLang's Grafana
dashboards and scrapers read them unchanged. `/metrics` renders them with the scheduler's gauges
(tokenloom/entrypoints/metrics.py), which adds the `model_name` label.

Each `ServingMetrics` has its own `CollectorRegistry` (never the process-global one), so several engines or apps
in one process keep separate figures.

Lifecycle of one request: `track(rid, stream)` when it is sent (its `RequestTimer` remembers the send time),
`on_output` for every output the caller receives, then either the final output (it carries a finish reason)
or `on_abandoned` (the caller went away first) closes it; a closed timer ignores anything after. All of one
request's calls come from the caller's event loop, in order. Requests whose rid starts with `HEALTH_CHECK_`
(the /health probe) or `WARMUP_` (the start-up warm-up) are not measured at all, nor is anything on a server
without --enable-metrics (`ServingMetrics(enabled=False)`).

What is measured (times on the TokenizerManager's clock, from the send):
- counters at the finish: requests (`num_requests_total`), aborted requests (finish reason `abort`, or the
  caller gone: `num_aborted_requests_total`), and the prompt / generated / cached tokens the final output
  reports (a request whose caller went away counts as a request and an abort, with no tokens);
- `time_to_first_token_seconds`: a streaming request's first output with a token; a non-streaming request
  gets only its final output, so its first token's time is the scheduler's `prefill_finished_ts` (wall clock,
  in meta_info) — no TTFT when there is none (no token was generated);
- `inter_token_latency_seconds` (streaming requests only): each later output with k new tokens adds k
  observations of gap / k (SGLang's accounting: the sum grows by the gap, the count by k). A non-streaming
  request's per-token gaps never reach the TokenizerManager, so it adds none rather than made-up ones;
- at the finish: `e2e_request_latency_seconds`; `time_per_output_token_seconds` = (last token - first token)
  / (tokens - 1) for requests with at least 2 tokens; `queue_time_seconds` from meta_info's `queue_time`
  (the scheduler: receipt to first admission into a prefill batch; absent when the request never was).
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from tokenloom.protocol import HEALTH_CHECK_RID_PREFIX, WARMUP_RID_PREFIX

UNMETERED_RID_PREFIXES = (HEALTH_CHECK_RID_PREFIX, WARMUP_RID_PREFIX)  # the HTTP server's own requests

# SGLang's default boundaries (sglang/srt/metrics/collector.py). TPOT's are those of the SGLang releases that
# still had `time_per_output_token_seconds` (later replaced by the inter-token latency histogram).
TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
ITL_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060, 0.080,
               0.100, 0.200, 0.400, 0.600, 0.800, 1.0, 2.0, 4.0, 6.0, 8.0)
TPOT_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                0.75, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600, 1200, 1800, 2400)
QUEUE_TIME_BUCKETS = (0.0, 0.1, 0.2, 0.5, 1, 2, 3, 4, 5, 10, 15, 20, 30, 40, 50, 60, 70, 80, 90, 100, 200, 300,
                      400, 500, 600, 700, 800, 900, 1000, 1200, 1400, 1600, 1800, 2000, 2500, 3000)


def is_metered(rid: str) -> bool:
    return not rid.startswith(UNMETERED_RID_PREFIXES)


class ServingMetrics:
    """The request counters and latency histograms of one TokenizerManager, in its own registry."""

    def __init__(self, enabled: bool = True) -> None:
        """`enabled` False (a server without --enable-metrics, as SGLang collects only with it): every timer is
        inert, and a streamed token pays for no histogram."""
        self.enabled = enabled
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.prompt_tokens = Counter("sglang:prompt_tokens_total", "Number of prefill tokens processed.", registry=r)
        self.generation_tokens = Counter("sglang:generation_tokens_total", "Number of generation tokens processed.",
                                         registry=r)
        self.cached_tokens = Counter("sglang:cached_tokens_total", "Number of cached prompt tokens.", registry=r)
        self.requests = Counter("sglang:num_requests_total", "Number of requests processed.", registry=r)
        self.aborted_requests = Counter("sglang:num_aborted_requests_total", "Number of requests aborted.",
                                        registry=r)
        self.time_to_first_token = Histogram("sglang:time_to_first_token_seconds",
                                             "Histogram of time to first token in seconds.",
                                             buckets=TTFT_BUCKETS, registry=r)
        self.inter_token_latency = Histogram("sglang:inter_token_latency_seconds",
                                             "Histogram of inter-token latency in seconds.",
                                             buckets=ITL_BUCKETS, registry=r)
        self.time_per_output_token = Histogram("sglang:time_per_output_token_seconds",
                                               "Histogram of time per output token in seconds.",
                                               buckets=TPOT_BUCKETS, registry=r)
        self.e2e_request_latency = Histogram("sglang:e2e_request_latency_seconds",
                                             "Histogram of End-to-end request latency in seconds",
                                             buckets=E2E_BUCKETS, registry=r)
        self.queue_time = Histogram("sglang:queue_time_seconds", "Histogram of queueing time in seconds.",
                                    buckets=QUEUE_TIME_BUCKETS, registry=r)

    def track(self, rid: str, stream: bool) -> RequestTimer:
        """A timer for one request, started now (call it when the request is sent)."""
        return RequestTimer(self if self.enabled and is_metered(rid) else None, stream)


class RequestTimer:
    """One request's timing (see the module docstring); inert when `metrics` is None (unmetered rid)."""

    __slots__ = ("metrics", "stream", "sent", "sent_wall", "first_token", "last_token", "tokens", "closed")

    def __init__(self, metrics: ServingMetrics | None, stream: bool) -> None:
        self.metrics = metrics
        self.stream = stream
        self.sent = time.perf_counter()
        self.sent_wall = time.time()
        self.first_token: float | None = None  # perf_counter() of the first token's arrival
        self.last_token: float | None = None  # ... and of the latest output that brought new tokens
        self.tokens = 0  # output tokens received so far
        self.closed = metrics is None

    def on_output(self, out: dict[str, Any], now: float | None = None) -> None:
        """One output as the caller receives it (`output_ids`: every token so far; `meta_info`)."""
        if self.closed:
            return
        m = self.metrics
        now = time.perf_counter() if now is None else now
        meta = out["meta_info"]
        tokens = len(out["output_ids"])
        if tokens > self.tokens:
            if self.first_token is not None:
                new = tokens - self.tokens
                for _ in range(new):
                    m.inter_token_latency.observe((now - self.last_token) / new)
            elif self.stream:
                self.first_token = now
                m.time_to_first_token.observe(now - self.sent)
            self.last_token, self.tokens = now, tokens
        if meta["finish_reason"] is not None:
            self._finish(meta, now)

    def _finish(self, meta: dict[str, Any], now: float) -> None:
        m = self.metrics
        self.closed = True
        if self.first_token is None and meta.get("prefill_finished_ts") is not None:  # non-streaming
            offset = min(max(meta["prefill_finished_ts"] - self.sent_wall, 0.0), now - self.sent)
            self.first_token = self.sent + offset
            m.time_to_first_token.observe(offset)
        m.requests.inc()
        if meta["finish_reason"].get("type") == "abort":
            m.aborted_requests.inc()
        m.prompt_tokens.inc(meta.get("prompt_tokens", 0))
        m.generation_tokens.inc(meta.get("completion_tokens", 0))
        m.cached_tokens.inc(meta.get("cached_tokens", 0))
        m.e2e_request_latency.observe(now - self.sent)
        if self.tokens >= 2 and self.first_token is not None:
            m.time_per_output_token.observe((self.last_token - self.first_token) / (self.tokens - 1))
        if meta.get("queue_time") is not None:
            m.queue_time.observe(meta["queue_time"])

    def on_abandoned(self) -> None:
        """The caller went away before the final output: a request and an abort, with no tokens."""
        if self.closed:
            return
        self.closed = True
        self.metrics.requests.inc()
        self.metrics.aborted_requests.inc()
