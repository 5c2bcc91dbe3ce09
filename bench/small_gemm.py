"""Decode-size bf16 linear layers: the AMX tile kernel and the weight-streaming kernel against oneDNN.

Every linear layer of SmolLM2-135M (`--layers` x (qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536)
plus the lm_head 49152x576; random weights), one decode step's worth of matmuls for M rows, times in one run,
interleaved rep by rep (best of `--reps`):

* onednn: `torch.ops.mkldnn._linear_pointwise` on a weight packed once (the modular path past AMX_M_MAX),
* amx: `cpu_gemm.amx_linear` (csrc/amx_gemm.c) on the tile-ordered copy (M <= AMX_M_MAX where AMX exists),
* stream: `cpu_gemm.small_linear` (csrc/small_gemm.c; M <= 8; the path without AMX),
* read: the read-bandwidth limit, a float32 `sum` over the same bytes (what any kernel must stream).

With the default 30 layers the weights (269 MB) do not fit the L3 cache, so the kernels stream them from
memory as a decode step does; `--layers 1` measures cache-resident weights. Every kernel is checked against
oneDNN first (within bf16 rounding of a float32 sum). Per M it prints each kernel's time, the GB/s of weight
it moves, and oneDNN's time over the AMX kernel's; the crossover decides `cpu_gemm.AMX_M_MAX`.

Usage:
    python bench/small_gemm.py            # M = 1..256, ~1 min
    python bench/small_gemm.py --quick    # M = 1, 16, 64
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

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LM_HEAD = (49152, 576)
STREAM_MAX_M = 8


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="M = 1, 16, 64 and fewer reps")
    p.add_argument("--rows", default=None, help="comma list of M (default 1,2,4,8,16,32,48,64,128,256)")
    p.add_argument("--reps", type=int, default=None, help="timed reps (default 5; quick 3)")
    p.add_argument("--layers", type=int, default=30, help="decoder layers' worth of weights (default 30)")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    rows = [int(x) for x in (args.rows or ("1,16,64" if args.quick else "1,2,4,8,16,32,48,64,128,256")).split(",")]
    reps = args.reps or (3 if args.quick else 5)
    torch.set_num_threads(args.threads)
    if cpu_gemm.pack_weight(torch.zeros(16, 32, dtype=torch.bfloat16)) is None:
        sys.exit("oneDNN bf16 is not available on this machine")
    gen = torch.Generator().manual_seed(0)
    shapes = LAYER_SHAPES * args.layers + [LM_HEAD]
    weights = [(torch.randn(n, k, generator=gen) * 0.05).to(torch.bfloat16) for n, k in shapes]
    packed = [cpu_gemm.pack_weight(w) for w in weights]
    has_amx = packed[0].amx is not None
    as_f32 = [w.view(torch.float32) for w in weights]
    total_bytes = sum(w.numel() * 2 for w in weights)
    inputs = {k: torch.randn(max(rows), k, generator=gen).to(torch.bfloat16) for k in {k for _, k in shapes}}
    print(f"machine: {_cpu_name()}, {os.cpu_count()} CPUs, torch {torch.__version__}, {args.threads} threads; "
          f"{len(weights)} linear layers, {total_bytes / 1e6:.0f} MB of weights; AMX kernel "
          f"{'available' if has_amx else 'unavailable'}; best of {reps} reps")
    monitor = CpuMonitor()
    results = []
    for m in rows:
        xs = [inputs[w.shape[1]][:m] for w in weights]
        fns = {"onednn": lambda xs=xs: [torch.ops.mkldnn._linear_pointwise(x, pk.onednn, None, "none", [], "")
                                        for x, pk in zip(xs, packed, strict=True)],
               "read": lambda: [t.sum() for t in as_f32]}
        if has_amx:
            fns["amx"] = lambda xs=xs: [cpu_gemm.amx_linear(x, w, pk.amx)
                                        for x, w, pk in zip(xs, weights, packed, strict=True)]
        if m <= STREAM_MAX_M:
            fns["stream"] = lambda xs=xs: [cpu_gemm.small_linear(x, w) for x, w in zip(xs, weights, strict=True)]
        for i in (0, 2, 3, len(weights) - 1):  # correctness on each distinct shape
            ref = torch.ops.mkldnn._linear_pointwise(xs[i], packed[i].onednn, None, "none", [], "").float()
            for name, got in (("amx", cpu_gemm.amx_linear(xs[i], weights[i], packed[i].amx) if has_amx else None),
                              ("stream", cpu_gemm.small_linear(xs[i], weights[i]) if m <= STREAM_MAX_M else None)):
                if got is not None and (got.float() - ref).abs().max().item() > 0.02 * max(1.0, ref.abs().max().item()):
                    raise AssertionError(f"{name} kernel differs from oneDNN at M={m}, shape {tuple(weights[i].shape)}")
        best = dict.fromkeys(fns, float("inf"))
        for _ in range(reps):
            for name, fn in fns.items():
                t0 = time.perf_counter()
                fn()
                best[name] = min(best[name], time.perf_counter() - t0)
        row = {"m": m, **{f"{k}_ms": v * 1e3 for k, v in best.items()},
               **{f"{k}_gbps": total_bytes / v / 1e9 for k, v in best.items()}}
        row["onednn_over_amx"] = best["onednn"] / best["amx"] if has_amx else None
        results.append(row)
    other = monitor.other_fraction()
    print("| M | oneDNN ms | AMX ms | stream ms | read limit ms | oneDNN / AMX | AMX GB/s | oneDNN GB/s |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        def cell(key: str, spec: str, suffix: str = "", r: dict = r) -> str:
            return "-" if r.get(key) is None else format(r[key], spec) + suffix

        print(f"| {r['m']} | {cell('onednn_ms', '.2f')} | {cell('amx_ms', '.2f')} | {cell('stream_ms', '.2f')} | "
              f"{cell('read_ms', '.2f')} | {cell('onednn_over_amx', '.2f', 'x')} | {cell('amx_gbps', '.1f')} | "
              f"{cell('onednn_gbps', '.1f')} |")
    print(f"other processes used {100 * other:.0f}% of the machine's CPU time during the run; "
          f"cpu_gemm.AMX_M_MAX = {cpu_gemm.AMX_M_MAX}, SMALL_M_MAX = {cpu_gemm.SMALL_M_MAX}")
    print(json.dumps({"rows": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}
                               for r in results], "threads": args.threads, "reps": reps, "layers": args.layers,
                      "amx_m_max": cpu_gemm.AMX_M_MAX, "small_m_max": cpu_gemm.SMALL_M_MAX,
                      "other_cpu_fraction": round(other, 3)}))


if __name__ == "__main__":
    main()
