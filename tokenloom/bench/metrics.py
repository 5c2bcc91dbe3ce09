"""Per-request measurements (`RequestOutput`, filled by the backends) and the run's aggregate metrics
(`BenchmarkMetrics`, computed by `calculate_metrics`) with SGLang `bench_serving` definitions:

- TTFT: send -> first chunk carrying text. E2E latency: send -> last line of the response read.
- ITL: the gaps between later chunks; on the native backend a chunk's gap is spread evenly over the tokens it
  carried (its `completion_tokens` delta) and chunks with no new token are skipped; on the OpenAI backends
  the raw gap between non-empty chunks.
- TPOT per request: (latency - ttft) / (output_len - 1), for requests with more than one output token.
- Concurrency: sum of E2E latencies / duration. Peak output throughput: the most tokens that arrived within
  one 1-second bucket (buckets counted from the earliest send). Peak concurrent requests: the most requests
  whose [send, end] overlaps one such bucket.
- Retokenized count: the generated texts re-encoded without special tokens.
- Cache hit rate: sum of the server's `cached_tokens` / sum of its prompt tokens, over requests reporting both.

Statistics are numpy mean / median / std / percentile (linear) in milliseconds over successful requests only;
failed requests are counted and their errors kept, never dropped silently.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class RequestOutput:
    """What one request measured. Times are seconds; `start_time` and `token_times` are `time.perf_counter()`
    values, `ttft`/`latency`/`itl` are durations."""

    success: bool = False
    prompt_len: int = 0
    output_len: int = 0
    generated_text: str = ""
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    start_time: float = 0.0
    error: str = ""
    server_prompt_tokens: int | None = None
    cached_tokens: int | None = None


@dataclass
class Stats:
    """mean/median/std/percentiles/max of one latency metric, in milliseconds."""

    mean: float = 0.0
    median: float = 0.0
    std: float = 0.0
    p90: float = 0.0
    p95: float = 0.0
    p99: float = 0.0
    max: float = 0.0

    @classmethod
    def of_seconds(cls, values: list[float]) -> Stats:
        if not values:
            return cls()
        ms = np.asarray(values, dtype=np.float64) * 1000.0
        return cls(mean=float(np.mean(ms)), median=float(np.median(ms)), std=float(np.std(ms)),
                   p90=float(np.percentile(ms, 90)), p95=float(np.percentile(ms, 95)),
                   p99=float(np.percentile(ms, 99)), max=float(np.max(ms)))


@dataclass
class BenchmarkMetrics:
    completed: int
    failed: int
    duration: float
    total_input: int
    total_input_text: int
    total_output: int
    total_output_retokenized: int
    request_throughput: float
    input_throughput: float
    output_throughput: float
    max_output_tokens_per_s: float
    max_concurrent_requests: int
    total_throughput: float
    concurrency: float
    e2e_latency: Stats
    ttft: Stats
    tpot: Stats
    itl: Stats
    cached_tokens: int | None = None
    cache_prompt_tokens: int | None = None
    errors: Counter[str] = field(default_factory=Counter)

    @property
    def cache_hit_rate(self) -> float | None:
        if self.cached_tokens is None or not self.cache_prompt_tokens:
            return None
        return self.cached_tokens / self.cache_prompt_tokens


def spread_gap(gap: float, new_tokens: int) -> list[float]:
    """A chunk's gap split evenly over the tokens it carried (SGLang's native-backend ITL)."""
    return [gap / new_tokens] * new_tokens if new_tokens > 0 else []


def bucket_counts(times: list[float], origin: float) -> Counter[int]:
    """How many of `times` fall in each 1-second bucket counted from `origin`."""
    return Counter(int(math.floor(t - origin)) for t in times)


def peak_output_throughput(outputs: list[RequestOutput]) -> float:
    done = [o for o in outputs if o.success]
    if not done:
        return 0.0
    origin = min(o.start_time for o in done)
    counts = bucket_counts([t for o in done for t in o.token_times], origin)
    return float(max(counts.values(), default=0))


def peak_concurrent_requests(outputs: list[RequestOutput]) -> int:
    """The most requests alive during one 1-second bucket (a request counts in every bucket it overlaps)."""
    done = [o for o in outputs if o.success]
    if not done:
        return 0
    origin = min(o.start_time for o in done)
    alive: Counter[int] = Counter()
    for o in done:
        first = int(math.floor(o.start_time - origin))
        last = int(math.floor(o.start_time + o.latency - origin))
        for bucket in range(first, last + 1):
            alive[bucket] += 1
    return max(alive.values())


def calculate_metrics(outputs: list[RequestOutput], duration: float, tokenizer: Any | None) -> BenchmarkMetrics:
    """Aggregate the per-request outputs of one run (`duration` = clock start -> all requests done)."""
    done = [o for o in outputs if o.success]
    errors = Counter(o.error or "unknown error" for o in outputs if not o.success)
    total_input = sum(o.prompt_len for o in done)
    total_output = sum(o.output_len for o in done)
    retokenized = sum(len(tokenizer.encode(o.generated_text, add_special_tokens=False))
                      for o in done if o.generated_text) if tokenizer is not None else 0
    tpots = [(o.latency - o.ttft) / (o.output_len - 1) for o in done if o.output_len > 1]
    reporting = [o for o in done if o.cached_tokens is not None and o.server_prompt_tokens is not None]
    duration = max(duration, 1e-9)
    return BenchmarkMetrics(
        completed=len(done), failed=len(outputs) - len(done), duration=duration,
        total_input=total_input, total_input_text=total_input, total_output=total_output,
        total_output_retokenized=retokenized,
        request_throughput=len(done) / duration, input_throughput=total_input / duration,
        output_throughput=total_output / duration,
        max_output_tokens_per_s=peak_output_throughput(outputs),
        max_concurrent_requests=peak_concurrent_requests(outputs),
        total_throughput=(total_input + total_output) / duration,
        concurrency=sum(o.latency for o in done) / duration,
        e2e_latency=Stats.of_seconds([o.latency for o in done]),
        ttft=Stats.of_seconds([o.ttft for o in done]),
        tpot=Stats.of_seconds(tpots),
        itl=Stats.of_seconds([gap for o in done for gap in o.itl]),
        cached_tokens=sum(o.cached_tokens or 0 for o in reporting) if reporting else None,
        cache_prompt_tokens=sum(o.server_prompt_tokens or 0 for o in reporting) if reporting else None,
        errors=errors,
    )
