"""`bench/disagg.py --mode serve`, part (2): a prefill/decode pair behind SGLang's router against a unified
server, same model, same flags, side by side in one run, on a mixed workload.

    .venv/bin/python bench/disagg.py --mode serve                   # SmolLM2-135M bf16, mooncake, 3 rounds
    .venv/bin/python bench/disagg.py --mode serve --backend nixl    # the NIXL transfer engine
    .venv/bin/python bench/disagg.py --mode serve --quick           # tiny dummy model, few requests, 1 round
    .venv/bin/python bench/disagg.py --mode serve --json-out F      # also write the report as JSON

Deployments (`bench/disagg_procs.py`), all up for the whole run, each a real `tokenloom.launch_server`:
- unified: one server, `--num-threads --unified-threads` (default: every core);
- pd: a prefill server and a decode server (`--disaggregation-mode prefill / decode`,
  `--disaggregation-transfer-backend --backend`), `--num-threads --pd-threads` each (default: half the
  cores), behind `python -m sglang_router.launch_router --pd-disaggregation` (Rust router, round robin).
Every other server flag is the same for all three (model, dtype, KV pool, request slots). On this machine
all of them share the same cores: the unified server gets all of them, the pair splits them, so the pair
has no more compute than the unified server; there is no separate prefill hardware.

Workload (`mixed_workload`): `--num-requests` requests in a fixed order, every `--long-every`-th a long
prompt (`--long-input-len` tokens, `--long-output-len` new tokens), the others short prompts with long
outputs (`--short-input-len` / `--short-output-len`), sent at `--request-rate` requests/s with exponential
gaps: a steady stream of decoding requests with long prompts arriving among them. Prompts are text from
the benchmark client's local corpus (`tokenloom.bench.datasets.sample_random`, exact lengths), fresh every
round (no prefix-cache hits), the same prompts and arrival times for both deployments within a round.
Requests are greedy with ignore_eos, streamed, and measured by the project's client
(`tokenloom.bench.bench_serving.run_benchmark`, `metrics.calculate_metrics`: TTFT, per-token ITL, TPOT).

Rounds: each deployment serves one untimed warm-up workload, then `--rounds` rounds; in each, both
deployments run that round's workload one after the other, who goes first alternating, so drift hits both.
Reported per deployment, medians over rounds: TTFT / ITL p50, p90, p99 and output throughput for all
requests, the short ones (their ITL is what a long prefill interrupts) and the long ones (their TTFT is
what a busy server delays); per server, deltas of its /get_server_info counters over each run (requests
transferred by the prefill server, received by the decode server, transfer failures, offloads,
retractions, decode steps and their mean period, forward-busy share) and the CPU its processes used;
`other_cpu`, the share of the machine's CPU that processes not started here used. The last line is one
JSON object (also written to `--json-out`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import signal
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.disagg_procs import Deployment, machine_busy_s, pd_pair, unified  # noqa: E402
from tokenloom.bench.datasets import DatasetRow  # noqa: E402
from tokenloom.bench.metrics import BenchmarkMetrics, RequestOutput, calculate_metrics  # noqa: E402

BACKENDS = ("mooncake", "nixl")
KINDS = ("short", "long")
TINY_MODEL = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 49152,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "bos_token_id": 1,
    "eos_token_id": 2, "tie_word_embeddings": True, "hidden_act": "silu", "torch_dtype": "bfloat16",
}
# (num requests, long every, short in/out, long in/out, rate) of the full and the quick run
FULL = dict(num_requests=24, long_every=6, short_input_len=64, short_output_len=128, long_input_len=1024,
            long_output_len=16, request_rate=1.0, rounds=3)
QUICK = dict(num_requests=10, long_every=5, short_input_len=32, short_output_len=32, long_input_len=512,
             long_output_len=8, request_rate=4.0, rounds=1)
# /get_server_info counters whose change over a run is reported (absent ones are skipped)
COUNTERS = ("num_transferred_reqs", "num_received_reqs", "num_failed_transfer_reqs", "num_offloaded_reqs",
            "num_retracted_reqs", "decode_steps", "decode_tokens")
NOISY_OTHER_CPU = 0.1  # above this share of the CPUs used by other processes, the report warns
IDLE_KEYS = ("num_running_reqs", "num_waiting_reqs", "num_bootstrap_reqs", "num_inflight_transfer_reqs",
             "num_prealloc_queue_reqs", "num_transfer_queue_reqs", "num_decode_retracted_reqs")


# --------------------------------------------------------------------------------------------------------
# arguments


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    cores = os.cpu_count() or 1
    p = argparse.ArgumentParser(prog="bench/disagg.py --mode serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["serve"], default="serve")
    p.add_argument("--backend", choices=BACKENDS, default="mooncake", help="the pair's KV transfer engine")
    p.add_argument("--model", default=None, help="model path (default: SmolLM2-135M, the servers' default)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quick", action="store_true", help="a tiny dummy-weight model, few requests, 1 round")
    for name, value in FULL.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=float if name == "request_rate" else int, default=None,
                       help=f"default {value} ({QUICK[name]} with --quick)")
    p.add_argument("--unified-threads", type=int, default=cores, help="the unified server's --num-threads")
    p.add_argument("--pd-threads", type=int, default=max(1, cores // 2),
                   help="--num-threads of the prefill server and of the decode server, each")
    p.add_argument("--max-total-tokens", type=int, default=32768, help="every server's KV pool")
    p.add_argument("--max-running-requests", type=int, default=64, help="every server's request slots")
    p.add_argument("--seed", type=int, default=1, help="round r uses prompts and arrival gaps of seed + r")
    p.add_argument("--json-out", default=None, help="write the report to this file as JSON")
    ns = p.parse_args(argv)
    sizes = QUICK if ns.quick else FULL
    for name, value in sizes.items():
        if getattr(ns, name) is None:
            setattr(ns, name, value)
    if ns.rounds < 3 and not ns.quick:
        p.error("--rounds must be at least 3 (a median of fewer says little); use --quick for a smoke run")
    for name in ("num_requests", "short_input_len", "short_output_len", "long_input_len", "long_output_len",
                 "unified_threads", "pd_threads", "rounds"):
        if getattr(ns, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if ns.long_every < 2 or ns.long_every > ns.num_requests:
        p.error("--long-every must be in [2, --num-requests] (one long prompt every that many requests)")
    if not ns.request_rate > 0:
        p.error("--request-rate must be > 0")
    ns.mode = "serve"
    return ns


# --------------------------------------------------------------------------------------------------------
# workload


def workload_kinds(num_requests: int, long_every: int) -> list[str]:
    """Request i is long when i % long_every == long_every - 1, short otherwise."""
    return ["long" if i % long_every == long_every - 1 else "short" for i in range(num_requests)]


def mixed_workload(tokenizer: Any, ns: argparse.Namespace, seed: int) -> tuple[list[DatasetRow], list[str]]:
    """The rows of one round in sending order and the kind of each (see the module docstring)."""
    import numpy as np

    from tokenloom.bench.datasets import sample_random

    kinds = workload_kinds(ns.num_requests, ns.long_every)
    rng = np.random.default_rng(seed)
    short = iter(sample_random(tokenizer, kinds.count("short"), ns.short_input_len, ns.short_output_len, 1.0, rng))
    long = iter(sample_random(tokenizer, kinds.count("long"), ns.long_input_len, ns.long_output_len, 1.0, rng))
    return [next(long) if k == "long" else next(short) for k in kinds], kinds


# --------------------------------------------------------------------------------------------------------
# pure aggregation and reporting (unit-tested in tests/unit/test_bench_disagg.py)


def figures(m: BenchmarkMetrics) -> dict[str, float]:
    """The headline figures of one set of requests (times in ms)."""
    return {"completed": m.completed, "failed": m.failed, "output_tok_s": m.output_throughput,
            "ttft_p50_ms": m.ttft.median, "ttft_p90_ms": m.ttft.p90, "ttft_p99_ms": m.ttft.p99,
            "itl_p50_ms": m.itl.median, "itl_p90_ms": m.itl.p90, "itl_p99_ms": m.itl.p99,
            "tpot_p50_ms": m.tpot.median, "e2e_p50_ms": m.e2e_latency.median}


def summarize(outputs: list[RequestOutput], kinds: list[str], duration: float) -> dict[str, dict[str, float]]:
    """`figures` for all requests and for each kind; a kind's throughput is its own tokens over the run's
    duration (the kinds' throughputs add up to the total)."""
    out = {"all": figures(calculate_metrics(outputs, duration, None))}
    for kind in KINDS:
        out[kind] = figures(calculate_metrics([o for o, k in zip(outputs, kinds, strict=True) if k == kind],
                                              duration, None))
    return out


def counter_deltas(before: dict[str, Any], after: dict[str, Any], wall_s: float) -> dict[str, float]:
    """One server's change over a run: each `COUNTERS` key it reports; with decode steps, their mean period (a
    lane's time from one decode result to its next, prefills in between included) and batch; the share of the
    run's wall time its forward was busy."""
    out: dict[str, float] = {key: after[key] - before[key] for key in COUNTERS if key in after and key in before}
    steps = out.get("decode_steps", 0)
    if steps and "decode_period_s" in after:
        out["decode_step_ms"] = 1e3 * (after["decode_period_s"] - before["decode_period_s"]) / steps
    if steps and "decode_tokens" in out:
        out["decode_batch"] = out["decode_tokens"] / steps
    if "forward_busy_s" in after and wall_s > 0:
        out["forward_busy"] = (after["forward_busy_s"] - before["forward_busy_s"]) / wall_s
    return out


def median_over_rounds(runs: list[Any]) -> Any:
    """The element-wise median of same-shaped runs: dicts key by key, numbers by their median (bools and
    strings: the first run's value)."""
    first = runs[0]
    if isinstance(first, dict):
        return {key: median_over_rounds([r[key] for r in runs]) for key in first}
    if isinstance(first, bool) or not isinstance(first, int | float):
        return first
    return statistics.median(runs)


def pd_problems(counters: dict[str, dict[str, float]], requests: int) -> list[str]:
    """What a PD run's counters say went wrong: every request must have been transferred by the prefill
    server and received by the decode server, with no failures."""
    problems = []
    prefill, decode = counters.get("prefill", {}), counters.get("decode", {})
    if prefill.get("num_transferred_reqs") != requests:
        problems.append(f"prefill transferred {prefill.get('num_transferred_reqs')} of {requests} requests")
    if decode.get("num_received_reqs") != requests:
        problems.append(f"decode received {decode.get('num_received_reqs')} of {requests} requests")
    for side, c in (("prefill", prefill), ("decode", decode)):
        if c.get("num_failed_transfer_reqs"):
            problems.append(f"{side}: {c['num_failed_transfer_reqs']} failed transfers")
    return problems


def format_table(summary: dict[str, dict[str, dict[str, float]]]) -> str:
    """One row per (requests, deployment) and a PD / unified ratio row per request kind."""
    head = (f"{'requests':8} {'deploy':8} {'TTFT p50':>9} {'p90':>8} {'p99':>8} {'ITL p50':>8} {'p90':>7} "
            f"{'p99':>8} {'TPOT p50':>9} {'out tok/s':>10} {'ok/fail':>8}")
    lines = [head + "   (times in ms)"]
    keys = ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p90_ms", "itl_p99_ms")
    widths = (9, 8, 8, 8, 7, 8)
    for kind in ("all", *KINDS):
        for dep in ("unified", "pd"):
            f = summary[dep][kind]
            cells = " ".join(f"{f[k]:>{w}.1f}" for k, w in zip(keys, widths, strict=True))
            ok_fail = f"{f['completed']:.0f}/{f['failed']:.0f}"
            lines.append(f"{kind:8} {dep:8} {cells} {f['tpot_p50_ms']:>9.1f} {f['output_tok_s']:>10.1f} "
                         f"{ok_fail:>8}")
        u, d = summary["unified"][kind], summary["pd"][kind]
        ratios = " ".join(f"{ratio(d[k], u[k]):>{w}}" for k, w in zip(keys, widths, strict=True))
        lines.append(f"{kind:8} {'pd/uni':8} {ratios} {ratio(d['tpot_p50_ms'], u['tpot_p50_ms']):>9} "
                     f"{ratio(d['output_tok_s'], u['output_tok_s']):>10}")
    return "\n".join(lines)


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "-"


def format_counters(name: str, c: dict[str, float]) -> str:
    labels = {"num_transferred_reqs": "transferred", "num_received_reqs": "received",
              "num_failed_transfer_reqs": "failed transfers", "num_offloaded_reqs": "offloaded",
              "num_retracted_reqs": "retracted", "decode_steps": "decode steps"}
    parts = [f"{labels[k]} {c[k]:.0f}" for k in labels if k in c and (c[k] or k != "decode_steps")]
    if "decode_step_ms" in c:
        parts.append(f"mean decode period {c['decode_step_ms']:.1f} ms, batch {c.get('decode_batch', 0):.1f}")
    if "forward_busy" in c:
        parts.append(f"forward busy {100 * c['forward_busy']:.0f}%")
    if "cpu_cores" in c:
        parts.append(f"CPU {c['cpu_cores']:.2f} cores")
    return f"  {name:8} " + ", ".join(parts)


# --------------------------------------------------------------------------------------------------------
# runs


def _client_args(ns: argparse.Namespace, seed: int) -> argparse.Namespace:
    from tokenloom.bench.bench_serving import build_parser, check_args

    args = build_parser().parse_args(["--backend", "tokenloom", "--request-rate", str(ns.request_rate), "--seed",
                                      str(seed), "--warmup-requests", "0", "--disable-tqdm"])
    check_args(args)
    return args


def _wait_idle(dep: Deployment, timeout: float = 30) -> dict[str, dict[str, Any]]:
    """The servers' info once no request is anywhere in them (the prefill side's last "sent" may trail)."""
    deadline = time.monotonic() + timeout
    while True:
        info = dep.server_info()
        if not any(i.get(k, 0) for i in info.values() for k in IDLE_KEYS) or time.monotonic() > deadline:
            return info
        time.sleep(0.1)


def _own_cpu_s() -> float:
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


def run_once(dep: Deployment, others: list[Deployment], rows: list[DatasetRow], kinds: list[str],
             ns: argparse.Namespace, seed: int) -> dict[str, Any]:
    """One workload through `dep` with the project's client; figures, counters and CPU use."""
    from tokenloom.bench.backends import RequestInput, request_native
    from tokenloom.bench.bench_serving import run_benchmark

    args = _client_args(ns, seed)
    template = RequestInput(prompt="", prompt_len=0, output_len=0, api_url=dep.url + "/generate", model="default")
    before = _wait_idle(dep)
    cpu0 = {p.name: p.cpu_s() for d in (dep, *others) for p in d.procs}
    busy0, own0, t0 = machine_busy_s(), _own_cpu_s(), time.perf_counter()
    outputs, duration, _ = asyncio.run(run_benchmark(args, rows, request_native, template, dep.url))
    wall = time.perf_counter() - t0
    cpu1 = {p.name: p.cpu_s() for d in (dep, *others) for p in d.procs}
    busy, own = machine_busy_s() - busy0, _own_cpu_s() - own0
    after = _wait_idle(dep)
    cores = os.cpu_count() or 1
    counters = {name: counter_deltas(before[name], after[name], wall) for name in after}
    for p in dep.procs:  # the router has no counters, only its CPU
        counters.setdefault(p.name, {})["cpu_cores"] = (cpu1[p.name] - cpu0[p.name]) / wall
    ours = sum(cpu1[k] - cpu0[k] for k in cpu1) + own
    errors: dict[str, int] = {}
    for o in outputs:
        if not o.success:
            errors[o.error] = errors.get(o.error, 0) + 1
    return {"figures": summarize(outputs, kinds, duration), "counters": counters, "duration_s": duration,
            "client_cpu_cores": own / wall, "other_cpu": max(0.0, busy - ours) / (wall * cores), "errors": errors}


def _progress(name: str, r: int, res: dict[str, Any]) -> str:
    f, s, lg = res["figures"]["all"], res["figures"]["short"], res["figures"]["long"]
    return (f"round {r} {name:7}: TTFT p50 {f['ttft_p50_ms']:7.0f} ms (long {lg['ttft_p50_ms']:6.0f}), ITL p50 "
            f"{f['itl_p50_ms']:5.1f} p99 {f['itl_p99_ms']:6.0f} ms (short p99 {s['itl_p99_ms']:6.0f}), "
            f"{f['output_tok_s']:6.1f} tok/s, {f['completed']}/{f['completed'] + f['failed']} ok, other CPU "
            f"{100 * res['other_cpu']:.0f}%")


def model_flags(ns: argparse.Namespace) -> tuple[list[str], str]:
    """The servers' model flags and the model's description."""
    if ns.quick and ns.model is None:
        from bench.common import dummy_model_folder

        folder = dummy_model_folder("tokenloom-bench-disagg-tiny", TINY_MODEL)
        return ["--model-path", folder, "--load-format", "dummy"], "tiny random Llama (hidden 256, 4 layers)"
    if ns.model is None:
        return [], "SmolLM2-135M-Instruct (the default GGUF)"
    return ["--model-path", ns.model], ns.model


def _raise_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # so the `finally` below stops every process started here


def main(ns: argparse.Namespace) -> dict[str, Any]:
    from tokenloom.bench.server import load_bench_tokenizer

    mflags, model = model_flags(ns)
    flags = [*mflags, "--dtype", ns.dtype, "--max-total-tokens", str(ns.max_total_tokens), "--max-running-requests",
             str(ns.max_running_requests), "--log-level", "warning"]
    tokenizer = load_bench_tokenizer(mflags[1] if mflags else "smollm2", "http://127.0.0.1:9", {})
    warm_ns = argparse.Namespace(**{**vars(ns), "num_requests": ns.long_every, "request_rate": float("inf")})
    warm = mixed_workload(tokenizer, warm_ns, seed=ns.seed + 1000)
    rounds = [mixed_workload(tokenizer, ns, seed=ns.seed + r) for r in range(ns.rounds)]
    log_dir = tempfile.mkdtemp(prefix="tokenloom-bench-disagg-")
    cores = os.cpu_count() or 1
    print(f"model {model}, {ns.dtype}; backend {ns.backend}; logs in {log_dir}\n"
          f"CPU: the unified server runs {ns.unified_threads} forward thread(s), the prefill and the decode "
          f"server {ns.pd_threads} each; all share this machine's {cores} cores (load average "
          f"{os.getloadavg()[0]:.2f} at start)", flush=True)
    previous = signal.signal(signal.SIGTERM, _raise_on_sigterm)
    deps: dict[str, Deployment] = {}
    runs: dict[str, list[dict[str, Any]]] = {"unified": [], "pd": []}
    try:
        t = time.perf_counter()
        deps["unified"] = unified(flags, ns.unified_threads, log_dir)
        deps["pd"] = pd_pair(flags, ns.pd_threads, ns.backend, log_dir)
        print(f"servers and router up in {time.perf_counter() - t:.0f} s", flush=True)
        for dep in deps.values():  # untimed: kernels, allocator, the overlap policy's first probe
            run_once(dep, [], *warm, warm_ns, ns.seed + 1000)
        for r, (rows, kinds) in enumerate(rounds):
            order = ["unified", "pd"] if r % 2 == 0 else ["pd", "unified"]
            for name in order:
                others = [d for n, d in deps.items() if n != name]
                res = run_once(deps[name], others, rows, kinds, ns, ns.seed + r)
                if name == "pd":
                    res["problems"] = pd_problems(res["counters"], len(rows))
                runs[name].append(res)
                print(_progress(name, r + 1, res), flush=True)
                dead = [p for d in deps.values() for p in d.dead()]
                if dead:
                    raise RuntimeError(f"processes died during the run: {dead} (logs in {log_dir})")
    finally:
        for dep in deps.values():
            dep.stop()
        signal.signal(signal.SIGTERM, previous)
    summary = {name: median_over_rounds([x["figures"] for x in rs]) for name, rs in runs.items()}
    counters = {name: median_over_rounds([x["counters"] for x in rs]) for name, rs in runs.items()}
    problems = sorted({p for x in runs["pd"] for p in x["problems"]})
    other = statistics.median(x["other_cpu"] for rs in runs.values() for x in rs)
    print(f"\n{ns.num_requests} requests per run ({workload_kinds(ns.num_requests, ns.long_every).count('long')} "
          f"long: {ns.long_input_len} in / {ns.long_output_len} out; the rest {ns.short_input_len} in / "
          f"{ns.short_output_len} out) at {ns.request_rate} req/s; medians of {ns.rounds} round(s); unified "
          f"{ns.unified_threads} thread(s), prefill and decode {ns.pd_threads} each, all on the same {cores} cores")
    print(format_table(summary))
    print("server counters per run (medians):")
    for dep in ("unified", "pd"):
        for name, c in counters[dep].items():
            print(format_counters(name, c))
    print(f"other processes used {100 * other:.0f}% of the CPUs during the runs (median)")
    if other > NOISY_OTHER_CPU:
        print("warning: the machine was busy; a forward on several threads (the unified server's) slows down far "
              "more than one on a single thread when another process takes a core, so this comparison is skewed")
    if problems:
        print("PD problems: " + "; ".join(problems))
    report = {"bench": "disagg_serve", "model": model, "dtype": ns.dtype, "backend": ns.backend,
              "rounds": ns.rounds, "workload": {k: getattr(ns, k) for k in FULL if k != "rounds"},
              "unified_threads": ns.unified_threads, "pd_threads": ns.pd_threads, "cores": cores,
              "shared_cores": True, "summary": summary, "counters": counters, "other_cpu": round(other, 3),
              "pd_problems": problems, "runs": runs}
    if ns.json_out:
        with open(ns.json_out, "w") as f:
            json.dump(report, f, indent=1)
    headline = {"bench": "disagg_serve", "backend": ns.backend, "rounds": ns.rounds,
                **{f"{dep}_{k}": summary[dep]["all"][k] for dep in ("unified", "pd")
                   for k in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "output_tok_s")},
                "pd_problems": problems, "other_cpu": round(other, 3)}
    print(json.dumps(headline))
    return report
