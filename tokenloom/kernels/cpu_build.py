"""Builds and loads the C kernels in `csrc/` with the system C compiler, once per source and CPU. tokenloom
builds one library, `kernels` (csrc/kernels.c includes every kernel source).

The shared library is cached under `$TOKENLOOM_CACHE_DIR/kernels/<hash>/` where the hash covers every file
in csrc/ (sources include shared headers and each other), the compiler flags and the CPU's feature flags
(the code is built with -march=native). It links OpenMP by the same soname torch loads (libgomp.so.1), so
kernels share torch's thread pool instead of starting a second one. Any failure (no compiler, unsupported
CPU) returns None and callers use their torch path; `TOKENLOOM_DISABLE_C_KERNELS=1` forces that.
`TOKENLOOM_CPU_KERNELS_ISA=avx2` builds without AVX-512 and AMX (see ISA_LIMITS).

A build (the first run on a machine, or after the sources change) is announced at INFO, since it delays
the start by seconds: "Building native CPU kernels (first run, ~20 s)..." then "... built in 12.3 s".
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
import time

from tokenloom.local_cache import cache_dir

logger = logging.getLogger(__name__)

CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c11"]
# Linked in a separate step without -ffast-math: with it, gcc links crtfastmath.o, whose constructor turns on
# flush-to-zero/denormals-are-zero in the loading thread's MXCSR. That would change torch's own results on
# that thread, and make a kernel's result depend on which OpenMP thread computed it.
LDFLAGS = ["-shared", "-fopenmp"]
# TOKENLOOM_CPU_KERNELS_ISA=avx2 builds for this CPU less its AVX-512 and AMX instructions: the kernels an AVX2-only
# CPU (AMD Zen 2/3, Intel client cores) runs, testable and comparable on a CPU that has more.
ISA_LIMITS = {"avx2": ["-mno-avx512f", "-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"]}
BUILD_ESTIMATE_S = 20  # gcc -O3 over csrc/kernels.c on a loaded two-core machine; announced, not enforced


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return ""


def cpu_features() -> dict[str, bool]:
    """Whether this CPU has the instructions the native kernels are built for (the start-up summary shows
    them): AVX512-BF16 (every bf16 kernel) and AMX (the tile matmuls; the kernels also need the kernel's
    permission, asked for at first use)."""
    flags = set(_cpu_flags().split())
    return {"avx512_bf16": "avx512_bf16" in flags, "amx": {"amx_bf16", "amx_tile"} <= flags}


@functools.cache
def _sources_digest() -> bytes:
    """Digest of every file in csrc/ (a kernel may include headers or other sources from there)."""
    digest = hashlib.sha1()
    for entry in sorted(os.listdir(CSRC)):
        with open(os.path.join(CSRC, entry), "rb") as f:
            digest.update(entry.encode() + b"\0" + f.read())
    return digest.digest()


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
    isa = os.environ.get("TOKENLOOM_CPU_KERNELS_ISA", "native")
    if isa != "native" and isa not in ISA_LIMITS:
        logger.warning("TOKENLOOM_CPU_KERNELS_ISA=%s is not one of native, %s; building for native", isa,
                       ", ".join(ISA_LIMITS))
    cflags = CFLAGS + ISA_LIMITS.get(isa, [])
    flags = " ".join(cflags + LDFLAGS).encode()
    key = hashlib.sha1(_sources_digest() + flags + _cpu_flags().encode()).hexdigest()[:16]
    target_dir = os.path.join(cache_dir(), "kernels", key)
    target = os.path.join(target_dir, f"{name}.so")
    if not os.path.exists(target):
        os.makedirs(target_dir, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target_dir)
        os.close(fd)
        obj = tmp[:-3] + ".o"
        logger.info("Building native CPU kernels (first run, ~%d s)...", BUILD_ESTIMATE_S)
        start = time.perf_counter()
        result = subprocess.run([compiler, *cflags, "-c", source, "-o", obj], capture_output=True, text=True)
        if result.returncode == 0:
            result = subprocess.run([compiler, *LDFLAGS, obj, "-o", tmp, "-lm"], capture_output=True, text=True)
        if os.path.exists(obj):
            os.unlink(obj)
        if result.returncode != 0:
            os.unlink(tmp)
            logger.warning("building %s failed; using torch fallbacks:\n%s", name, result.stderr[-2000:])
            return None
        os.replace(tmp, target)
        logger.info("Native CPU kernels built in %.1f s (cached in %s)", time.perf_counter() - start, target_dir)
    try:
        import torch  # noqa: F401  (torch's libgomp must be loaded first so the kernel shares it)

        return ctypes.CDLL(target)
    except OSError as e:
        logger.warning("loading %s failed (%s); using torch fallbacks", target, e)
        return None
