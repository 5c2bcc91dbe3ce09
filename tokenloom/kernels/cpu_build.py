"""Builds and loads the C kernels in `csrc/` with the system C compiler, once per source and CPU.

The shared library is cached under `$TOKENLOOM_CACHE_DIR/kernels/<hash>/` where the hash covers the source,
the compiler flags and the CPU's feature flags (the code is built with -march=native). It links OpenMP by
the same soname torch loads (libgomp.so.1), so kernels share torch's thread pool instead of starting a
second one. Any failure (no compiler, unsupported CPU) returns None and callers use their torch path;
`TOKENLOOM_DISABLE_C_KERNELS=1` forces that.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile

from tokenloom.local_cache import cache_dir

logger = logging.getLogger(__name__)

CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-shared", "-std=c11"]


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return ""


@functools.cache
def load_library(name: str) -> ctypes.CDLL | None:
    """Compile (if needed) and load csrc/<name>.c; None when native kernels are unavailable."""
    if os.environ.get("TOKENLOOM_DISABLE_C_KERNELS") == "1":
        return None
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        logger.warning("no C compiler found; using torch fallbacks for CPU kernels")
        return None
    source = os.path.join(CSRC, f"{name}.c")
    with open(source, "rb") as f:
        code = f.read()
    key = hashlib.sha1(code + " ".join(CFLAGS).encode() + _cpu_flags().encode()).hexdigest()[:16]
    target_dir = os.path.join(cache_dir(), "kernels", key)
    target = os.path.join(target_dir, f"{name}.so")
    if not os.path.exists(target):
        os.makedirs(target_dir, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target_dir)
        os.close(fd)
        result = subprocess.run([compiler, *CFLAGS, source, "-o", tmp, "-lm"], capture_output=True, text=True)
        if result.returncode != 0:
            os.unlink(tmp)
            logger.warning("building %s failed; using torch fallbacks:\n%s", name, result.stderr[-2000:])
            return None
        os.replace(tmp, target)
    try:
        import torch  # noqa: F401  (torch's libgomp must be loaded first so the kernel shares it)

        return ctypes.CDLL(target)
    except OSError as e:
        logger.warning("loading %s failed (%s); using torch fallbacks", target, e)
        return None
