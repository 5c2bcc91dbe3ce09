"""What a run prints and saves: the "Serving Benchmark Result" block (SGLang's layout: labels padded to 40
characters, values 10 wide, floats with 2 decimals, 50-wide section rules) and the JSON line appended to
`--output-file`.

Additions to SGLang's block, shown only when they apply so that a clean run reads exactly like SGLang's: a
`Failed requests` row (the distinct errors are printed above the block by the runner, with their counts)
and a "Prefix Cache" section when the server reported `cached_tokens`.
"""

from __future__ import annotations

import json
import os
from typing import Any

from tokenloom.bench.metrics import BenchmarkMetrics, RequestOutput, Stats

WIDTH = 50


def _row(label: str, value: Any) -> str:
    if isinstance(value, float):
        return f"{label:<40} {value:<10.2f}"
    return f"{label:<40} {value!s:<10}"


def _title(text: str, fill: str) -> str:
    return f"{text:{fill}^{WIDTH}}"


def format_rate(request_rate: float) -> str:
    return "inf" if request_rate == float("inf") else str(request_rate)


def format_block(m: BenchmarkMetrics, backend: str, request_rate: float, max_concurrency: int | None) -> str:
    lines = [
        _title(" Serving Benchmark Result ", "="),
        _row("Backend:", backend),
        _row("Traffic request rate:", format_rate(request_rate)),
        _row("Max request concurrency:", max_concurrency if max_concurrency is not None else "not set"),
        _row("Successful requests:", m.completed),
    ]
    if m.failed:
        lines.append(_row("Failed requests:", m.failed))
    lines += [
        _row("Benchmark duration (s):", m.duration),
        _row("Total input tokens:", m.total_input),
        _row("Total input text tokens:", m.total_input_text),
        _row("Total generated tokens:", m.total_output),
        _row("Total generated tokens (retokenized):", m.total_output_retokenized),
        _row("Request throughput (req/s):", m.request_throughput),
        _row("Input token throughput (tok/s):", m.input_throughput),
        _row("Output token throughput (tok/s):", m.output_throughput),
        _row("Peak output token throughput (tok/s):", m.max_output_tokens_per_s),
        _row("Peak concurrent requests:", float(m.max_concurrent_requests)),
        _row("Total token throughput (tok/s):", m.total_throughput),
        _row("Concurrency:", m.concurrency),
        _title("End-to-End Latency", "-"),
        _row("Mean E2E Latency (ms):", m.e2e_latency.mean),
        _row("Median E2E Latency (ms):", m.e2e_latency.median),
        _row("P90 E2E Latency (ms):", m.e2e_latency.p90),
        _row("P99 E2E Latency (ms):", m.e2e_latency.p99),
        _title("Time to First Token", "-"),
        _row("Mean TTFT (ms):", m.ttft.mean),
        _row("Median TTFT (ms):", m.ttft.median),
        _row("P99 TTFT (ms):", m.ttft.p99),
        _title("Time per Output Token (excl. 1st token)", "-"),
        _row("Mean TPOT (ms):", m.tpot.mean),
        _row("Median TPOT (ms):", m.tpot.median),
        _row("P99 TPOT (ms):", m.tpot.p99),
        _title("Inter-Token Latency", "-"),
        _row("Mean ITL (ms):", m.itl.mean),
        _row("Median ITL (ms):", m.itl.median),
        _row("P95 ITL (ms):", m.itl.p95),
        _row("P99 ITL (ms):", m.itl.p99),
        _row("Max ITL (ms):", m.itl.max),
    ]
    rate = m.cache_hit_rate
    if rate is not None:
        lines += [
            _title("Prefix Cache", "-"),
            _row("Cached input tokens:", m.cached_tokens),
            _row("Cache hit rate (%):", rate * 100.0),
        ]
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def format_errors(m: BenchmarkMetrics, limit: int = 10) -> str:
    """The distinct errors of the failed requests, most frequent first, one line each."""
    if not m.failed:
        return ""
    lines = [f"{m.failed} request(s) failed:"]
    for error, count in m.errors.most_common(limit):
        lines.append(f"  [{count}x] {error}")
    if len(m.errors) > limit:
        lines.append(f"  ... and {len(m.errors) - limit} other distinct error(s)")
    return "\n".join(lines)


def _stats(prefix: str, s: Stats, keys: tuple[str, ...]) -> dict[str, float]:
    return {f"{k}_{prefix}_ms": getattr(s, k) for k in keys}


def result_dict(m: BenchmarkMetrics, args: Any, server_info: dict[str, Any] | None,
                outputs: list[RequestOutput] | None = None) -> dict[str, Any]:
    """The JSON object of one run; with `outputs`, the per-request arrays of `--output-details` too."""
    request_rate = args.request_rate
    result: dict[str, Any] = {
        "tag": getattr(args, "tag", None),
        "backend": args.backend,
        "dataset_name": args.dataset_name,
        "request_rate": "inf" if request_rate == float("inf") else request_rate,
        "max_concurrency": args.max_concurrency,
        "num_prompts": args.num_prompts,
        "random_input_len": args.random_input_len,
        "random_output_len": args.random_output_len,
        "random_range_ratio": args.random_range_ratio,
        "sharegpt_output_len": args.sharegpt_output_len,
        "server_info": server_info,
        "duration": m.duration,
        "completed": m.completed,
        "failed": m.failed,
        "error_counts": dict(m.errors),
        "total_input_tokens": m.total_input,
        "total_input_text_tokens": m.total_input_text,
        "total_output_tokens": m.total_output,
        "total_output_tokens_retokenized": m.total_output_retokenized,
        "request_throughput": m.request_throughput,
        "input_throughput": m.input_throughput,
        "output_throughput": m.output_throughput,
        "max_output_tokens_per_s": m.max_output_tokens_per_s,
        "max_concurrent_requests": m.max_concurrent_requests,
        "total_throughput": m.total_throughput,
        "concurrency": m.concurrency,
        **_stats("e2e_latency", m.e2e_latency, ("mean", "median", "std", "p90", "p99")),
        **_stats("ttft", m.ttft, ("mean", "median", "std", "p90", "p99")),
        **_stats("tpot", m.tpot, ("mean", "median", "std", "p90", "p99")),
        **_stats("itl", m.itl, ("mean", "median", "std", "p90", "p95", "p99", "max")),
        "cached_tokens": m.cached_tokens,
        "cache_hit_rate": m.cache_hit_rate,
        "args": {k: (v if v != float("inf") else "inf") for k, v in vars(args).items()},
    }
    if outputs is not None:
        result.update({
            "input_lens": [o.prompt_len for o in outputs],
            "output_lens": [o.output_len for o in outputs],
            "ttfts": [o.ttft for o in outputs],
            "itls": [o.itl for o in outputs],
            "generated_texts": [o.generated_text for o in outputs],
            "errors": [o.error for o in outputs],
        })
    return result


def default_output_file(args: Any, month_day: str) -> str:
    """SGLang's default name: `{backend}_{MMDD}_{num_prompts}_{in}_{out}.jsonl` for random datasets."""
    if args.dataset_name.startswith("random"):
        return f"{args.backend}_{month_day}_{args.num_prompts}_{args.random_input_len}_{args.random_output_len}.jsonl"
    return f"{args.backend}_{month_day}_{args.dataset_name}.jsonl"


def append_json_line(path: str, result: dict[str, Any]) -> None:
    folder = os.path.dirname(path)
    if folder:
        os.makedirs(folder, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(result) + "\n")
