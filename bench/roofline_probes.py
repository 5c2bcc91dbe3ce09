"""The machine's roofline measured between a benchmark's steps, so each step is compared against the compute
peak and memory bandwidth of the same moment.

Why: this VM's speed swings within seconds. Back to back, one 2048^3 bf16 matmul runs at anything from ~0.5
to ~1.9 TFLOP/s and a 700 MB read at 18-28 GB/s; a decode step's time swings far less. A best-of roofline
taken at the start of a run and a median step taken minutes later can come from different phases, so the
fraction between them says more about the phase than about the step. Probes run in the same interleaved
rounds as the steps (a step, then the probes, then the other engine's step) see the same phase; the
fraction is then the median over rounds of step-vs-probe ratios taken within one round.

Invariants: `round_fractions` and `vs_read` only pair values of the same round (equal-length lists);
`roofline_floor_s` is the roofline model's best time for a step, max(FLOPs / peak, bytes / bandwidth).
"""

from __future__ import annotations

import statistics
import time

import torch

from bench.common import _fill_random

GB = 1e9


class ReadProbe:
    """Reads `nbytes` of a 1 GiB float32 buffer per call, starting where the previous read ended and wrapping
    around at the end, so a read never finds the previous one in the cache (the L3 here is 300 MB); records
    the call's GB/s in `rates`. `nbytes` is clipped to the buffer."""

    BUFFER_BYTES = 1 << 30

    def __init__(self) -> None:
        self.buffer = torch.empty(self.BUFFER_BYTES // 4, dtype=torch.float32)
        _fill_random(self.buffer)
        self.offset = 0
        self.rates: list[float] = []

    def clipped(self, nbytes: int) -> int:
        return min(nbytes // 4, self.buffer.numel()) * 4

    def read(self, nbytes: int) -> None:
        elems, total = self.clipped(nbytes) // 4, self.buffer.numel()
        first = min(elems, total - self.offset)
        t0 = time.perf_counter()
        self.buffer[self.offset:self.offset + first].sum()
        if first < elems:  # wrapped: the rest from the start
            self.buffer[:elems - first].sum()
        self.rates.append(elems * 4 / (time.perf_counter() - t0) / GB)
        self.offset = (self.offset + elems) % total


class MatmulProbe:
    """Square matmuls in the benchmark's dtype (torch/oneDNN: AMX for bf16 here), the operation the run-level
    `measure_roofline` takes its peak from. Each call times one matmul of every size and records the best
    GFLOP/s in `rates` (which size is faster varies from phase to phase on this machine)."""

    def __init__(self, dtype: torch.dtype, sizes: tuple[int, ...] = (2048, 4096)) -> None:
        self.operands = []
        for size in sizes:
            a = torch.randn(size, size, dtype=torch.float32).to(dtype)
            b = torch.randn(size, size, dtype=torch.float32).to(dtype)
            out = torch.empty(size, size, dtype=dtype)
            torch.matmul(a, b, out=out)  # oneDNN primitive creation stays out of the timed calls
            self.operands.append((a, b, out))
        self.rates: list[float] = []

    def __call__(self) -> None:
        best = 0.0
        for a, b, out in self.operands:
            t0 = time.perf_counter()
            torch.matmul(a, b, out=out)
            best = max(best, 2.0 * a.shape[0] * a.shape[1] * b.shape[1] / (time.perf_counter() - t0) / 1e9)
        self.rates.append(best)


def timed_rounds(rates: list[float], calls_before: int, warmup: int, rounds: int) -> list[float]:
    """A probe's rates from one interleaved run's timed rounds: what it recorded after its `calls_before`
    earlier calls and this run's `warmup` untimed ones. Raises when that is not one rate per round."""
    timed = rates[calls_before + warmup:]
    if len(timed) != rounds:
        raise RuntimeError(f"probe recorded {len(timed)} timed calls for {rounds} rounds")
    return timed


def roofline_floor_s(flops: float, nbytes: float, peak_gflops: float, read_gbps: float) -> float:
    """The roofline model's best time for work of `flops` moving `nbytes`: whichever of compute at the peak
    and reading at the bandwidth takes longer."""
    if peak_gflops <= 0 or read_gbps <= 0:
        raise ValueError("peak and bandwidth must be positive")
    return max(flops / (peak_gflops * 1e9), nbytes / (read_gbps * GB))


def median_or_nan(values: list[float]) -> float:
    """The median, or NaN for no values (a point that ran no steps)."""
    return statistics.median(values) if values else float("nan")


def round_fractions(step_s: list[float], peaks: list[float], bandwidths: list[float], flops: float,
                    step_bytes: float) -> dict[str, float | list[float]]:
    """Per-round roofline fractions of a step, medians over rounds.

    Round i pairs step_s[i] with the probes run right after it: the compute peak peaks[i] (GFLOP/s) and the
    read bandwidth bandwidths[i] (GB/s). Returns the medians of peak and bandwidth, of the step's share of the
    compute peak (achieved FLOP/s / peak) and of the roofline model's floor over the step time, and the two
    fractions' per-round values ("peak_frac_rounds", "roofline_model_frac_rounds")."""
    if not (len(step_s) == len(peaks) == len(bandwidths)) or not step_s:
        raise ValueError("one step time, one peak and one bandwidth per round are needed")
    floors = [roofline_floor_s(flops, step_bytes, p, bw) for p, bw in zip(peaks, bandwidths, strict=True)]
    peak_fracs = [flops / s / 1e9 / p for s, p in zip(step_s, peaks, strict=True)]
    model_fracs = [f / s for f, s in zip(floors, step_s, strict=True)]
    return {
        "peak_gflops": median_or_nan(peaks),
        "read_gbps": median_or_nan(bandwidths),
        "peak_frac": median_or_nan(peak_fracs),
        "roofline_model_frac": median_or_nan(model_fracs),
        "floor_ms": 1e3 * median_or_nan(floors),
        "peak_frac_rounds": peak_fracs,
        "roofline_model_frac_rounds": model_fracs,
    }


def vs_read(step_s: list[float], bandwidths: list[float], nbytes: float) -> float:
    """Median over rounds of the step time over the time reading `nbytes` takes at that round's bandwidth
    (batch 1 with nbytes = the weights: the step against the weight-bandwidth bound)."""
    if len(step_s) != len(bandwidths) or not step_s:
        raise ValueError("one step time and one bandwidth per round are needed")
    return median_or_nan([s / (nbytes / (bw * GB)) for s, bw in zip(step_s, bandwidths, strict=True)])
