"""The forward benchmark's in-round roofline arithmetic (bench/roofline_probes.py), against hand-computed
values, and the probes themselves on tiny sizes."""

from __future__ import annotations

import pytest
import torch

from bench.forward import run_interleaved
from bench.roofline_probes import MatmulProbe, ReadProbe, roofline_floor_s, round_fractions, timed_rounds, vs_read


def test_floor_is_the_slower_of_compute_and_reading():
    # 10 GFLOP at 500 GFLOP/s = 20 ms; 400 MB at 20 GB/s = 20 ms; 800 MB = 40 ms
    assert roofline_floor_s(10e9, 400e6, 500, 20) == pytest.approx(0.020)
    assert roofline_floor_s(10e9, 800e6, 500, 20) == pytest.approx(0.040)
    assert roofline_floor_s(40e9, 400e6, 500, 20) == pytest.approx(0.080)
    with pytest.raises(ValueError):
        roofline_floor_s(1.0, 1.0, 0.0, 20)


def test_round_fractions_pair_values_of_the_same_round():
    flops, step_bytes = 18e9, 600e6
    # round 0: memory-bound, floor max(18 ms, 20 ms) = 20 ms over a 40 ms step -> 0.5
    # round 1: compute-bound, floor max(36 ms, 24 ms) = 36 ms over 60 ms -> 0.6
    # round 2: memory-bound, floor max(15 ms, 30 ms) = 30 ms over 75 ms -> 0.4
    step_s, peaks, bandwidths = [0.040, 0.060, 0.075], [1000.0, 500.0, 1200.0], [30.0, 25.0, 20.0]
    out = round_fractions(step_s, peaks, bandwidths, flops, step_bytes)
    assert out["peak_gflops"] == pytest.approx(1000)
    assert out["read_gbps"] == pytest.approx(25)
    # achieved 450, 300, 240 GFLOP/s over 1000, 500, 1200 -> 0.45, 0.6, 0.2
    assert out["peak_frac"] == pytest.approx(0.45)
    assert out["roofline_model_frac"] == pytest.approx(0.5)
    assert out["floor_ms"] == pytest.approx(30)
    # round by round: a bandwidth or peak taken from another round would change these
    assert out["roofline_model_frac_rounds"] == pytest.approx([0.5, 0.6, 0.4])
    assert out["peak_frac_rounds"] == pytest.approx([0.45, 0.6, 0.2])


def test_paired_fraction_differs_from_a_ratio_of_medians():
    # achieved 900, 600, 450 GFLOP/s against peaks 1000, 2000, 1100 of the same rounds: 0.9, 0.3, 0.409
    step_s, peaks = [0.020, 0.030, 0.040], [1000.0, 2000.0, 1100.0]
    out = round_fractions(step_s, peaks, [25.0] * 3, 18e9, 1e6)
    assert out["peak_frac"] == pytest.approx(450 / 1100)
    # the median step over the median peak would say 600 / 1100
    assert out["peak_frac"] < 0.5


def test_vs_read_is_step_over_the_weight_read_of_the_same_round():
    # 270 MB at 27 GB/s = 10 ms, at 18 GB/s = 15 ms
    assert vs_read([0.011, 0.018], [27.0, 18.0], 270e6) == pytest.approx((1.1 + 1.2) / 2)


def test_unpaired_lists_are_rejected():
    with pytest.raises(ValueError):
        round_fractions([0.1, 0.2], [100.0], [10.0, 10.0], 1e9, 1e6)
    with pytest.raises(ValueError):
        round_fractions([], [], [], 1e9, 1e6)
    with pytest.raises(ValueError):
        vs_read([0.1], [], 1e6)


def test_probes_record_a_rate_per_call_and_the_read_rotates(monkeypatch):
    monkeypatch.setattr(ReadProbe, "BUFFER_BYTES", 1 << 16)
    reader = ReadProbe()
    assert reader.clipped(1 << 20) == 1 << 16  # clipped to the buffer
    reader.read(1 << 14)
    reader.read(1 << 14)
    assert reader.offset == 2 * (1 << 14) // 4
    reader.read(3 << 14)  # runs past the end: wraps around to the start
    assert reader.offset == (1 << 14) // 4
    assert len(reader.rates) == 3 and all(r > 0 for r in reader.rates)
    probe = MatmulProbe(torch.float32, sizes=(16, 32))
    probe()
    probe()
    assert len(probe.rates) == 2 and all(r > 0 for r in probe.rates)
    a, b, out = probe.operands[1]
    torch.testing.assert_close(out, a @ b)


class _CountingProbe:
    """Records the global call number as its 'rate', so a test can see which calls were kept."""

    def __init__(self, clock: list[int]) -> None:
        self.clock, self.rates = clock, []

    def __call__(self) -> None:
        self.clock[0] += 1
        self.rates.append(float(self.clock[0]))


@pytest.mark.parametrize("warmup,steps,budget_s", [(2, 4, 1e9), (0, 5, 1e9), (1, 10, 0.0)])
def test_timed_rounds_keep_the_calls_of_the_timed_rounds_only(warmup, steps, budget_s):
    clock = [0]
    step_calls: list[int] = []

    def step() -> None:
        clock[0] += 1
        step_calls.append(clock[0])

    probe = _CountingProbe(clock)
    probe()  # an earlier point's call
    before = len(probe.rates)
    times = run_interleaved({"tl": step, "probe": probe}, warmup, steps, 3, budget_s)
    rounds = len(times["tl"])
    assert rounds == (steps if budget_s > 1 else 3)  # a zero budget falls back to the minimum of 3 rounds
    kept = timed_rounds(probe.rates, before, warmup, rounds)
    # each kept probe call came right after a timed step of the same round
    assert [int(k) for k in kept] == [c + 1 for c in step_calls[warmup:]]
    with pytest.raises(RuntimeError):
        timed_rounds(probe.rates, before, warmup, rounds + 1)
