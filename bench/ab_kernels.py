"""The quantized matmul kernels of two checkouts, side by side in one process: what a kernel change costs.

    .venv/bin/python bench/ab_kernels.py --base-dir /path/to/old/checkout
    .venv/bin/python bench/ab_kernels.py --base-dir ../old --types Q4_K,Q6_K --rows 1,4 --threads 2 --copies 12
    .venv/bin/python bench/ab_kernels.py --base-dir . --quick      # this tree against itself: a smoke test

Each checkout builds its own native kernel library (`tokenloom.kernels.cpu_build`, in a subprocess from that
checkout); both are loaded here (ctypes, symbols kept apart), each re-lays out its own copy of the same random
GGUF weights (`quant_repack`, as `prepare` does) and runs `quant_linear` on the same bf16 activations, the two
alternating round by round (who goes first alternates). Per case: each side's median time per call, the
median over rounds of the within-round ratio new / base (below 1: the new tree is faster) and the largest
difference between the two outputs (0: bit-identical). `--copies N` cycles through N copies of every weight so
that a call reads it from memory rather than cache. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.quant_gemm import random_matrix  # noqa: E402
from tokenloom.kernels import quant_gemm as qg  # noqa: E402

CALLS_PER_ROUND = 40


def build_library(checkout: Path) -> str:
    """The path of `checkout`'s kernels library, built (or found in the cache) by its own code."""
    code = "from tokenloom.kernels.cpu_build import load_library; print(load_library('kernels')._name)"
    env = dict(os.environ, PYTHONPATH=str(checkout))
    out = subprocess.run([sys.executable, "-c", code], cwd=checkout, env=env, capture_output=True, text=True,
                         check=True)
    return out.stdout.strip().splitlines()[-1]


def load(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    lib.quant_linear.restype = ctypes.c_int
    lib.quant_repack.restype = ctypes.c_int
    if hasattr(lib, "quant_packed_bytes"):
        lib.quant_packed_bytes.restype = ctypes.c_int64
        lib.quant_packed_bytes.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    return lib


def prepared_copies(lib: ctypes.CDLL, raws: list, n: int, k: int) -> list[torch.Tensor]:
    out = []
    for qm in raws:
        size = lib.quant_packed_bytes(qm.qtype, n, k) if hasattr(lib, "quant_packed_bytes") else qm.data.numel()
        data = torch.empty(size, dtype=torch.uint8)  # a tree before quant_packed_bytes: the file's size
        data[:qm.data.numel()] = qm.data.reshape(-1)
        rc = lib.quant_repack(qm.qtype, ctypes.c_void_p(data.data_ptr()), ctypes.c_int64(n), ctypes.c_int64(k))
        if rc != 0:
            raise RuntimeError(f"quant_repack failed ({rc})")
        out.append(data)
    return out


def measure(libs, qtype: int, datas, n: int, k: int, m: int, rounds: int, threads: int) -> dict:
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
    outs = [torch.empty(m, n, dtype=torch.bfloat16) for _ in libs]

    def call(side: int, copy: int) -> None:
        rc = libs[side].quant_linear(qtype, ctypes.c_void_p(datas[side][copy].data_ptr()), ctypes.c_int64(n),
                                     ctypes.c_int64(k), ctypes.c_void_p(x.data_ptr()), ctypes.c_int64(k), 0,
                                     ctypes.c_int64(m), None, 0, ctypes.c_void_p(outs[side].data_ptr()),
                                     ctypes.c_int64(n), 0, threads)
        if rc != 0:
            raise RuntimeError(f"quant_linear failed ({rc})")

    copies = len(datas[0])
    times: list[list[float]] = [[], []]
    for r in range(rounds):
        for side in ((0, 1) if r % 2 == 0 else (1, 0)):
            for c in range(copies):  # warm the side's code path (and, with one copy, its weight in cache)
                call(side, c)
            per_call = []
            for i in range(CALLS_PER_ROUND):
                start = time.perf_counter()
                call(side, i % copies)
                per_call.append(time.perf_counter() - start)
            times[side].append(statistics.median(per_call))
    return {"base_us": 1e6 * statistics.median(times[0]), "new_us": 1e6 * statistics.median(times[1]),
            "new_over_base": statistics.median([b / a for a, b in zip(times[0], times[1], strict=True)]),
            "max_abs_diff": float((outs[0].float() - outs[1].float()).abs().max())}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-dir", required=True, type=Path, help="the baseline checkout")
    ap.add_argument("--new-dir", type=Path, default=ROOT, help="the checkout measured against it (default: this)")
    ap.add_argument("--types", default="Q4_1,Q8_0,Q4_K,Q6_K")
    ap.add_argument("--rows", default="1,4")
    ap.add_argument("--shapes", default="576x576,1536x576,576x1536,2048x2048,2048x8192", help="comma list of NxK")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--copies", type=int, default=1, help="weight copies cycled through (memory-resident reads)")
    ap.add_argument("--quick", action="store_true", help="Q4_1 and Q4_K at 512x512, one row, one round")
    args = ap.parse_args(argv)
    if args.quick:
        args.types, args.shapes, args.rows, args.rounds = "Q4_1,Q4_K", "512x512", "1", 1
    libs = [load(build_library(args.base_dir.resolve())), load(build_library(args.new_dir.resolve()))]
    torch.set_num_threads(args.threads)
    rows = [int(v) for v in args.rows.split(",")]
    results = []
    print(f"quant_linear, {args.threads} thread(s), {args.copies} weight copies, median of {args.rounds} rounds: "
          f"base {args.base_dir} vs new {args.new_dir}")
    for name in args.types.split(","):
        qtype = qg.TYPE_IDS[name]
        block = 256 if qtype >= 12 else 32
        for shape in args.shapes.split(","):
            n, k = (int(v) for v in shape.split("x"))
            if k % block:
                continue
            raws = [random_matrix(qtype, n, k, seed) for seed in range(args.copies)]
            datas = [prepared_copies(lib, raws, n, k) for lib in libs]
            for m in rows:
                got = measure(libs, qtype, datas, n, k, m, args.rounds, args.threads)
                results.append({"type": name, "n": n, "k": k, "m": m, **got})
                print(f"{name} {n}x{k} m={m}: base {got['base_us']:.1f} us, new {got['new_us']:.1f} us, "
                      f"new/base {got['new_over_base']:.3f}, max diff {got['max_abs_diff']:.3g}", flush=True)
    report = {"bench": "ab_kernels", "threads": args.threads, "copies": args.copies, "rounds": args.rounds,
              "results": results}
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
