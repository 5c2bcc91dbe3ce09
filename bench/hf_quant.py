"""Per-layer speed of the HF-checkpoint integer weights (tokenloom/layers/int_quant.py) against the bf16 path a
float checkpoint takes (`cpu_gemm.linear` on a weight packed once: AMX / streaming kernel for a few rows,
oneDNN's packed matmul otherwise).

Methods, each as a layer holds it (`QuantWeight.prepare` at bf16): bf16; int8wo and int4wo-128 re-expressed as
GGUF Q8_0 / Q4_1 blocks on the native quantized kernels where they run (GPTQ/AWQ checkpoints take the Q4_1
form too); w8a8_int8 (per-token int8 activations, `torch._int_mm`). `--torch-ops` adds the torch kernels
the integer weights ran before the blocks, side by side: "int8wo/torch" (`_weight_int8pack_mm` for <=
INT8PACK_MAX_ROWS rows, else a bf16 copy of the int8 weight and one matmul) and "int4wo-128/torch"
(`_weight_int4pack_mm_for_cpu`). Per shape and rows M every method runs on the same random weight,
alternating in each of `--rounds` rounds; the median round gives the time per call, and the table prints each
method's time and bf16 / method (above 1: faster than bf16). `--clock cpu` times this process's CPU time (on a
shared machine at --threads 1 it leaves out time other processes held the core).
The last line of stdout is one JSON object.

Usage:
    python bench/hf_quant.py --rows 1,64 --shapes 2048x2048,8192x2048 --threads 1 --clock cpu
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import CpuMonitor, _cpu_name
from tokenloom.layers import cpu_gemm
from tokenloom.layers.int_quant import quantize_for_method
from tokenloom.layers.quant_linear import QuantWeight

METHODS = ("int8wo", "int4wo-128", "w8a8_int8")
TORCH_OPS = ("int8wo/torch", "int4wo-128/torch")  # the same weights on torch's kernels (IntQuantMatrix.prepare)


def _time(fn: Callable[[], object], calls: int, clock: Callable[[], float]) -> float:
    start = clock()
    for _ in range(calls):
        fn()
    return (clock() - start) / calls


def bench_case(n: int, k: int, m: int, rounds: int, round_ms: float, clock: Callable[[], float],
               methods: tuple[str, ...]) -> dict:
    w = (torch.randn(n, k) * 0.02).to(torch.bfloat16)
    x = torch.randn(m, k).to(torch.bfloat16)
    packed = cpu_gemm.pack_weight(w)
    fns: dict[str, Callable[[], object]] = {"bf16": lambda: cpu_gemm.linear(x, w, packed)}
    for method in methods:
        if method.endswith("/torch"):
            qm = quantize_for_method(w, method.removesuffix("/torch")).prepare(torch.bfloat16)
        else:
            qm = QuantWeight.from_parts([quantize_for_method(w, method)])
            qm.prepare(torch.bfloat16)
        fns[method] = lambda qm=qm: qm.linear(x, None, torch.bfloat16)
    calls = {}
    for name, fn in fns.items():
        fn()  # warm-up
        one = _time(fn, 1, time.perf_counter)
        calls[name] = max(1, int(round_ms / 1e3 / max(one, 1e-7)))
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            samples[name].append(_time(fn, calls[name], clock))
    med = {name: statistics.median(v) * 1e6 for name, v in samples.items()}
    return {"n": n, "k": k, "m": m, "us": {k_: round(v, 1) for k_, v in med.items()},
            "bf16_over": {k_: round(med["bf16"] / v, 2) for k_, v in med.items() if k_ != "bf16"}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="2048x2048,8192x2048,2048x8192", help="NxK weight shapes")
    ap.add_argument("--rows", default="1,64")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--round-ms", type=float, default=100.0)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    ap.add_argument("--torch-ops", action="store_true", help="also time the torch kernels (see above)")
    args = ap.parse_args()
    methods = METHODS + (TORCH_OPS if args.torch_ops else ())
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    monitor = CpuMonitor()
    results = []
    print(f"{'N x K':>12} {'M':>4} {'bf16 us':>9} " + " ".join(f"{m + ' us':>18} {'x':>5}" for m in methods))
    for shape in args.shapes.split(","):
        n, k = map(int, shape.split("x"))
        for m in map(int, args.rows.split(",")):
            r = bench_case(n, k, m, args.rounds, args.round_ms, clock, methods)
            results.append(r)
            cols = " ".join(f"{r['us'][name]:>18.0f} {r['bf16_over'][name]:>5.2f}" for name in methods)
            print(f"{shape:>12} {m:>4} {r['us']['bf16']:>9.0f} {cols}", flush=True)
    print(json.dumps({"cpu": _cpu_name(), "threads": args.threads, "clock": args.clock,
                      "other_load": round(monitor.other_fraction(), 2), "results": results}))


if __name__ == "__main__":
    main()
