"""The Triton KV-index kernel against the torch path, on the CPU under Triton's interpreter.

`TRITON_INTERPRET=1` must be set before the kernel is defined and it is process-wide, so the comparison runs
in a subprocess (this file run as a script); the rest of the suite never sees the variable.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
import torch

CASES_PER_MODE = 20


def random_case(rng: random.Random, with_start: bool, width: int = 320):
    """B in 1..64, lengths 0..300 (zeros frequent, also leading and trailing), optional per-request starts."""
    rows = rng.randint(1, 80)
    table = torch.randint(0, 2**31 - 1, (rows, width), dtype=torch.int32,
                          generator=torch.Generator().manual_seed(rng.randrange(2**31)))
    b = rng.randint(1, 64)
    req = [rng.randrange(rows) for _ in range(b)]
    lens = [rng.choice([0, rng.randint(0, 300)]) for _ in range(b)]
    starts = [rng.randint(0, width - n) if with_start else 0 for n in lens]
    return table, req, lens, starts


def _run_interpreted() -> int:
    """Compare the kernel with the torch path over randomized batches; return the number of cases."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from tokenloom.layers.kv_indices import build_kv_indices

    rng = random.Random(7)
    cases = 0
    for with_start in (False, True):
        for _ in range(CASES_PER_MODE):
            table, req, lens, starts = random_case(rng, with_start)
            dtype = rng.choice([torch.int32, torch.int64])  # callers pass either
            args = (table, torch.tensor(req, dtype=dtype), torch.tensor(lens, dtype=dtype),
                    torch.tensor(starts, dtype=dtype) if with_start else None)
            want_ptr, want = build_kv_indices(*args, backend="torch")
            for total in (None, sum(lens)):
                ptr, idx = build_kv_indices(*args, total=total, backend="triton")
                assert ptr.dtype == torch.int64 and idx.dtype == torch.int64
                assert torch.equal(ptr, want_ptr), (with_start, req, lens, starts)
                assert torch.equal(idx, want), (with_start, req, lens, starts)
            cases += 1
    # A column-sliced table (row stride != width) and an all-empty batch.
    table = torch.arange(40 * 64, dtype=torch.int32).reshape(40, 64)[:, 8:40]
    args = (table, torch.tensor([3, 0, 39]), torch.tensor([5, 32, 0]), torch.tensor([27, 0, 32]))
    assert all(torch.equal(a, b) for a, b in zip(build_kv_indices(*args, backend="triton"),
                                                  build_kv_indices(*args, backend="torch"), strict=True))
    ptr, idx = build_kv_indices(table, torch.tensor([1, 2]), torch.tensor([0, 0]), backend="triton")
    assert ptr.tolist() == [0, 0, 0] and idx.numel() == 0
    return cases + 2


def test_triton_kernel_matches_torch_path_under_interpreter():
    pytest.importorskip("triton", reason="triton is not installed (it is in the test extras; some platforms "
                                         "have no wheel)")
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"ok {2 * CASES_PER_MODE + 2} cases" in result.stdout, result.stdout + result.stderr


if __name__ == "__main__":
    torch.set_num_threads(1)
    print(f"ok {_run_interpreted()} cases")
