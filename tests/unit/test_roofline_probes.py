"""The forward benchmark's in-round roofline arithmetic (bench/roofline_probes.py), against hand-computed
values, and the probes themselves on tiny sizes."""

from __future__ import annotations

import pytest
import torch

from bench.roofline_probes import MatmulProbe, ReadProbe, roofline_floor_s, round_fractions, vs_read


def test_floor_is_the_slower_of_compute_and_reading():
    # 10 GFLOP at 500 GFLOP/s = 20 ms; 400 MB at 20 GB/s = 20 ms; 800 MB = 40 ms
    assert roofline_floor_s(10e9, 400e6, 500, 20) == pytest.approx(0.020)
    assert roofline_floor_s(10e9, 800e6, 500, 20) == pytest.approx(0.040)
    assert roofline_floor_s(40e9, 400e6, 500, 20) == pytest.approx(0.080)
    with pytest.raises(ValueError):
        roofline_floor_s(1.0, 1.0, 0.0, 20)


def test_round_fractions_pair_values_of_the_same_round():
    flops, step_bytes = 18e9, 600e6
    # round 0: fast machine (peak 1600, 30 GB/s), step 40 ms; round 1: slow (800, 20 GB/s), 60 ms;
    # round 2: in between (1000, 24 GB/s), 50 ms
    step_s, peaks, bandwidths = [0.040, 0.060, 0.050], [1600.0, 800.0, 1000.0], [30.0, 20.0, 24.0]
    out = round_fractions(step_s, peaks, bandwidths, flops, step_bytes)
    assert out["peak_gflops"] == pytest.approx(1000)
    assert out["read_gbps"] == pytest.approx(24)
    # achieved 450, 300, 360 GFLOP/s over 1600, 800, 1000 -> 0.28125, 0.375, 0.36: median 0.36
    # (the ratio of the medians, 360 / 1000, happens to agree here; the next case tells them apart)
    assert out["peak_frac"] == pytest.approx(0.36)
    # floors, memory-bound in every round: 20, 30, 25 ms over 40, 60, 50 ms -> 0.5 each
    assert out["roofline_model_frac"] == pytest.approx(0.5)
    assert out["floor_ms"] == pytest.approx(25)


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
    reader.read(1 << 16)  # does not fit after the offset: starts over
    assert reader.offset == (1 << 16) // 4
    assert len(reader.rates) == 3 and all(r > 0 for r in reader.rates)
    probe = MatmulProbe(torch.float32, sizes=(16, 32))
    probe()
    probe()
    assert len(probe.rates) == 2 and all(r > 0 for r in probe.rates)
    a, b, out = probe.operands[1]
    torch.testing.assert_close(out, a @ b)
