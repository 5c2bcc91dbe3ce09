"""GGUF-quantized linear layers (csrc/quant_gemm.c through `quant_gemm.linear`) against the bf16 path tokenloom
uses for dequantized GGUFs today (`cpu_gemm.linear` on a weight packed once: the AMX kernel or the streaming
kernel for a few rows, oneDNN's packed matmul otherwise).

Per weight shape (SmolLM2-135M's 576x576, 192x576, 1536x576, 3072x576 (gate+up), 576x1536, the vocab 49152x576,
and a 1B model's 2048x2048, 8192x2048, 2048x8192) and rows M, both paths run on the same random weight
(random GGUF blocks; the bf16 copy is their exact dequantize rounded to bf16), alternating, `--rounds` rounds
of enough calls for ~`--round-ms`; the median round gives the time per call. Printed per case: both times,
bf16 / quant (above 1: the quantized kernel is faster), and the GFLOP/s of each (2 M N K per call; the
JSON also has the GB/s of weight bytes each moves). `--tile` times the dequantized bf16 tile path too (the
many-row int8 path off) in the same rounds. `--copies N` cycles through N copies of every weight so that
a call reads it from memory rather than cache (the m=1 bandwidth case).
`--small-m N` overrides the kernel's small int8 stream's row limit (0: never), `--batch-m N` the rows from
which the many-row int8 path runs (0: never) and `--tile-m N` the rows from which the bf16 tile takes over
from it again (0: never; by default 16 on CPUs whose vdpbf16ps keeps pace with vpdpbusd), to measure the
crossovers; `--int8` times the many-row int8 path at every row count past the small stream in the same
rounds; `--pairs-ab` the small path with each row's two int8 terms kept apart past one row. `--clock cpu`
times this process's CPU time instead of wall time: on a machine shared with other work, at --threads 1, it
leaves out the time other processes held the core. Timings are noisy on a shared
machine: read the ratios.
The last line of stdout is one JSON object.

Usage:
    python bench/quant_gemm.py                      # Q4_1 and Q8_0, all shapes, M = 1..256
    python bench/quant_gemm.py --types Q4_0 --rows 1,64 --shapes 576x576,49152x576
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import CpuMonitor, _cpu_name
from tokenloom.kernels import quant_gemm as qg
from tokenloom.layers import cpu_gemm

SHAPES = ["576x576", "192x576", "1536x576", "3072x576", "576x1536", "49152x576", "2048x2048", "8192x2048",
          "2048x8192"]


def random_matrix(qtype: int, n: int, k: int, seed: int) -> qg.QuantMatrix:
    """Random GGUF blocks: random quant bytes, f16 scales (and Q4_1 mins) of a plausible size."""
    _, block, size = qg.QUANT_TYPES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n, k // block, size), dtype=np.uint8)
    scales = 2 if qtype == qg.TYPE_IDS["Q4_1"] else 1 if block == 32 else 0
    for f in range(scales):  # d (and m) fields: f16 in +-[1e-3, 1e-2]
        val = (rng.uniform(1e-3, 1e-2, size=(n, k // block)) * rng.choice([-1, 1], size=(n, k // block)))
        blocks[:, :, 2 * f:2 * f + 2] = val.astype(np.float16).view(np.uint8).reshape(n, k // block, 2)
    # k-quants' f16 super-block scales (Q4_K/Q5_K: d, dmin at bytes 0-3; Q6_K: d at bytes 208-209): random
    # bytes there would be NaN or huge now and then
    for off in ((0, 2) if size in (144, 176) else (208,) if size == 210 else ()):
        val = rng.uniform(1e-4, 1e-3, size=(n, k // block)).astype(np.float16)
        blocks[:, :, off:off + 2] = val.view(np.uint8).reshape(n, k // block, 2)
    return qg.QuantMatrix(qtype, n, k, torch.from_numpy(blocks.reshape(n, -1)))


def time_pair(fns: dict[str, Callable[[], object]], rounds: int, round_ms: float,
              clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """Median seconds per call of each function, rounds alternating between them."""
    for fn in fns.values():
        fn()
    calls = {}
    for name, fn in fns.items():  # calls per round: ~round_ms of work
        t0 = clock()
        fn()
        calls[name] = max(1, int(round_ms / 1e3 / max(clock() - t0, 1e-6)))
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = clock()
            for _ in range(calls[name]):
                fn()
            samples[name].append((clock() - t0) / calls[name])
    return {name: statistics.median(v) for name, v in samples.items()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--types", default="Q4_1,Q8_0")
    p.add_argument("--shapes", default=",".join(SHAPES), help="comma list of NxK")
    p.add_argument("--rows", default="1,2,4,8,16,64,256")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--round-ms", type=float, default=40.0)
    p.add_argument("--copies", type=int, default=1, help="weight copies cycled through (memory-resident reads)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="cpu: this process's CPU time (meaningful at --threads 1 on a loaded machine)")
    p.add_argument("--small-m", type=int, default=None, help="override the int8 path's row limit")
    p.add_argument("--batch-m", type=int, default=None,
                   help="override the rows from which the many-row int8 path runs (0: never)")
    p.add_argument("--tile-m", type=int, default=None,
                   help="override the rows from which the bf16 tile takes over from the int8 path (0: never)")
    p.add_argument("--int8", action="store_true",
                   help="also time the many-row int8 path (the tile never taking over) in the same rounds")
    p.add_argument("--tile", action="store_true",
                   help="also time the bf16 tile path (the many-row int8 path off) in the same rounds")
    p.add_argument("--prefetch", type=int, default=None,
                   help="the kernels' software prefetch distance in tiles (default: the library's; 0: off)")
    p.add_argument("--seq-m", type=int, default=None,
                   help="override the activation rows (both int8 terms counted) up to which the small-row kernels "
                        "read each weight row whole in turn (0: never, the row tiles)")
    p.add_argument("--seq-ab", action="store_true",
                   help="also time the small-row kernels with the row tiles instead of the row-sequential stream")
    p.add_argument("--prefetch-ab", action="store_true",
                   help="also time the quantized kernel with its software prefetch off, in the same rounds")
    p.add_argument("--prefetch-l1-ab", action="store_true",
                   help="also time the quantized kernel with its software prefetch filling L1 instead of L2, "
                        "in the same rounds")
    p.add_argument("--pairs-ab", action="store_true",
                   help="also time the small path with each row's two int8 terms apart past one row "
                        "(quant_act_pairs(1): before batched decode's pair tiles), in the same rounds")
    p.add_argument("--i8-tile-ab", action="store_true",
                   help="AVX2: also time the float32 tile with the one-term int8 tile off, in the same rounds")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    lib = qg._native()
    if lib is None:
        sys.exit("the native quantized kernels are not built on this machine")
    if args.small_m is not None:
        lib.quant_small_m(ctypes.c_int(args.small_m))
    small_m = lib.quant_small_m(ctypes.c_int(-1))
    if args.batch_m is not None:
        lib.quant_batch_m(ctypes.c_int(args.batch_m))
    batch_m = lib.quant_batch_m(ctypes.c_int(-1))
    if args.tile_m is not None:
        lib.quant_tile_m(ctypes.c_int(args.tile_m))
    tile_m = lib.quant_tile_m(ctypes.c_int(-1))
    lib.quant_bf16_dot_cost.restype = ctypes.c_double
    dot_cost = lib.quant_bf16_dot_cost()  # vdpbf16ps time over vpdpbusd's on this core

    if args.prefetch is not None:
        lib.quant_prefetch(ctypes.c_int(args.prefetch))
    prefetch = lib.quant_prefetch(ctypes.c_int(-1))
    if args.seq_m is not None:
        lib.quant_seq_m(ctypes.c_int(args.seq_m))
    seq_m = lib.quant_seq_m(ctypes.c_int(-1))

    def linear_with(setter: Callable[[ctypes.c_int], int], value: int, default: int) -> Callable:
        """`qg.linear` with one of the library's settings at `value` for the call, then back to `default`."""
        def run(x: torch.Tensor, q: qg.QuantMatrix) -> torch.Tensor:
            setter(ctypes.c_int(value))
            try:
                return qg.linear(x, q)
            finally:
                setter(ctypes.c_int(default))
        return run

    unprefetched_linear = linear_with(lib.quant_prefetch, 0, prefetch)  # the software prefetch off
    prefetch_l2 = lib.quant_prefetch_l2(ctypes.c_int(-1))
    l1_prefetch_linear = linear_with(lib.quant_prefetch_l2, 0, prefetch_l2)  # the prefetch filling L1
    tiled_linear = linear_with(lib.quant_seq_m, 0, seq_m)  # the row tiles instead of the row-sequential stream
    tile_linear = linear_with(lib.quant_batch_m, 0, batch_m)  # the many-row int8 path off: the bf16 tile
    int8_linear = linear_with(lib.quant_tile_m, 0, tile_m)  # the many-row int8 path wherever it applies
    i8_tile_m = lib.quant_i8_tile_m(ctypes.c_int(-1))
    f32_tile_linear = linear_with(lib.quant_i8_tile_m, 0, i8_tile_m)  # AVX2: the one-term int8 tile off
    act_pairs = lib.quant_act_pairs(ctypes.c_int(-1))
    one_row_pairs_linear = linear_with(lib.quant_act_pairs, 1, act_pairs)  # pairs at one row only

    rows = [int(r) for r in args.rows.split(",")]
    gen = torch.Generator().manual_seed(0)
    print(f"machine: {_cpu_name()}, {os.cpu_count()} CPUs, torch {torch.__version__}, {args.threads} threads; "
          f"int8 path for M <= {small_m} (row-sequential stream to {seq_m} int8 rows), "
          f"many-row int8 path from M = {batch_m} (0: off), bf16 tile again from M = "
          f"{tile_m} (0: never; a vdpbf16ps costs {dot_cost:.2f} vpdpbusd here); "
          f"{args.copies} weight "
          f"copies; median of {args.rounds} alternating rounds, "
          f"{args.clock} clock")
    print("| type | N x K | M | quant ms | bf16 ms | bf16 / quant | quant GFLOP/s | bf16 GFLOP/s | tile GFLOP/s "
          "| int8 GFLOP/s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    monitor = CpuMonitor()
    results = []
    for tname in args.types.split(","):
        qtype = qg.TYPE_IDS[tname]
        for shape in args.shapes.split(","):
            n, k = (int(v) for v in shape.split("x"))
            qms = [qg.prepare(random_matrix(qtype, n, k, seed)) for seed in range(args.copies)]
            ws = [qg.dequantize(q).to(torch.bfloat16) for q in qms]
            packs = [cpu_gemm.pack_weight(w) for w in ws]
            for m in rows:
                x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
                got = qg.linear(x, qms[0], out_dtype=torch.float32)
                ref = x.float() @ ws[0].float().T
                if float((got - ref).norm() / ref.norm()) > 0.03:
                    raise AssertionError(f"{tname} {shape} M={m}: quantized result off by "
                                         f"{float((got - ref).norm() / ref.norm()):.3g} (relative)")
                fns = {
                    "quant": lambda x=x, qms=qms: [qg.linear(x, q) for q in qms],
                    "bf16": lambda x=x, ws=ws, packs=packs: [cpu_gemm.linear(x, w, pk)
                                                             for w, pk in zip(ws, packs, strict=True)],
                }
                if args.int8:
                    fns["int8"] = lambda x=x, qms=qms: [int8_linear(x, q) for q in qms]
                if args.tile:
                    fns["tile"] = lambda x=x, qms=qms: [tile_linear(x, q) for q in qms]
                if args.seq_ab:
                    fns["rowtiles"] = lambda x=x, qms=qms: [tiled_linear(x, q) for q in qms]
                if args.prefetch_ab:
                    fns["noprefetch"] = lambda x=x, qms=qms: [unprefetched_linear(x, q) for q in qms]
                if args.i8_tile_ab:
                    fns["f32tile"] = lambda x=x, qms=qms: [f32_tile_linear(x, q) for q in qms]
                if args.pairs_ab:
                    fns["apart"] = lambda x=x, qms=qms: [one_row_pairs_linear(x, q) for q in qms]
                if args.prefetch_l1_ab:
                    fns["l1prefetch"] = lambda x=x, qms=qms: [l1_prefetch_linear(x, q) for q in qms]
                best = time_pair(fns, args.rounds, args.round_ms,
                                 time.process_time if args.clock == "cpu" else time.perf_counter)
                tq, tb = best["quant"] / args.copies, best["bf16"] / args.copies
                flop = 2.0 * m * n * k
                row = {"type": tname, "n": n, "k": k, "m": m, "quant_ms": tq * 1e3, "bf16_ms": tb * 1e3,
                       "speedup": tb / tq, "quant_gbps": qms[0].nbytes / tq / 1e9,
                       "bf16_gbps": ws[0].numel() * 2 / tb / 1e9, "quant_gflops": flop / tq / 1e9,
                       "bf16_gflops": flop / tb / 1e9}
                if args.int8:
                    row["int8_gflops"] = flop / (best["int8"] / args.copies) / 1e9
                if args.tile:
                    row["tile_gflops"] = flop / (best["tile"] / args.copies) / 1e9
                if args.seq_ab:
                    row["rowtiles_ms"] = best["rowtiles"] / args.copies * 1e3
                if args.prefetch_ab:
                    row["noprefetch_ms"] = best["noprefetch"] / args.copies * 1e3
                if args.prefetch_l1_ab:
                    row["l1prefetch_ms"] = best["l1prefetch"] / args.copies * 1e3
                if args.i8_tile_ab:
                    row["f32tile_ms"] = best["f32tile"] / args.copies * 1e3
                if args.pairs_ab:
                    row["apart_ms"] = best["apart"] / args.copies * 1e3
                results.append(row)
                print(f"| {tname} | {n}x{k} | {m} | {row['quant_ms']:.3f} | {row['bf16_ms']:.3f} | "
                      f"{row['speedup']:.2f}x | {row['quant_gflops']:.1f} | {row['bf16_gflops']:.1f} | "
                      f"{row.get('tile_gflops', float('nan')):.1f} | {row.get('int8_gflops', float('nan')):.1f} |"
                      + (f" row tiles {row['rowtiles_ms']:.3f} ms ({row['rowtiles_ms'] / row['quant_ms']:.2f}x)"
                         if args.seq_ab else "")
                      + (f" prefetch off {row['noprefetch_ms']:.3f} ms ({row['noprefetch_ms'] / row['quant_ms']:.2f}x)"
                         if args.prefetch_ab else "")
                      + (f" to L1 {row['l1prefetch_ms']:.3f} ms ({row['l1prefetch_ms'] / row['quant_ms']:.2f}x)"
                         if args.prefetch_l1_ab else "")
                      + (f" float32 tile {row['f32tile_ms']:.3f} ms ({row['f32tile_ms'] / row['quant_ms']:.2f}x)"
                         if args.i8_tile_ab else "")
                      + (f" terms apart {row['apart_ms']:.3f} ms ({row['apart_ms'] / row['quant_ms']:.2f}x)"
                         if args.pairs_ab else ""), flush=True)
    other = monitor.other_fraction()
    print(f"other processes used {100 * other:.0f}% of the machine's CPU time during the run")
    print(json.dumps({"rows": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}
                               for r in results], "threads": args.threads, "small_m": small_m,
                      "batch_m": batch_m, "tile_m": tile_m, "seq_m": seq_m, "i8_tile_m": i8_tile_m,
                      "bf16_dot_cost": round(dot_cost, 3), "copies": args.copies, "clock": args.clock,
                      "other_cpu_fraction": round(other, 3)}))


if __name__ == "__main__":
    main()
