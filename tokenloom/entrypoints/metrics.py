"""GET /metrics (`--enable-metrics`, as in SGLang): Prometheus text of the TokenizerManager's request metrics
(tokenloom/frontend/request_metrics.py) and of gauges read from the scheduler's internal state at scrape time,
every series labelled `model_name` (the served model name), under SGLang's metric names — so SGLang's Grafana
dashboard (examples/monitoring in SGLang) and other SGLang scrapers work against tokenloom unchanged.

Names: only SGLang's. The `tokenloom:`-prefixed names of earlier versions are gone rather than kept as
duplicates: every figure they had has an SGLang name here, and one name per figure keeps dashboards and
alerts from silently mixing the two.

From the scheduler's state (each gauge is the value at this scrape; counters count since the server started):
`num_running_reqs`, `num_queue_reqs`, `num_used_tokens` (KV slots held by requests), `max_total_num_tokens`,
`token_usage` (their ratio), `gen_throughput` (tokens/s over the last decode log interval), `cache_hit_rate`
(share of prefill tokens served from the prefix cache, since start), the counter `num_retracted_requests_total`,
and on a disaggregated server SGLang's PD queue gauges and `num_transfer_failed_reqs_total`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from tokenloom.frontend.request_metrics import ServingMetrics

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # what generate_latest writes (also /v1/loads')

# (SGLang name, key in the scheduler state, help); a key missing from the state (e.g. PD-only) is left out.
_GAUGES: tuple[tuple[str, str, str], ...] = (
    ("num_running_reqs", "num_running_reqs", "The number of running requests."),
    ("num_queue_reqs", "num_waiting_reqs", "The number of requests in the waiting queue."),
    ("num_used_tokens", "kv_tokens_in_use", "The number of used tokens."),
    ("max_total_num_tokens", "max_total_num_tokens", "Maximum total number of tokens in the KV cache pool."),
    ("gen_throughput", "last_gen_throughput", "The generation throughput (token/s)."),
    ("cache_hit_rate", "cache_hit_rate", "The prefix cache hit rate."),
    ("num_prefill_prealloc_queue_reqs", "num_bootstrap_reqs",
     "The number of requests in the prefill prealloc queue."),
    ("num_prefill_inflight_queue_reqs", "num_inflight_transfer_reqs",
     "The number of requests in the prefill inflight queue."),
    ("num_decode_prealloc_queue_reqs", "num_prealloc_queue_reqs",
     "The number of requests in the decode prealloc queue."),
    ("num_decode_transfer_queue_reqs", "num_transfer_queue_reqs",
     "The number of requests in the decode transfer queue."),
)
_COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("num_retracted_requests_total", "num_retracted_reqs", "Total number of retracted requests."),
    ("num_transfer_failed_reqs_total", "num_failed_transfer_reqs", "The number of transfer failed requests."),
)


def scheduler_families(state: dict[str, Any]) -> list[Metric]:
    """SGLang's scheduler gauges (and cumulative counters) from one internal-state report, unlabelled."""
    families: list[Metric] = []
    for name, key, text in _GAUGES:
        if key in state:
            families.append(GaugeMetricFamily(f"sglang:{name}", text, value=float(state[key] or 0)))
    used, capacity = state.get("kv_tokens_in_use", 0), state.get("max_total_num_tokens") or 1
    families.append(GaugeMetricFamily("sglang:token_usage", "The token usage.", value=used / capacity))
    for name, key, text in _COUNTERS:
        if key in state:
            families.append(CounterMetricFamily(f"sglang:{name}", text, value=float(state[key])))
    return families


def with_label(family: Metric, label: str, value: str) -> Metric:
    """A copy of `family` whose every sample also carries `label`=`value`."""
    labelled = Metric(family.name, family.documentation, family.type, family.unit)
    for s in family.samples:
        labelled.add_sample(s.name, {label: value, **s.labels}, s.value, s.timestamp, s.exemplar)
    return labelled


class _Families:
    """The `collect()` that `generate_latest` reads, over families already built."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self.families = list(families)

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


def render_metrics(state: dict[str, Any], serving: ServingMetrics, model_name: str) -> bytes:
    """The /metrics body: the request metrics and the scheduler's, each series labelled with the model."""
    families = [*serving.registry.collect(), *scheduler_families(state)]
    return generate_latest(_Families(with_label(f, "model_name", model_name) for f in families))  # type: ignore[arg-type]
