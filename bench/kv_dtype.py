"""Decode step time with an fp8 KV cache (`--kv-cache-dtype fp8_e4m3 | fp8_e5m2`) beside the bf16 one, at long
context, in one run (ratios side by side; absolute times on a shared machine are noise).

1. Attention only: the native paged decode kernel (`kernels/paged_attention.py`) over SmolLM2-135M's 30
   layers (9 query heads, 3 KV heads, head dim 64; each layer its own pool, so KV does not stay in cache
   between layers), bf16 queries, the step's K/V write fused, for each shape in `--shapes` (requests x
   context). The KV read per step halves with fp8; the fp8 rows are widened in registers.
2. The whole decode step: `ModelRunner.forward` on SmolLM2 (bench/forward_engines.py's `TokenloomEngine`:
   KV slots filled with random data directly, no prefill), bf16 model, KV bf16 / e4m3 / e5m2. At one request
   the native decode step runs it (csrc/decode_native.c), at 16 the modular path.

Engines alternate step by step; medians of `--steps`. The last line is one JSON object.

    .venv/bin/python bench/kv_dtype.py                      # 16 x 2048 and 1 x 8000 (the model: 8192 context)
    .venv/bin/python bench/kv_dtype.py --shapes 4x4096 --steps 10 --skip-model
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import _fill_random  # noqa: E402
from tokenloom.cache.kv_pool import to_kv_dtype  # noqa: E402
from tokenloom.kernels import paged_attention  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 9, 3, 64, 30
KV = {"bf16": ("auto", torch.bfloat16), "fp8_e4m3": ("fp8_e4m3", torch.float8_e4m3fn),
      "fp8_e5m2": ("fp8_e5m2", torch.float8_e5m2)}


def _shape(text: str) -> tuple[int, int]:
    batch, context = text.lower().split("x")
    return int(batch), int(context)


def attention_point(batch: int, context: int, steps: int) -> dict[str, float]:
    """Median ms of one decode step's attention over 30 layers, per KV dtype (alternating)."""
    rows = batch * (context + steps + 2) + 1
    gen = torch.Generator().manual_seed(0)
    pools = {}
    for name, (_, dtype) in KV.items():
        layers = []
        for _ in range(LAYERS):
            k = torch.empty(KV_HEADS, rows, HEAD_DIM, dtype=dtype)
            v = torch.empty_like(k)
            for t in (k, v):
                if dtype == torch.bfloat16:
                    _fill_random(t)
                else:  # fp8: random values through the pool's saturating cast
                    t.view(torch.uint8).copy_(to_kv_dtype(torch.randn(t.shape, generator=gen), dtype)
                                              .view(torch.uint8))
            layers.append((k, v))
        pools[name] = layers
    per_req = context + steps + 2
    indptr = torch.arange(batch + 1, dtype=torch.int64) * (context + 1)
    times: dict[str, list[float]] = {name: [] for name in KV}
    q = torch.randn(batch, HEADS, HEAD_DIM).to(torch.bfloat16)
    kv_new = torch.randn(batch, KV_HEADS, HEAD_DIM).to(torch.bfloat16)
    for step in range(steps + 1):
        # each request's slots contiguous, the new token at its end
        indices = torch.cat([1 + b * per_req + torch.arange(context + 1) for b in range(batch)])
        out_loc = indices[indptr[1:] - 1]
        for name in KV:
            start = time.perf_counter()
            for k, v in pools[name]:
                paged_attention.decode(q, k, v, indptr, indices, HEAD_DIM ** -0.5, k_new=kv_new, v_new=kv_new,
                                       out_loc=out_loc)
            if step:  # the first round warms up
                times[name].append(1e3 * (time.perf_counter() - start))
    return {name: statistics.median(t) for name, t in times.items()}


def model_point(batch: int, context: int, steps: int, threads: int) -> dict[str, float]:
    """Median ms of one whole decode step of SmolLM2 (bf16), per KV dtype (alternating)."""
    from bench.forward_engines import TokenloomEngine

    engines = {}
    for name, (flag, _) in KV.items():
        engines[name] = TokenloomEngine("bfloat16", batch * (context + steps + 4), batch, threads, kv_cache_dtype=flag)
        engines[name].setup_decode(batch, context, steps + 2)
    times: dict[str, list[float]] = {name: [] for name in KV}
    for step in range(steps + 1):
        for name, engine in engines.items():
            start = time.perf_counter()
            engine.decode_step()
            if step:
                times[name].append(1e3 * (time.perf_counter() - start))
    for engine in engines.values():
        engine.teardown()
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="16x2048,1x8000", help="comma list of requests x context")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--skip-model", action="store_true", help="attention only")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    results = []
    for text in args.shapes.split(","):
        batch, context = _shape(text)
        row = {"batch": batch, "context": context, "attention_ms": attention_point(batch, context, args.steps)}
        if not args.skip_model:
            row["step_ms"] = model_point(batch, context, args.steps, args.threads)
        results.append(row)
        for what in ("attention_ms", "step_ms"):
            if what not in row:
                continue
            t = row[what]
            print(f"{batch:3d} x {context:5d} {what:13s} " + "  ".join(f"{n} {t[n]:8.2f}" for n in KV)
                  + f"   fp8/bf16: e4m3 {t['fp8_e4m3'] / t['bf16']:.2f}  e5m2 {t['fp8_e5m2'] / t['bf16']:.2f}",
                  flush=True)
    print(json.dumps({"bench": "kv_dtype", "threads": args.threads, "steps": args.steps, "points": results}))


if __name__ == "__main__":
    main()
