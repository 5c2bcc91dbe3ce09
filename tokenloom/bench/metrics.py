"""Per-request measurements (`RequestOutput`, filled by the backends) and the run's aggregate metrics
(`BenchmarkMetrics`, computed by `calculate_metrics`) with SGLang `bench_serving` definitions:

- TTFT: send -> first chunk carrying text. E2E latency: send -> last line of the response read.
- ITL, per token on every backend (`stream_timing`): the first chunk carrying text ends the TTFT and adds no
  gap; each later chunk carrying k new tokens adds k gaps of gap/k (gap = its arrival - the previous counted
  chunk's), so a server that sends one chunk per token and one that batches tokens into chunks are measured
  alike. Chunks with no new token are skipped (their wait counts in the next gap). The native backend reads k
  from `meta_info.completion_tokens`; the OpenAI backends from `chunk_token_counts` (a cumulative count in each
  chunk, else 1 per chunk when the final usage equals the number of chunks, else the chunk's text tokenized,
  else 1 per chunk). This is SGLang's native-backend rule applied to all backends; SGLang's own OpenAI
  backends take the raw gap per chunk instead, which equals this rule when every chunk is one token.
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
from collections.abc import Callable
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


def stream_timing(chunks: list[tuple[float, int]]) -> tuple[list[float], list[float]]:
    """(ITL gaps, token arrival times) of one stream from (arrival time, new tokens) of its text-carrying chunks,
    in order. The first chunk's tokens all arrive at its time (the TTFT; no gap); a later chunk with k > 0 new
    tokens adds k gaps of gap/k and k token times evenly spaced over its gap; k <= 0 chunks are skipped."""
    itl: list[float] = []
    times: list[float] = []
    if not chunks:
        return itl, times
    prev, first = chunks[0]
    times += [prev] * max(first, 0)
    for now, new in chunks[1:]:
        if new <= 0:
            continue
        gap = now - prev
        itl += spread_gap(gap, new)
        times += [prev + gap * (k + 1) / new for k in range(new)]
        prev = now
    return itl, times


def chunk_token_counts(texts: list[str], cumulative: list[int | None], total: int | None,
                       count_tokens: Callable[[str], int] | None) -> list[int]:
    """New tokens per text-carrying chunk of an OpenAI stream, by the first rule that applies:
    1. every chunk reported a cumulative completion-token count (vLLM/SGLang `continuous_usage_stats`,
       llama-server `timings_per_token`): the deltas, exact;
    2. the final usage equals the number of chunks: 1 each, exact (each text chunk carries at least one token);
    3. a tokenizer: each chunk's text tokenized on its own (at least 1; approximate at token boundaries);
    4. 1 per chunk."""
    n = len(texts)
    known = [c for c in cumulative if c is not None]
    if n and len(known) == n:
        counts = [c - p for c, p in zip(known, [0, *known[:-1]], strict=True)]
        if all(k >= 0 for k in counts):  # a count that went backwards is not a cumulative count
            return counts
    if total == n:
        return [1] * n
    if count_tokens is not None:
        return [max(1, count_tokens(t)) for t in texts]
    return [1] * n


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
