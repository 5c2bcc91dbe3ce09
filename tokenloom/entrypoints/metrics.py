"""Prometheus text exposition for GET /metrics (`--enable-metrics`): request/token counters kept by the
TokenizerManager and gauges from the scheduler's internal state, with SGLang's metric names under a
`tokenloom:` prefix."""

from __future__ import annotations

from typing import Any

from tokenloom.frontend.tokenizer_manager import ServingCounters

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# (metric name, key in the scheduler state / counter attribute, help)
_GAUGES: tuple[tuple[str, str, str], ...] = (
    ("num_running_reqs", "num_running_reqs", "Requests being decoded or prefilled."),
    ("num_queue_reqs", "num_waiting_reqs", "Requests waiting to be scheduled."),
    ("max_total_num_tokens", "max_total_num_tokens", "KV cache capacity in tokens."),
    ("kv_tokens_in_use", "kv_tokens_in_use", "KV slots held by running requests."),
    ("gen_throughput", "last_gen_throughput", "Recent generation throughput (tokens/s)."),
    ("cache_hit_rate", "cache_hit_rate", "Share of prefill tokens served from the prefix cache."),
)
_COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("num_requests_total", "num_requests", "Finished requests."),
    ("num_aborted_requests_total", "num_aborted", "Requests that finished by abort."),
    ("prompt_tokens_total", "prompt_tokens", "Prompt tokens of finished requests."),
    ("generation_tokens_total", "generation_tokens", "Generated tokens of finished requests."),
    ("cached_tokens_total", "cached_tokens", "Prompt tokens served from the prefix cache."),
)


def render_metrics(state: dict[str, Any], counters: ServingCounters, model_name: str) -> str:
    label = '{model_name="' + model_name.replace("\\", "\\\\").replace('"', '\\"') + '"}'
    lines = []
    used = state.get("kv_tokens_in_use", 0)
    capacity = state.get("max_total_num_tokens") or 1
    gauges = [(name, state.get(key, 0), text) for name, key, text in _GAUGES]
    gauges.append(("token_usage", used / capacity, "Share of the KV cache held by running requests."))
    for name, value, text in gauges:
        lines += [f"# HELP tokenloom:{name} {text}", f"# TYPE tokenloom:{name} gauge",
                  f"tokenloom:{name}{label} {float(value or 0)}"]
    for name, attr, text in _COUNTERS:
        lines += [f"# HELP tokenloom:{name} {text}", f"# TYPE tokenloom:{name} counter",
                  f"tokenloom:{name}{label} {float(getattr(counters, attr))}"]
    lines += ["# HELP tokenloom:e2e_request_latency_seconds End-to-end latency of finished requests.",
              "# TYPE tokenloom:e2e_request_latency_seconds summary",
              f"tokenloom:e2e_request_latency_seconds_sum{label} {float(counters.e2e_latency_sum)}",
              f"tokenloom:e2e_request_latency_seconds_count{label} {float(counters.num_requests)}"]
    return "\n".join(lines) + "\n"
