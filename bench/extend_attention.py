"""Prefill (extend) attention: the native paged kernel (`tokenloom/kernels/extend_attention.py`, the `cpu`
backend's extend path) against what the `torch_native` backend runs for the same step (each request's K/V
gathered from the pool with `index_select`, then torch's SDPA: `is_causal` without a cached prefix, else a
causal-with-prefix boolean mask), side by side in one process, alternating, median of `--rounds`.

Part 1, the attention call alone, one layer's worth per call, at SmolLM2-135M's shape (9 query heads, 3 KV
heads, head_dim 64) and a Llama-3.2-1B's (32 / 8 / 64): 8 prompts of 256 tokens (workload (e)'s prefill
chunks), one 2048-token prompt, 2048 new tokens on a 2048-token cached prefix (chunked prefill), 512 on
3584, and few new tokens on a long prefix (16 on 4096; eight requests of one token on 4096 each: an extend
step's decoding rows, jump-forward's few tokens), where packing the K/V weighs most. GFLOP/s counts the causal
multiply-adds actually needed (2 x 2 x heads x dim per query-key pair seen).
`--paths` also times each of the kernel's arithmetic paths (1: AVX512-BF16 dot products, 2: float32 FMAs;
by default the kernel picks one per CPU).

Part 2 (`--model`, on by default): the default model's prefill through two `ModelRunner`s in this process
(the default GGUF, bf16 activations), one with `--attention-backend cpu` (native extend), one with
`torch_native`: 8 x 256 tokens and one 2048-token prompt, whole forward (matmuls included).

    .venv/bin/python bench/extend_attention.py            # both parts
    .venv/bin/python bench/extend_attention.py --quick    # fewer rounds, smaller cases

The last line of stdout is one JSON object. Set `ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16
MKL_ENABLE_INSTRUCTIONS=AVX512` on a CPU with AMX to keep torch's SDPA off the tile unit (as the issue's
CPUs have none); the script records whether they were set.
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

from tokenloom.kernels import extend_attention  # noqa: E402
from tokenloom.layers.attention.torch_native import _sdpa  # noqa: E402

SHAPES = {"smollm2": (9, 3, 64), "llama-1b": (32, 8, 64)}
CASES = {"8x256": [(0, 256)] * 8, "1x2048": [(0, 2048)], "2048+2048": [(2048, 2048)], "3584+512": [(3584, 512)],
         "4096+16": [(4096, 16)], "8x(4096+1)": [(4096, 1)] * 8}
QUICK_CASES = {"8x256": [(0, 256)] * 8, "1x1024": [(0, 1024)], "1024+512": [(1024, 512)]}


def make_case(heads: int, kv_heads: int, dim: int, requests: list[tuple[int, int]], seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    rows = sum(p + n for p, n in requests) + 16
    k = torch.randn(kv_heads, rows, dim, generator=g).bfloat16()
    v = torch.randn(kv_heads, rows, dim, generator=g).bfloat16()
    slots = torch.randperm(rows, generator=g)
    indptr, starts, lens = [0], [], []
    for prefix, new in requests:
        indptr.append(indptr[-1] + prefix + new)
        starts.append(sum(lens))
        lens.append(new)
    q = torch.randn(sum(lens), heads, dim, generator=g).bfloat16()
    flops = sum(2 * 2 * heads * dim * (new * prefix + new * (new + 1) / 2) for prefix, new in requests)
    return dict(q=q, k=k, v=v, indptr=torch.tensor(indptr), indices=slots[:indptr[-1]].clone(),
                starts=torch.tensor(starts), lens=torch.tensor(lens), requests=requests, flops=flops, dim=dim)


def run_native(c: dict) -> torch.Tensor:
    return extend_attention.extend(c["q"], c["k"], c["v"], c["indptr"], c["indices"], c["starts"], c["lens"],
                                   c["dim"] ** -0.5)


def run_torch(c: dict) -> torch.Tensor:
    """torch_native's per-request extend path (`TorchNativeBackend._extend_per_request`), masks built here."""
    q, k_buf, v_buf, dim = c["q"], c["k"], c["v"], c["dim"]
    kv_heads, heads = k_buf.shape[0], q.shape[1]
    group = heads // kv_heads
    out = q.new_empty(q.shape[0], heads * dim)
    bounds = c["indptr"].tolist()
    for b, (prefix, new) in enumerate(c["requests"]):
        slots = c["indices"][bounds[b]:bounds[b + 1]]
        k_r, v_r = k_buf.index_select(1, slots).unsqueeze(0), v_buf.index_select(1, slots).unsqueeze(0)
        start = int(c["starts"][b])
        q_r = q[start:start + new]
        if prefix == 0:
            o = _sdpa(q_r.transpose(0, 1).unsqueeze(0), k_r, v_r, is_causal=True, scale=dim ** -0.5,
                      enable_gqa=True)
            out[start:start + new] = o[0].transpose(0, 1).reshape(new, heads * dim)
            continue
        q_pos = (prefix + torch.arange(new).repeat_interleave(group))[:, None]
        mask = torch.arange(prefix + new)[None, :] <= q_pos
        q_g = q_r.view(new, kv_heads, group, dim).permute(1, 0, 2, 3).reshape(1, kv_heads, new * group, dim)
        o = _sdpa(q_g, k_r, v_r, attn_mask=mask, scale=dim ** -0.5)
        out[start:start + new] = o.view(kv_heads, new, group, dim).permute(1, 0, 2, 3).reshape(new, heads * dim)
    return out


def timed(fn, reps: int) -> float:
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def alternate(fns: dict, rounds: int, reps: int) -> dict[str, float]:
    """Median seconds per call of each function, rounds alternating between them."""
    for fn in fns.values():
        fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            samples[name].append(timed(fn, reps))
    return {name: statistics.median(s) for name, s in samples.items()}


def kernel_part(args: argparse.Namespace) -> list[dict]:
    cases = QUICK_CASES if args.quick else CASES
    auto = extend_attention.path()
    rows = []
    print(f"| shape | case | native ms | torch ms | torch / native | native GFLOP/s | torch GFLOP/s |"
          f"{' path 1 ms | path 2 ms |' if args.paths else ''}")
    print(f"|---|---|---:|---:|---:|---:|---:|{'---:|---:|' if args.paths else ''}")
    for shape, (heads, kv_heads, dim) in SHAPES.items():
        for name, requests in cases.items():
            c = make_case(heads, kv_heads, dim, requests)
            err = (run_native(c).float() - run_torch(c).float()).abs().max().item()
            fns = {"native": lambda c=c: run_native(c), "torch": lambda c=c: run_torch(c)}
            if args.paths:
                for p in (1, 2):
                    fns[f"path{p}"] = lambda c=c, p=p: (extend_attention.path(p), run_native(c),
                                                        extend_attention.path(auto))
            t = alternate(fns, args.rounds, args.reps)
            row = dict(shape=shape, case=name, native_ms=t["native"] * 1e3, torch_ms=t["torch"] * 1e3,
                       ratio=t["torch"] / t["native"], native_gflops=c["flops"] / t["native"] / 1e9,
                       torch_gflops=c["flops"] / t["torch"] / 1e9, max_abs_diff=err)
            extra = ""
            if args.paths:
                row.update(path1_ms=t["path1"] * 1e3, path2_ms=t["path2"] * 1e3)
                extra = f" {row['path1_ms']:.2f} | {row['path2_ms']:.2f} |"
            rows.append(row)
            print(f"| {shape} | {name} | {row['native_ms']:.2f} | {row['torch_ms']:.2f} | {row['ratio']:.2f}x | "
                  f"{row['native_gflops']:.0f} | {row['torch_gflops']:.0f} |{extra}", flush=True)
    extend_attention.path(0)
    return rows


def model_part(args: argparse.Namespace) -> list[dict]:
    from bench.forward_engines import TokenloomEngine

    threads = torch.get_num_threads()
    engines = {name: TokenloomEngine("bfloat16", 8192, 16, threads, attention_backend=backend)
               for name, backend in (("native", "cpu"), ("torch", "torch_native"))}
    assert engines["native"].runner.attn_backend.native_extend, "the cpu backend did not take the native kernel"
    points = [(8, 256), (1, 1024)] if args.quick else [(8, 256), (1, 2048)]
    rows = []
    print("\n| prefill | native (cpu backend) ms | torch_native ms | torch / native |")
    print("|---|---:|---:|---:|")
    for batch, length in points:
        fns = {name: lambda e=e, b=batch, n=length: e.prefill(b, n) for name, e in engines.items()}
        t = alternate(fns, args.rounds, 1)
        row = dict(batch=batch, length=length, native_ms=t["native"] * 1e3, torch_ms=t["torch"] * 1e3,
                   ratio=t["torch"] / t["native"])
        rows.append(row)
        print(f"| {batch} x {length} | {row['native_ms']:.1f} | {row['torch_ms']:.1f} | {row['ratio']:.2f}x |",
              flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--reps", type=int, default=3, help="calls per round in part 1")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--paths", action="store_true", help="time each arithmetic path too")
    p.add_argument("--no-model", dest="model", action="store_false", help="skip part 2")
    args = p.parse_args()
    if args.quick:
        args.rounds, args.reps = min(args.rounds, 3), 1
    if not extend_attention.available(torch.bfloat16, 3, 64):
        raise SystemExit("the native extend attention kernel is not available on this machine")
    print(f"threads {torch.get_num_threads()}, kernel path {extend_attention.path()} (1 AVX512-BF16 dot products, "
          f"2 float32 FMAs), median of {args.rounds} alternating rounds")
    result = dict(bench="extend_attention", threads=torch.get_num_threads(), path=extend_attention.path(),
                  library_isa={k: os.environ.get(k) for k in ("ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")},
                  kernel=kernel_part(args))
    if args.model:
        result["prefill"] = model_part(args)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
