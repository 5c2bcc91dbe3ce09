"""`--plot FILE.png`: one figure of a run for people who would rather look than read: output token throughput
per 1-second bucket over the run (with running requests), and the TTFT and ITL distributions (histograms with
the median and P99 marked). matplotlib runs headless (Agg); it is imported only when a plot is asked for.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

from tokenloom.bench.metrics import BenchmarkMetrics, RequestOutput, bucket_counts


def throughput_series(outputs: list[RequestOutput]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(bucket start seconds, output tokens in each bucket, requests alive in each bucket)."""
    done = [o for o in outputs if o.success]
    if not done:
        return np.zeros(0), np.zeros(0), np.zeros(0)
    origin = min(o.start_time for o in done)
    counts = bucket_counts([t for o in done for t in o.token_times], origin)
    end = max(int(math.floor(o.start_time + o.latency - origin)) for o in done)
    seconds = np.arange(end + 1)
    tokens = np.array([counts.get(int(s), 0) for s in seconds], dtype=np.float64)
    alive = np.zeros(end + 1)
    for o in done:
        first = int(math.floor(o.start_time - origin))
        last = int(math.floor(o.start_time + o.latency - origin))
        alive[first:last + 1] += 1
    return seconds, tokens, alive


def _histogram(ax: Any, values_ms: list[float], title: str, color: str) -> None:
    if not values_ms:
        ax.set_title(f"{title} (no data)")
        return
    data = np.asarray(values_ms)
    nbins = min(60, max(10, int(math.sqrt(len(data)))))
    low, median = float(data.min()), float(np.median(data))
    if low > 0 and data.max() > 20 * median:  # a long tail (prefill stalls): log bins keep the body visible
        ax.hist(data, bins=np.geomspace(low, float(data.max()), nbins), color=color, alpha=0.8)
        ax.set_xscale("log")
    else:
        ax.hist(data, bins=nbins, color=color, alpha=0.8)
    for q, style in ((50, "--"), (99, ":")):
        v = float(np.percentile(data, q))
        ax.axvline(v, color="black", linestyle=style, linewidth=1, label=f"P{q} {v:.1f} ms")
    ax.set_title(title)
    ax.set_xlabel("ms")
    ax.set_ylabel("count")
    ax.legend(fontsize=8)


def save_plot(outputs: list[RequestOutput], metrics: BenchmarkMetrics, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    seconds, tokens, alive = throughput_series(outputs)
    ax = axes[0]
    ax.plot(seconds, tokens, color="tab:blue", label="output tok/s")
    ax.axhline(metrics.output_throughput, color="tab:blue", linestyle="--", linewidth=1,
               label=f"mean {metrics.output_throughput:.1f} tok/s")
    ax.set_xlabel("seconds since the first request")
    ax.set_ylabel("output tokens per second")
    ax.set_title("Output throughput over time")
    twin = ax.twinx()
    twin.plot(seconds, alive, color="tab:gray", alpha=0.6, label="running requests")
    twin.set_ylabel("requests alive")
    twin.set_ylim(0, max(1.0, float(alive.max(initial=0))) * 1.15)
    ax.set_ylim(0, max(1.0, float(tokens.max(initial=0))) * 1.15)
    lines = ax.get_legend_handles_labels()
    more = twin.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize=8, loc="lower right")
    done = [o for o in outputs if o.success]
    _histogram(axes[1], [o.ttft * 1000 for o in done], "Time to first token", "tab:orange")
    _histogram(axes[2], [g * 1000 for o in done for g in o.itl], "Inter-token latency", "tab:green")
    fig.suptitle(title)
    fig.tight_layout()
    folder = os.path.dirname(path)
    if folder:
        os.makedirs(folder, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
