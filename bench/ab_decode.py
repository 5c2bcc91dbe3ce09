"""Decode-step time of two checkouts of tokenloom, measured in lockstep in one run: what a change costs.

    .venv/bin/python bench/ab_decode.py --base bb39570                 # the working tree vs commit bb39570
    .venv/bin/python bench/ab_decode.py --base bb39570 --quick
    .venv/bin/python bench/ab_decode.py --base-dir /path/to/old/checkout --batch-sizes 1,4,16,64

Why lockstep: on this machine the same step drifts up to 2x within seconds, so a 3% change cannot be seen
between two runs. Here each checkout runs in its own worker process (its own build of the native kernels),
both hold the same model and the same decode point, and they take turns: round r times `--steps` steps of
one, then of the other (who goes first alternates), while the idle one waits on its pipe; turns start
after a pause (the idle side's OpenMP threads stop spinning) and one untimed step. The figure per
point is the median over rounds of the within-round ratio (new / base), next to each side's median step.

The workers drive `bench/forward_engines.TokenloomEngine` of their own checkout (a `ModelRunner` with hand-built
decode batches and a pre-filled KV pool), the default model unless `--model`, bf16 unless `--dtype`;
`--base-arg` / `--new-arg KEY=VALUE` add a ServerArgs field to one side (`--base-dir . --base-arg
quantization=none`: the same file dequantized at load against it kept quantized, in one checkout). `--base`
makes a git worktree of that commit under a temporary folder (removed at the end). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Pause between turns: the worker that just ran keeps its OpenMP threads spinning for a while after its last
# step (libgomp's spin-wait), which would steal the cores from the other's first steps.
SETTLE_S = 0.2

# Runs inside each checkout: reads one JSON command per line, answers one JSON line.
WORKER = r"""
import functools, json, sys, time, torch
sys.path.insert(0, ".")
import bench.forward_engines as engines
from bench.forward_engines import TokenloomEngine
cfg = json.loads(sys.argv[1])
if cfg.get("model") or cfg.get("args"):  # (patched in: a checkout whose engine takes no model path runs it too)
    engines.ServerArgs = functools.partial(engines.ServerArgs, **({"model_path": cfg["model"]} if cfg.get("model")
                                                                 else {}), **cfg.get("args", {}))
engine = TokenloomEngine(cfg["dtype"], cfg["max_total_tokens"], cfg["max_requests"], cfg["threads"])
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    cmd = json.loads(line)
    if cmd["op"] == "setup":
        engine.setup_decode(cmd["batch"], cmd["context"], cmd["extra"])
        for _ in range(cmd["warmup"]):
            engine.decode_step()
        print(json.dumps({"ok": True}), flush=True)
    elif cmd["op"] == "steps":
        engine.decode_step()  # untimed: the turn's first step wakes this process's threads
        times = []
        for _ in range(cmd["n"]):
            t = time.perf_counter()
            engine.decode_step()
            times.append(time.perf_counter() - t)
        print(json.dumps({"times": times}), flush=True)
    else:
        break
"""


class Worker:
    def __init__(self, checkout: str, cfg: dict[str, Any]) -> None:
        self.checkout = checkout
        self.proc = subprocess.Popen([sys.executable, "-c", WORKER, json.dumps(cfg)], cwd=checkout,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._read()

    def _read(self) -> dict[str, Any]:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"worker in {self.checkout} exited ({self.proc.wait()})")
            if line.startswith("{"):
                return json.loads(line)

    def ask(self, **cmd: Any) -> dict[str, Any]:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        with contextlib.suppress(RuntimeError, BrokenPipeError, OSError):
            self.ask(op="quit")
        self.proc.kill()
        self.proc.wait()


def measure_point(base: Worker, new: Worker, batch: int, context: int, rounds: int, steps: int,
                  warmup: int) -> dict[str, Any]:
    for w in (base, new):
        w.ask(op="setup", batch=batch, context=context, extra=rounds * (steps + 1) + warmup + 1, warmup=warmup)
    base_t, new_t, ratios = [], [], []
    for r in range(rounds):
        order = (base, new) if r % 2 == 0 else (new, base)
        got = {}
        for w in order:
            time.sleep(SETTLE_S)
            got[id(w)] = statistics.median(w.ask(op="steps", n=steps)["times"])
        base_t.append(got[id(base)])
        new_t.append(got[id(new)])
        ratios.append(got[id(new)] / got[id(base)])
    return {"batch": batch, "context": context, "base_ms": 1e3 * statistics.median(base_t),
            "new_ms": 1e3 * statistics.median(new_t), "ratio": statistics.median(ratios),
            "ratio_min": min(ratios), "ratio_max": max(ratios)}


def _server_args(pairs: list[str]) -> dict[str, Any]:
    """["quantization=none", "num_threads=1"] -> {"quantization": "none", "num_threads": 1}."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"expected KEY=VALUE, got {pair!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--base", help="git commit of the baseline (a worktree of it is made)")
    src.add_argument("--base-dir", help="a checkout of the baseline")
    p.add_argument("--new-dir", default=REPO, help="the checkout measured against it (default: this tree)")
    p.add_argument("--batch-sizes", default="1,4,16,64")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--model", default=None, help="model path for both (default: the packaged default GGUF)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--base-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="a ServerArgs field for the base side only (VALUE read as JSON where it parses)")
    p.add_argument("--new-arg", action="append", default=[], metavar="KEY=VALUE", help="the same, new side")
    p.add_argument("--quick", action="store_true", help="batch 1 and 64, 7 rounds")
    args = p.parse_args()
    batches = [1, 64] if args.quick else [int(b) for b in args.batch_sizes.split(",")]
    rounds = 7 if args.quick else args.rounds
    tmp = None
    base_dir = args.base_dir
    if args.base:
        tmp = tempfile.mkdtemp(prefix="tokenloom-ab-")
        base_dir = os.path.join(tmp, "base")
        subprocess.run(["git", "-C", REPO, "worktree", "add", "--detach", base_dir, args.base], check=True,
                       capture_output=True)
    extra = rounds * (args.steps + 1) + args.warmup + 1
    cfg = {"dtype": args.dtype, "threads": args.threads, "max_requests": max(batches), "model": args.model,
           "max_total_tokens": max(batches) * (args.context + extra) + 64}
    workers: list[Worker] = []
    try:
        workers = [Worker(base_dir, {**cfg, "args": _server_args(args.base_arg)}),
                   Worker(args.new_dir, {**cfg, "args": _server_args(args.new_arg)})]
        points = [measure_point(*workers, b, args.context, rounds, args.steps, args.warmup) for b in batches]
    finally:
        for w in workers:
            w.close()
        if tmp is not None:
            subprocess.run(["git", "-C", REPO, "worktree", "remove", "--force", base_dir], capture_output=True)
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"decode step, context {args.context}, {args.dtype}, {rounds} rounds x {args.steps} steps, "
          f"base {args.base or base_dir} vs {args.new_dir}")
    print(f"{'batch':>5s} {'base ms':>9s} {'new ms':>9s} {'new/base':>9s} {'range':>15s}")
    for pt in points:
        print(f"{pt['batch']:5d} {pt['base_ms']:9.2f} {pt['new_ms']:9.2f} {pt['ratio']:9.3f} "
              f"{pt['ratio_min']:7.3f}-{pt['ratio_max']:.3f}")
    print(json.dumps({"bench": "ab_decode", "base": args.base or base_dir, "context": args.context,
                      "dtype": args.dtype, "model": args.model, "base_args": args.base_arg, "new_args": args.new_arg,
                      "rounds": rounds, "points": points}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
