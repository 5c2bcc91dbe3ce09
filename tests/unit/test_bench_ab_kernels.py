"""bench/ab_kernels.py: this checkout against itself builds one library, and both sides give the same outputs."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenloom.kernels import quant_gemm as qg

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(qg.native_isa() == 0, reason="no native quantized-matmul kernels here")


def test_same_tree_is_bit_identical_and_timed():
    from bench.ab_kernels import main

    report = main(["--base-dir", str(ROOT), "--new-dir", str(ROOT), "--quick"])
    cases = report["results"]
    assert [(c["type"], c["n"], c["k"], c["m"]) for c in cases] == [("Q4_1", 512, 512, 1), ("Q4_K", 512, 512, 1)]
    for case in cases:
        assert case["max_abs_diff"] == 0.0, case
        assert case["base_us"] > 0 and case["new_us"] > 0 and case["new_over_base"] > 0, case
