"""Shared benchmark helpers: the model's FLOP/byte accounting, the machine's roofline (matmul peak and memory
bandwidth, measured in the same run as the thing compared against it), a CPU-noise monitor, and the folders of
dummy-weight models."""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Any

import torch

GB = 1e9


def _fill_random(t: torch.Tensor, tile_elems: int = 1 << 22) -> None:
    """Write pseudo-random values into every element of `t` (memcpy speed: one random tile, copied)."""
    flat = t.view(-1)
    n = flat.numel()
    tile = torch.randn(min(n, tile_elems), dtype=torch.float32).to(t.dtype)
    for start in range(0, n, tile.numel()):
        stop = min(n, start + tile.numel())
        flat[start:stop].copy_(tile[: stop - start])


@dataclass
class ModelShape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @classmethod
    def from_config(cls, cfg: Any) -> ModelShape:
        return cls(cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                   cfg.head_dim, cfg.intermediate_size, cfg.vocab_size)

    @classmethod
    def smollm2(cls) -> ModelShape:
        """The default model's shape, read from its GGUF metadata."""
        from tokenloom.config import ServerArgs
        from tokenloom.models.loader import resolve_model_source

        return cls.from_config(resolve_model_source(ServerArgs()).config)

    @property
    def matmul_params(self) -> int:
        """Weights that take part in a matmul per token (every layer's projections and the LM head)."""
        qkv = self.hidden * (self.heads + 2 * self.kv_heads) * self.head_dim
        o = self.heads * self.head_dim * self.hidden
        mlp = 3 * self.hidden * self.intermediate
        return self.layers * (qkv + o + mlp) + self.vocab * self.hidden

    @property
    def streamed_params(self) -> int:
        """Weights a decode step reads: matmul weights plus norms (the embedding row is negligible)."""
        return self.matmul_params + (2 * self.layers + 1) * self.hidden

    def decode_flops(self, batch: int, context: int) -> float:
        attn = 4 * self.layers * self.heads * self.head_dim * context * batch
        return 2.0 * self.matmul_params * batch + attn

    def prefill_flops(self, batch: int, length: int) -> float:
        # Every token goes through the layers; only the last token of each prompt through the LM head.
        layer_params = self.matmul_params - self.vocab * self.hidden
        attn = 4 * self.layers * self.heads * self.head_dim * batch * length * (length + 1) / 2
        return 2.0 * layer_params * batch * length + 2.0 * self.vocab * self.hidden * batch + attn

    def kv_bytes(self, batch: int, context: int, elem: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * batch * context * elem


class CpuMonitor:
    """How much of the machine's CPU time went to *other* processes between two points (noise check)."""

    def __init__(self) -> None:
        self.start = self._snap()

    @staticmethod
    def _snap() -> tuple[float, float, float]:
        import resource

        busy = 0.0
        try:
            with open("/proc/stat") as f:
                # user nice system idle iowait irq softirq steal (guest time is already inside user/nice)
                fields = [float(x) for x in f.readline().split()[1:9]]
            busy = (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            pass
        own = resource.getrusage(resource.RUSAGE_SELF)
        return time.perf_counter(), busy, own.ru_utime + own.ru_stime

    def other_fraction(self) -> float:
        """Share of all CPUs' time used by other processes since construction (0 = quiet machine)."""
        t1, busy1, own1 = self._snap()
        t0, busy0, own0 = self.start
        wall = (t1 - t0) * (os.cpu_count() or 1)
        return max(0.0, (busy1 - busy0) - (own1 - own0)) / wall if wall > 0 else 0.0


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


# --------------------------------------------------------------------------------------------------------
# roofline


MATMUL_PROBE_S = 10.0  # a best-of matmul probe starts no rep after this long


def _best_matmul_gflops(m: int, k: int, n: int, dtype: torch.dtype, reps: int) -> float:
    a = torch.randn(m, k, dtype=torch.float32).to(dtype)
    b = torch.randn(k, n, dtype=torch.float32).to(dtype)
    c = torch.empty(m, n, dtype=dtype)
    start = time.perf_counter()
    torch.matmul(a, b, out=c)  # warmup (oneDNN primitive creation)
    best = time.perf_counter() - start  # an upper bound: used alone where one matmul takes the probe's time
    for _ in range(reps):
        t0 = time.perf_counter()
        if t0 - start > MATMUL_PROBE_S:  # a slow matmul (torch's bf16 without AVX-512: ~0.3 GFLOP/s)
            break
        torch.matmul(a, b, out=c)
        best = min(best, time.perf_counter() - t0)
    return 2 * m * k * n / best / 1e9


def measure_roofline(quick: bool) -> dict[str, Any]:
    """Best GFLOP/s of large matmuls (max over a few shapes, best of several reps each) and the memory
    bandwidth of 1 GB streams. Best-of is deliberate: it is the least disturbed by other processes."""
    out: dict[str, Any] = {}
    # 20 reps: on this VM single 2048^3 bf16 reps range from ~0.7 to ~1.9 TFLOP/s back to back.
    shapes = [(2048, 2048, 2048, 20)]
    if not quick:
        shapes.append((4096, 4096, 4096, 3))
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        per_shape = {f"{m}x{k}x{n}": _best_matmul_gflops(m, k, n, dtype, reps if dtype == torch.bfloat16
                                                         else max(2, reps // 2))
                     for m, k, n, reps in shapes}
        out[f"{name}_gflops"] = max(per_shape.values())
        out[f"{name}_detail"] = ", ".join(f"{s} {g:.0f}" for s, g in per_shape.items())
    # Memory bandwidth over 1 GB of float32 (far larger than any cache).
    elems = (1 << 30) // 4
    src = torch.empty(elems, dtype=torch.float32)
    _fill_random(src)
    dst = torch.empty_like(src)
    dst.copy_(src)
    reps = 6 if quick else 10
    best_sum, best_copy = float("inf"), float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        src.sum()
        best_sum = min(best_sum, time.perf_counter() - t0)
        t0 = time.perf_counter()
        dst.copy_(src)
        best_copy = min(best_copy, time.perf_counter() - t0)
    nbytes = elems * 4
    out["read_gbps"] = nbytes / best_sum / GB  # read-only stream, what weight streaming needs
    out["copy_gbps"] = 2 * nbytes / best_copy / GB  # read + write traffic of a copy
    del src, dst
    gc.collect()
    return out




def dummy_model_folder(name: str, config: dict[str, Any]) -> str:
    """A temp folder holding `config` as config.json plus SmolLM2's tokenizer, for `--load-format dummy`
    (random weights of that shape); made once per name and reused."""
    import json
    import tempfile

    from tokenloom.config import ServerArgs
    from tokenloom.models.loader import resolve_model_source
    from tokenloom.tokenizer import load_tokenizer

    folder = os.path.join(tempfile.gettempdir(), name)
    if not os.path.exists(os.path.join(folder, "config.json")):
        os.makedirs(folder, exist_ok=True)
        load_tokenizer(resolve_model_source(ServerArgs())).save_pretrained(folder)
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(config, f)
    return folder


def stop_process_group(proc: subprocess.Popen, term_timeout_s: float) -> None:
    """Stop a process started in its own session (`start_new_session=True`) and everything in its group:
    SIGTERM, SIGKILL after `term_timeout_s`, then SIGKILL to whatever of the group outlived the leader."""
    for sig, wait in ((signal.SIGTERM, term_timeout_s), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
