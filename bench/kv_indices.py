"""KV-index building benchmark (issue 7): `build_kv_indices` against a per-request loop and the copy limit.

For each batch size and length distribution, in one run, times (best of `--reps`; (b) and (c) interleaved rep
by rep, (a) in rounds of its own right after them):

* (a) loop: the per-request Python loop, `torch.cat` of the row slices `req_to_token[row, :len]`, widened to
  int64 (what a non-vectorized step preparation does),
* (b) torch: `build_kv_indices(backend="torch")`, the vectorized torch path (the CPU fallback),
* (b') native: `build_kv_indices(backend="native")`, the C kernel (a widening copy per request; the CPU default
  when the kernel library builds, else "-"),
* (c) copy: the memory-copy limit of the same bytes, `src.to(torch.int64)` of a contiguous int32 tensor with
  as many elements as the result: it reads the 4 bytes/element the answer is made of, writes 8 bytes/element
  into a fresh tensor (as `build_kv_indices` must), and does no index arithmetic or gathering,
* (d) triton: the Triton kernel on CUDA (with the copy limit measured there too) when CUDA and triton are
  available; otherwise its column shows "-" and a note says why.

Request lengths are uniform random in [1, max-len] for each `--max-lens` value: 4096 (the issue's "context up
to 4096") and 160 (short chat-like requests: input 20-32, output 128). `req_to_token` is [batch + 64, 4096] int32
filled with random slot ids (no untouched pages), requests sit in random rows, `kv_start` is not used (the
decode case). Best-of is the figure least disturbed by other processes. One torch thread by default (the
gather in (b) is single-threaded in torch; (c) would otherwise get both cores).

Usage:
    python bench/kv_indices.py            # batch 256/1024/4096 x max-len 160/4096, ~20 s
    python bench/kv_indices.py --quick    # batch 256 and 4096, fewer reps
    python bench/kv_indices.py --batch-sizes 4096 --max-lens 4096 --reps 20

Targets (issue 7), at batch 4096: the CPU path within 3x of the copy limit and at least 20x faster than the loop
(checked for both the torch path and the native kernel).
The last line of stdout is one JSON object with every configuration's figures and the targets.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import CpuMonitor, _cpu_name
from tokenloom.device import resolve_device, synchronize
from tokenloom.layers.kv_indices import build_kv_indices, native_kv_index_builder

CONTEXT = 4096  # req_to_token row width (max context)
EXTRA_ROWS = 64  # free rows in the table, so requests do not cover it exactly


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def loop_kv_indices(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                    kv_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-request reference: one slice per request, concatenated."""
    kv_indptr = torch.zeros(kv_lens.numel() + 1, dtype=torch.int64)
    torch.cumsum(kv_lens, 0, out=kv_indptr[1:])
    slices = [req_to_token[r, :n] for r, n in zip(req_pool_indices.tolist(), kv_lens.tolist(), strict=True)]
    return kv_indptr, torch.cat(slices).to(torch.int64)


def make_case(batch: int, max_len: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    rows = batch + EXTRA_ROWS
    table = torch.randint(1, 1 << 30, (rows, CONTEXT), dtype=torch.int32, generator=gen)
    req = torch.randperm(rows, generator=gen)[:batch]
    lens = torch.randint(1, max_len + 1, (batch,), generator=gen)
    return table, req, lens


def best_of(fns: dict[str, Callable[[], object]], reps: int, sync: Callable[[], None]) -> dict[str, float]:
    """Best wall time (ms) of each function over `reps` rounds, the functions interleaved within a round."""
    for fn in fns.values():  # warm-up (allocator, first-call dispatch, Triton compile)
        fn()
    sync()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            sync()
            best[name] = min(best[name], (time.perf_counter() - t0) * 1e3)
    return best


def cuda_device() -> torch.device | None:
    """CUDA device when both CUDA and triton are usable, else None."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return None
    try:
        return resolve_device("cuda")
    except RuntimeError:
        return None


def run_config(batch: int, max_len: int, reps: int, seed: int, cuda: torch.device | None) -> dict:
    table, req, lens = make_case(batch, max_len, seed)
    total = int(lens.sum())
    src = torch.randint(1, 1 << 30, (total,), dtype=torch.int32, generator=torch.Generator().manual_seed(seed))
    want_ptr, want = loop_kv_indices(table, req, lens)
    backends = ["torch"] + (["native"] if native_kv_index_builder() is not None else [])
    for backend in backends:
        got_ptr, got = build_kv_indices(table, req, lens, backend=backend)
        if not (torch.equal(want_ptr, got_ptr) and torch.equal(want, got)):
            raise AssertionError(f"{backend} path differs from the loop at batch {batch}, max-len {max_len}")
    # The loop gets rounds of its own: interleaved with it, the torch path measured up to 1.4x slower (its
    # thousands of slices evict the table and the allocator's free memory between the torch path's calls).
    fns = {b: (lambda b=b: build_kv_indices(table, req, lens, backend=b)) for b in backends}
    cpu = best_of(fns | {"copy": lambda: src.to(torch.int64)}, reps, lambda: None)
    cpu |= best_of({"loop": lambda: loop_kv_indices(table, req, lens)}, reps, lambda: None)
    native = cpu.get("native")
    row = {"batch": batch, "max_len": max_len, "total": total, "loop_ms": cpu["loop"], "torch_ms": cpu["torch"],
           "native_ms": native, "copy_ms": cpu["copy"], "torch_over_copy": cpu["torch"] / cpu["copy"],
           "loop_over_torch": cpu["loop"] / cpu["torch"],
           "native_over_copy": None if native is None else native / cpu["copy"],
           "loop_over_native": None if native is None else cpu["loop"] / native,
           "triton_ms": None, "cuda_copy_ms": None}
    if cuda is not None:
        t, r, n, s = table.to(cuda), req.to(cuda), lens.to(cuda), src.to(cuda)
        ptr, idx = build_kv_indices(t, r, n, total=total, backend="triton")
        if not (torch.equal(ptr.cpu(), want_ptr) and torch.equal(idx.cpu(), want)):
            raise AssertionError(f"Triton kernel differs from the loop at batch {batch}, max-len {max_len}")
        gpu = best_of({"triton": lambda: build_kv_indices(t, r, n, total=total, backend="triton"),
                       "copy": lambda: s.to(torch.int64)}, reps, lambda: synchronize(cuda))
        row["triton_ms"], row["cuda_copy_ms"] = gpu["triton"], gpu["copy"]
    return row


def _cell(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def print_table(rows: list[dict]) -> None:
    print("| batch | lengths | total | loop ms | torch ms | native ms | copy ms | triton ms (CUDA) | torch / copy "
          "| native / copy | loop / torch | loop / native |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        triton = "-" if r["triton_ms"] is None else f"{r['triton_ms']:.3f} (copy {r['cuda_copy_ms']:.3f})"
        print(f"| {r['batch']} | U[1, {r['max_len']}] | {r['total']:,} | {_cell(r['loop_ms'], '.2f')} | "
              f"{_cell(r['torch_ms'], '.3f')} | {_cell(r['native_ms'], '.3f')} | {_cell(r['copy_ms'], '.3f')} | "
              f"{triton} | {r['torch_over_copy']:.1f}x | {_cell(r['native_over_copy'], '.1f')}x | "
              f"{r['loop_over_torch']:.1f}x | {_cell(r['loop_over_native'], '.1f')}x |", flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="batch 256 and 4096, 4 reps")
    p.add_argument("--batch-sizes", type=_ints, default=None, help="comma list (default 256,1024,4096)")
    p.add_argument("--max-lens", type=_ints, default=[160, 4096],
                   help=f"comma list; lengths are uniform in [1, max-len], max-len <= {CONTEXT} (default 160,4096)")
    p.add_argument("--reps", type=int, default=None, help="timed reps per method and configuration (default 10)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    batch_sizes = args.batch_sizes or ([256, 4096] if args.quick else [256, 1024, 4096])
    reps = args.reps or (4 if args.quick else 10)
    if any(not 1 <= m <= CONTEXT for m in args.max_lens):
        p.error(f"--max-lens values must be in [1, {CONTEXT}]")
    torch.set_num_threads(args.threads)
    cuda = cuda_device()
    print(f"machine: {_cpu_name()}, {os.cpu_count()} CPUs, torch {torch.__version__}, {args.threads} thread(s); "
          f"req_to_token [batch + {EXTRA_ROWS}, {CONTEXT}] int32; best of {reps} reps")
    if cuda is None:
        print("triton: skipped (needs CUDA and the triton package; its correctness is tested on the CPU with "
              "TRITON_INTERPRET=1 in tests/unit/test_kv_indices_triton.py)")
    monitor = CpuMonitor()
    rows = [run_config(b, m, reps, args.seed, cuda) for m in args.max_lens for b in batch_sizes]
    other = monitor.other_fraction()
    print_table(rows)
    print(f"other processes used {100 * other:.0f}% of the machine's CPU time during the run")
    largest = max(batch_sizes)
    targets = {}
    for r in rows:
        if r["batch"] != largest:
            continue
        for path in ("torch", "native"):
            if r[f"{path}_ms"] is None:
                continue
            t = {"within_3x_copy": r[f"{path}_over_copy"] <= 3.0,
                 "20x_faster_than_loop": r[f"loop_over_{path}"] >= 20.0}
            targets[f"{path}_max_len_{r['max_len']}"] = t
            print(f"targets at batch {largest}, {path}, max-len {r['max_len']}: <= 3x copy: {t['within_3x_copy']}; "
                  f"loop / {path} >= 20x: {t['20x_faster_than_loop']}")
    rounded = [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()} for r in rows]
    print(json.dumps({"configs": rounded, "targets_batch": largest, "targets": targets,
                      "other_cpu_fraction": round(other, 3), "threads": args.threads, "reps": reps,
                      "cuda": cuda is not None}))


if __name__ == "__main__":
    main()
