"""Running a check in a fresh process whose native kernels are built for AVX2 without AVX-512
(TOKENLOOM_CPU_KERNELS_ISA=avx2): how the AVX2 kernel families are tested on any x86 CPU, AVX-512 or not."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def has_avx2() -> bool:
    """Whether this CPU runs the AVX2 build (AVX2, FMA and F16C)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return {"avx2", "fma", "f16c"} <= set(flags)


def run_avx2(code: str) -> None:
    """Runs `code` in a fresh interpreter (repository root as cwd and on the path) with the AVX2 build; fails
    the calling test with the child's stderr unless the child exits 0 and prints 'ok' last."""
    env = {**os.environ, "TOKENLOOM_CPU_KERNELS_ISA": "avx2", "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, "-c", code + "\nprint('ok')\n"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
