"""Paged decode attention against the KV layout: why the token allocator hands out decode slots in runs, and
what cascade decode (a shared prefix read once per group) saves.

The native kernel (`tokenloom/kernels/paged_attention.py`) reads each request's K/V rows through its slot
list. With page size 1, a decode step that gives every running request the next free slot interleaves the
requests' decode KV: consecutive tokens of one request sit a batch size apart. This times one decode step's
attention over all layers (each layer its own pool, so the KV does not stay in cache between layers) for
the same batch with the decode part of every request laid out (1) interleaved, (2) in runs of 16 slots
(`--decode-slot-run 16`, the default) and (3) fully contiguous; prompts are contiguous in all three.
Then the same batch as groups of `--members` requests sharing their first `--shared` prompt slots (the
generated-shared-prefix workload), decode KV in runs: without and with the step's shared-prefix plan.

    .venv/bin/python bench/attention_layout.py                # batch 64, prompt 256, 128 decoded tokens
    .venv/bin/python bench/attention_layout.py --batch 192 --decoded 64 --members 4 --shared 256

SmolLM2-135M's attention shape (9 query heads, 3 KV heads, head dim 64, 30 layers), bfloat16, torch's
thread count. Best of `--reps`. The last line is a JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tokenloom.kernels import paged_attention  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 9, 3, 64, 30


def decode_slots(layout: str, batch: int, decoded: int, base: int, run: int = 16) -> list[torch.Tensor]:
    step = torch.arange(decoded)
    if layout == "interleaved":
        return [base + step * batch + i for i in range(batch)]
    if layout == "runs":
        return [base + (step // run) * (batch * run) + i * run + step % run for i in range(batch)]
    return [base + i * decoded + step for i in range(batch)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--decoded", type=int, default=128)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--members", type=int, default=4, help="requests per shared-prefix group")
    p.add_argument("--shared", type=int, default=192, help="leading prompt slots a group shares")
    args = p.parse_args()
    if not paged_attention.available(torch.bfloat16, HEADS // KV_HEADS, HEAD_DIM):
        raise SystemExit("the native paged attention kernel is not available on this machine")
    g = torch.Generator().manual_seed(0)
    batch, prompt, decoded = args.batch, args.prompt, args.decoded
    rows = batch * (prompt + decoded) + 1
    pools = [(torch.randn(KV_HEADS, rows, HEAD_DIM, generator=g).to(torch.bfloat16),
              torch.randn(KV_HEADS, rows, HEAD_DIM, generator=g).to(torch.bfloat16)) for _ in range(LAYERS)]
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=g).to(torch.bfloat16)
    length = prompt + decoded
    indptr = torch.arange(batch + 1, dtype=torch.int64) * length
    prompts = [1 + i * prompt + torch.arange(prompt) for i in range(batch)]
    kv_bytes = batch * length * KV_HEADS * HEAD_DIM * 2 * 2 * LAYERS
    print(f"batch {batch}, prompt {prompt} + {decoded} decoded tokens, {LAYERS} layers, {torch.get_num_threads()} "
          f"threads; KV read per step {kv_bytes / 2**20:.0f} MiB")
    results = {}
    for layout in ("interleaved", "runs", "contiguous"):
        dec = decode_slots(layout, batch, decoded, 1 + batch * prompt)
        indices = torch.cat([torch.cat([a, b]) for a, b in zip(prompts, dec, strict=True)])
        best = float("inf")
        for _ in range(args.reps + 1):
            t0 = time.perf_counter()
            for k, v in pools:
                paged_attention.decode(q, k, v, indptr, indices, HEAD_DIM ** -0.5)
            best = min(best, time.perf_counter() - t0)
        results[layout] = best * 1e3
        print(f"{layout:12s} {best * 1e3:8.2f} ms per step  ({kv_bytes / best / 1e9:.1f} GB/s of KV)", flush=True)
    # shared prefixes: request i uses its group leader's first `shared` prompt slots
    dec = decode_slots("runs", batch, decoded, 1 + batch * prompt)
    lists = []
    for i in range(batch):
        leader = prompts[i - i % args.members]
        lists.append(torch.cat([leader[: args.shared], prompts[i][args.shared:], dec[i]]))
    indices = torch.cat(lists)
    plan = paged_attention.plan_shared_prefixes(indptr, indices, HEADS // KV_HEADS)
    for name, shared in (("shared, plan off", None), ("shared, cascade", plan)):
        best = float("inf")
        for _ in range(args.reps + 1):
            t0 = time.perf_counter()
            for k, v in pools:
                paged_attention.decode(q, k, v, indptr, indices, HEAD_DIM ** -0.5, shared=shared)
            best = min(best, time.perf_counter() - t0)
        results[name] = best * 1e3
        print(f"{name:17s} {best * 1e3:8.2f} ms per step  ({plan.groups if plan else 0} groups of "
              f"{args.members}, {args.shared} shared slots)", flush=True)
    print(json.dumps({"batch": batch, "prompt": prompt, "decoded": decoded, "ms": results,
                      "interleaved_over_runs": results["interleaved"] / results["runs"],
                      "cascade_speedup": results["shared, plan off"] / results["shared, cascade"]}))


if __name__ == "__main__":
    main()
