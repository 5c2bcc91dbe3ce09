"""The machine's roofline measured between a benchmark's steps, so each step is compared against the compute
peak and memory bandwidth of the same moment.

Why: this VM's speed swings within seconds. Back to back, one 2048^3 bf16 matmul runs at anything from ~0.5
to ~1.9 TFLOP/s and a 700 MB read at 18-28 GB/s, while a decode step moves far less. A best-of roofline
taken at the start of a run and a median step taken minutes later can come from different phases, so the
fraction between them says more about the phase than about the step. Probes run in the same interleaved
rounds as the steps (A, probe, B, probe, ...) see the same phase; the fraction is then the median over
rounds of step-vs-probe ratios taken within one round.

Invariants: `paired_median` only pairs values of the same round (equal-length lists); `roofline_floor_s` is
the roofline model's best time for a step, max(FLOPs / peak, bytes / bandwidth).
"""

from __future__ import annotations

import statistics

import torch

from bench.common import _fill_random

GB = 1e9


class ReadProbe:
    """Reads `nbytes` of a 1 GB float32 buffer per call, at a rotating offset so a read never finds the
    previous one in the cache (the L3 here is 300 MB). `nbytes` is clipped to the buffer."""

    BUFFER_BYTES = 1 << 30

    def __init__(self) -> None:
        self.buffer = torch.empty(self.BUFFER_BYTES // 4, dtype=torch.float32)
        _fill_random(self.buffer)
        self.offset = 0

    def clipped(self, nbytes: int) -> int:
        return min(nbytes // 4, self.buffer.numel()) * 4

    def read(self, nbytes: int) -> None:
        elems = self.clipped(nbytes) // 4
        if self.offset + elems > self.buffer.numel():
            self.offset = 0
        self.buffer[self.offset:self.offset + elems].sum()
        self.offset += elems


class MatmulProbe:
    """One square matmul per call in the benchmark's dtype (torch/oneDNN: AMX for bf16 here), the same kind
    of operation the run-level `measure_roofline` takes its peak from."""

    def __init__(self, dtype: torch.dtype, size: int = 2048) -> None:
        self.a = torch.randn(size, size, dtype=torch.float32).to(dtype)
        self.b = torch.randn(size, size, dtype=torch.float32).to(dtype)
        self.out = torch.empty(size, size, dtype=dtype)
        self.flops = 2.0 * size ** 3
        self()  # oneDNN primitive creation stays out of the timed calls

    def __call__(self) -> None:
        torch.matmul(self.a, self.b, out=self.out)


def roofline_floor_s(flops: float, nbytes: float, peak_gflops: float, read_gbps: float) -> float:
    """The roofline model's best time for work of `flops` moving `nbytes`: whichever of compute at the peak
    and reading at the bandwidth takes longer."""
    if peak_gflops <= 0 or read_gbps <= 0:
        raise ValueError("peak and bandwidth must be positive")
    return max(flops / (peak_gflops * 1e9), nbytes / (read_gbps * GB))


def paired_median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def round_fractions(step_s: list[float], matmul_s: list[float], read_s: list[float], flops: float,
                    step_bytes: float, matmul_flops: float, read_bytes: float) -> dict[str, float]:
    """Per-round roofline fractions of a step, medians over rounds.

    Round i pairs step_s[i] with the probes timed right after it: peak_i = matmul_flops / matmul_s[i],
    bandwidth_i = read_bytes / read_s[i]. Returns the medians of peak and bandwidth, of the step's share of
    the compute peak (achieved FLOP/s / peak_i), of the roofline model's floor over the step time, and of
    step time over read time (with a read of the weights' size: the step against the weight-bandwidth bound)."""
    if not (len(step_s) == len(matmul_s) == len(read_s)) or not step_s:
        raise ValueError("one step, one matmul and one read time per round are needed")
    peaks = [matmul_flops / t / 1e9 for t in matmul_s]
    bandwidths = [read_bytes / t / GB for t in read_s]
    peak_frac = [flops / s / 1e9 / p for s, p in zip(step_s, peaks, strict=True)]
    floors = [roofline_floor_s(flops, step_bytes, p, bw) for p, bw in zip(peaks, bandwidths, strict=True)]
    model_frac = [f / s for f, s in zip(floors, step_s, strict=True)]
    return {
        "peak_gflops": paired_median(peaks),
        "read_gbps": paired_median(bandwidths),
        "peak_frac": paired_median(peak_frac),
        "roofline_model_frac": paired_median(model_frac),
        "step_over_read": paired_median([s / r for s, r in zip(step_s, read_s, strict=True)]),
        "floor_ms": 1e3 * paired_median(floors),
    }
