"""Small-batch bf16 linear layers: the native weight-streaming kernel against oneDNN's packed matmul.

For SmolLM2-135M's linear shapes (qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536, lm_head
49152x576) and rows M = 1, 2, 4, 8, 16, times in one run, interleaved rep by rep (best of `--reps`):

* onednn: `torch.ops.mkldnn._linear_pointwise` on a weight packed once (what tokenloom used before),
* stream: `cpu_gemm.small_linear` (csrc/small_gemm.c),
* read: the read-bandwidth limit, a float32 `sum` over the weight's bytes (what any kernel must stream).

It checks that both give the same result (within bf16 rounding of a float32 sum) and prints, per M, the
sum of the five layers' times with the ratio onednn / stream, and the GB/s each streams. The crossover M
decides `cpu_gemm.SMALL_M_MAX`.

Usage:
    python bench/small_gemm.py            # ~20 s
    python bench/small_gemm.py --quick
The last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import CpuMonitor, _cpu_name
from tokenloom.layers import cpu_gemm

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="M = 1, 8, 16 and fewer reps")
    p.add_argument("--rows", default=None, help="comma list of M (default 1,2,4,8,16)")
    p.add_argument("--reps", type=int, default=None, help="timed reps (default 30; quick 10)")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    rows = [int(x) for x in (args.rows or ("1,8,16" if args.quick else "1,2,4,8,16")).split(",")]
    reps = args.reps or (10 if args.quick else 30)
    torch.set_num_threads(args.threads)
    if cpu_gemm.pack_weight(torch.zeros(16, 32, dtype=torch.bfloat16)) is None:
        sys.exit("oneDNN bf16 is not available on this machine")
    gen = torch.Generator().manual_seed(0)
    weights = {name: (torch.randn(n, k, generator=gen) * 0.05).to(torch.bfloat16) for name, (n, k) in SHAPES.items()}
    packed = {name: cpu_gemm.pack_weight(w) for name, w in weights.items()}
    as_f32 = {name: w.view(torch.float32) for name, w in weights.items()}
    total_bytes = sum(w.numel() * 2 for w in weights.values())
    print(f"machine: {_cpu_name()}, {os.cpu_count()} CPUs, torch {torch.__version__}, {args.threads} threads; "
          f"weights {total_bytes / 1e6:.0f} MB over 5 layers; best of {reps} reps")
    monitor = CpuMonitor()
    results = []
    for m in rows:
        xs = {name: torch.randn(m, k, generator=gen).to(torch.bfloat16) for name, (_, k) in SHAPES.items()}
        stream_ok = all(cpu_gemm.small_linear(xs[n], weights[n]) is not None for n in SHAPES)
        for name in SHAPES:  # correctness and warm-up
            ref = torch.ops.mkldnn._linear_pointwise(xs[name], packed[name], None, "none", [], "")
            got = cpu_gemm.small_linear(xs[name], weights[name])
            if got is not None:
                err = (got.float() - ref.float()).abs().max().item()
                if err > 0.02 * max(1.0, ref.float().abs().max().item()):
                    raise AssertionError(f"{name} M={m}: stream kernel differs from oneDNN by {err}")
        fns = {"onednn": lambda xs=xs: [torch.ops.mkldnn._linear_pointwise(xs[n], packed[n], None, "none", [], "")
                                        for n in SHAPES],
               "read": lambda: [as_f32[n].sum() for n in SHAPES]}
        if stream_ok:
            fns["stream"] = lambda xs=xs: [cpu_gemm.small_linear(xs[n], weights[n]) for n in SHAPES]
        best = dict.fromkeys(fns, float("inf"))
        for _ in range(reps):
            for name, fn in fns.items():
                t0 = time.perf_counter()
                fn()
                best[name] = min(best[name], time.perf_counter() - t0)
        row = {"m": m, **{f"{k}_ms": v * 1e3 for k, v in best.items()},
               **{f"{k}_gbps": total_bytes / v / 1e9 for k, v in best.items()}}
        row["onednn_over_stream"] = best["onednn"] / best["stream"] if stream_ok else None
        results.append(row)
    other = monitor.other_fraction()
    print("| M | oneDNN ms | stream ms | read limit ms | oneDNN / stream | stream GB/s | oneDNN GB/s |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        def cell(key: str, spec: str, suffix: str = "", r: dict = r) -> str:
            return "-" if r.get(key) is None else format(r[key], spec) + suffix

        print(f"| {r['m']} | {cell('onednn_ms', '.2f')} | {cell('stream_ms', '.2f')} | {cell('read_ms', '.2f')} | "
              f"{cell('onednn_over_stream', '.2f', 'x')} | {cell('stream_gbps', '.1f')} | "
              f"{cell('onednn_gbps', '.1f')} |")
    print(f"other processes used {100 * other:.0f}% of the machine's CPU time during the run; "
          f"cpu_gemm.SMALL_M_MAX = {cpu_gemm.SMALL_M_MAX}")
    print(json.dumps({"rows": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}
                               for r in results], "threads": args.threads, "reps": reps,
                      "small_m_max": cpu_gemm.SMALL_M_MAX, "other_cpu_fraction": round(other, 3)}))


if __name__ == "__main__":
    main()
