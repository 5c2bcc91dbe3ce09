"""The forward benchmark's in-round roofline arithmetic (bench/roofline_probes.py), against hand-computed
values, and the probes themselves on tiny sizes."""

from __future__ import annotations

import pytest
import torch

from bench.roofline_probes import MatmulProbe, ReadProbe, roofline_floor_s, round_fractions


def test_floor_is_the_slower_of_compute_and_reading():
    # 10 GFLOP at 500 GFLOP/s = 20 ms; 400 MB at 20 GB/s = 20 ms; 800 MB = 40 ms
    assert roofline_floor_s(10e9, 400e6, 500, 20) == pytest.approx(0.020)
    assert roofline_floor_s(10e9, 800e6, 500, 20) == pytest.approx(0.040)
    assert roofline_floor_s(40e9, 400e6, 500, 20) == pytest.approx(0.080)
    with pytest.raises(ValueError):
        roofline_floor_s(1.0, 1.0, 0.0, 20)


def test_round_fractions_pair_values_of_the_same_round():
    flops, step_bytes = 18e9, 600e6
    mm_flops, read_bytes = 16e9, 600e6
    # round 0: fast machine (peak 1600, 30 GB/s), step 40 ms; round 1: slow (peak 800, 20 GB/s), step 60 ms;
    # round 2: medium (peak 1000, 24 GB/s), step 50 ms
    step_s = [0.040, 0.060, 0.050]
    matmul_s = [mm_flops / 1600e9, mm_flops / 800e9, mm_flops / 1000e9]
    read_s = [read_bytes / 30e9, read_bytes / 20e9, read_bytes / 24e9]
    out = round_fractions(step_s, matmul_s, read_s, flops, step_bytes, mm_flops, read_bytes)
    assert out["peak_gflops"] == pytest.approx(1000)
    assert out["read_gbps"] == pytest.approx(24)
    # achieved 450, 300, 360 GFLOP/s over 1600, 800, 1000 -> 0.28125, 0.375, 0.36: median 0.36
    assert out["peak_frac"] == pytest.approx(0.36)
    # floors (memory-bound in every round): 20, 30, 25 ms over 40, 60, 50 ms -> 0.5 each
    assert out["roofline_model_frac"] == pytest.approx(0.5)
    assert out["floor_ms"] == pytest.approx(25)
    # the ratio of medians would mix rounds; the paired median keeps them apart
    assert out["step_over_read"] == pytest.approx(0.050 / (read_bytes / 24e9))


def test_round_fractions_reject_unpaired_lists():
    with pytest.raises(ValueError):
        round_fractions([0.1, 0.2], [0.1], [0.1, 0.2], 1e9, 1e6, 1e9, 1e6)
    with pytest.raises(ValueError):
        round_fractions([], [], [], 1e9, 1e6, 1e9, 1e6)


def test_probes_run_and_read_rotates(monkeypatch):
    monkeypatch.setattr(ReadProbe, "BUFFER_BYTES", 1 << 16)
    reader = ReadProbe()
    assert reader.clipped(1 << 20) == 1 << 16  # clipped to the buffer
    reader.read(1 << 14)
    reader.read(1 << 14)
    assert reader.offset == 2 * (1 << 14) // 4
    reader.read(1 << 16)  # does not fit after the offset: starts over
    assert reader.offset == (1 << 16) // 4
    probe = MatmulProbe(torch.float32, size=32)
    probe()
    torch.testing.assert_close(probe.out, probe.a @ probe.b)
    assert probe.flops == 2.0 * 32 ** 3
