"""The issue 30 figures of `bench/serve_vs_peers.py`: tokenloom against llama-server on the same GGUF file,
medians over alternating rounds, each step's weight-bandwidth bound, weight memory against the file size, and
the shared-machine mode (one busy background process on or off).

Definitions (all pure arithmetic over the client's result lines, so they are unit-tested):
- a run's ITL is its `mean_tpot_ms`: per request (e2e - TTFT) / (tokens - 1), averaged over requests;
- `median_runs` takes, per metric, the median over the rounds that did not fail;
- for a file X with engines tokenloom-X and llama.cpp-X: ITL speedup = llama ITL / tokenloom ITL and TTFT
  ratio = llama TTFT / tokenloom TTFT (both one request at a time; > 1: tokenloom faster), throughput ratio
  = tokenloom output tok/s / llama output tok/s (the many-at-once workload; > 1: tokenloom faster);
- degradation under load = unloaded output tok/s / loaded output tok/s and loaded ITL / unloaded ITL
  (1 = unaffected; issue 30's bound for one busy background process: <= 2.5).
"""

from __future__ import annotations

import contextlib
import statistics
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

LOAD_TAG = "+load"
DEGRADATION_TARGET = 2.5
METRICS = ("output_throughput", "mean_ttft_ms", "mean_itl_ms", "mean_tpot_ms", "median_e2e_latency_ms",
           "request_throughput", "max_output_tokens_per_s", "completed", "failed", "cache_hit_rate", "duration")


def median_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One result from a list of rounds' results: per metric the median over the rounds that have it (failed
    rounds, those with an "error", are left out and counted); {"error": ...} when every round failed."""
    good = [r for r in runs if "error" not in r]
    if not good:
        return {"error": runs[-1]["error"] if runs else "no rounds", "rounds": 0, "failed_rounds": len(runs)}
    out: dict[str, Any] = {"rounds": len(good), "failed_rounds": len(runs) - len(good)}
    for key in METRICS:
        values = [r[key] for r in good if isinstance(r.get(key), (int, float))]
        if values:
            out[key] = statistics.median(values)
    if len(good) > 1 and "mean_tpot_ms" in out:
        out["tpot_rounds"] = [r.get("mean_tpot_ms") for r in good]
    return out


def _ratio(num: Any, den: Any) -> float | None:
    return num / den if isinstance(num, (int, float)) and isinstance(den, (int, float)) and num and den else None


def pair_ratios(one: dict[str, dict], many: dict[str, dict], kinds: list[str]) -> dict[str, dict[str, Any]]:
    """Per file kind X with both tokenloom-X and llama.cpp-X results: the ITL speedup and TTFT ratio from `one`
    (engine -> median result, one request at a time) and the throughput ratio from `many` (many at once)."""
    out: dict[str, dict[str, Any]] = {}
    for kind in kinds:
        tl, ll = f"tokenloom-{kind}", f"llama.cpp-{kind}"
        row = {
            "itl_speedup": _ratio(one.get(ll, {}).get("mean_tpot_ms"), one.get(tl, {}).get("mean_tpot_ms")),
            "ttft_ratio": _ratio(one.get(ll, {}).get("mean_ttft_ms"), one.get(tl, {}).get("mean_ttft_ms")),
            "throughput_ratio": _ratio(many.get(tl, {}).get("output_throughput"),
                                       many.get(ll, {}).get("output_throughput")),
        }
        if any(v is not None for v in row.values()):
            out[kind] = row
    return out


def bound_rows(one: dict[str, dict], files: dict[str, str], step_bytes: dict[str, int], file_bytes: dict[str, int],
               weight_bytes: dict[str, int | None], read_gbps: float) -> list[dict[str, Any]]:
    """Per engine that serves a file (`files`: engine -> path; `step_bytes`/`file_bytes`: path -> bytes): the
    bound bytes / bandwidth (ms), the measured one-at-a-time ITL and their ratio, and the weight memory the
    server reports against the file size."""
    from bench.gguf_bound import bound_ms

    rows = []
    for engine, path in files.items():
        bound = bound_ms(step_bytes[path], read_gbps)
        itl = one.get(engine, {}).get("mean_tpot_ms")
        held = weight_bytes.get(engine)
        rows.append({"engine": engine, "file": path, "step_bytes": step_bytes[path], "bound_ms": bound,
                     "itl_ms": itl, "itl_over_bound": _ratio(itl, bound), "weight_bytes": held,
                     "file_bytes": file_bytes[path], "weights_over_file": _ratio(held, file_bytes[path])})
    return rows


def e_target(engine: str) -> float:
    """Issue 30's many-at-once target against llama-server's best file for the engine's model: 2x on the ~1B
    model (`*-1b-*`), 3x on the default model."""
    return 2.0 if "-1b-" in engine else 3.0


def ceiling_rows(many: dict[str, dict], files: dict[str, str], flops: dict[str, float], output_tokens: int,
                 gflops: float) -> list[dict[str, Any]]:
    """Per tokenloom engine with a many-at-once result (`many`: engine -> median; `files`: engine -> path;
    `flops`: path -> the workload's FLOPs, bench/gguf_ceiling.py): the arithmetic ceiling in output tok/s at
    `gflops`, the share of it reached, llama-server's best tok/s on a file of the same model (same FLOPs), the
    tok/s the target needs and whether the ceiling leaves room for it."""
    from bench.gguf_ceiling import ceiling_tok_s

    rows = []
    for engine, path in files.items():
        got = many.get(engine, {}).get("output_throughput")
        if not engine.startswith("tokenloom-") or got is None:
            continue
        ceiling = ceiling_tok_s(flops[path], output_tokens, gflops)
        peers = [many.get(e, {}).get("output_throughput") for e, p in files.items()
                 if e.startswith("llama.cpp-") and flops[p] == flops[path]]
        best = max((v for v in peers if v), default=None)
        needed = e_target(engine) * best if best else None
        rows.append({"engine": engine, "tflop": flops[path] / 1e12, "ceiling_tok_s": ceiling, "tok_s": got,
                     "share_of_ceiling": got / ceiling, "peer_best_tok_s": best, "target": e_target(engine),
                     "needed_tok_s": needed, "ceiling_over_peer": _ratio(ceiling, best),
                     "reachable": None if needed is None else ceiling >= needed})
    return rows


def degradation(results: dict[str, dict], engines: list[str]) -> dict[str, dict[str, Any]]:
    """Per engine with both an unloaded (`name`) and a loaded (`name+load`) result in `results` (one workload's
    medians): how much the load slows its output tok/s and its ITL, and whether both stay within the target."""
    out: dict[str, dict[str, Any]] = {}
    for name in engines:
        calm, busy = results.get(name, {}), results.get(name + LOAD_TAG, {})
        tput = _ratio(calm.get("output_throughput"), busy.get("output_throughput"))
        itl = _ratio(busy.get("mean_tpot_ms"), calm.get("mean_tpot_ms"))
        if tput is None and itl is None:
            continue
        worst = max(v for v in (tput, itl) if v is not None)
        out[name] = {"throughput_slowdown": tput, "itl_slowdown": itl, "target": DEGRADATION_TARGET,
                     "met": worst <= DEGRADATION_TARGET}
    return out


@contextlib.contextmanager
def busy_process(on: bool) -> Iterator[subprocess.Popen | None]:
    """While the block runs (and `on`), one Python process at normal priority spinning on a core: the
    shared-machine condition. It is stopped, by its own id, when the block ends."""
    if not on:
        yield None
        return
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.1f}" if abs(v) >= 10 else f"{v:.2f}"
    return str(v)


def print_rows(title: str, rows: list[dict[str, Any]], columns: list[str]) -> None:
    if not rows:
        return
    cells = [[fmt(r.get(c)) if not isinstance(r.get(c), str) else r[c] for c in columns] for r in rows]
    widths = [max(len(c), *(len(x[i]) for x in cells)) for i, c in enumerate(columns)]
    print(f"\n{title}\n" + " | ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
    print("-+-".join("-" * w for w in widths))
    for x in cells:
        print(" | ".join(c.ljust(w) for c, w in zip(x, widths, strict=True)))


def issue30_report(results: dict[str, dict[str, dict]], engines: list[Any], read_gbps: float | None,
                   kinds: list[str], e_shape: tuple[int, int, int] | None = None,
                   bf16_gflops: float | None = None) -> dict[str, Any]:
    """Print and return the issue 30 figures from one run's medians (`results`: workload -> engine -> median):
    the same-file pairs ((d) one at a time, (e) many at once), each file engine's bound next to its (d) ITL and
    its weight memory next to the file size, the slowdown under background load ((d) and (f)), and (with
    `e_shape` = (requests, prompt, output) of (e) and the bf16 matmul rate measured in the run) the
    arithmetic ceiling of (e) against the throughput its target needs."""
    import os

    from bench.gguf_bound import gguf_step_bytes

    out: dict[str, Any] = {}
    pairs = pair_ratios(results.get("d", {}), results.get("e", {}), kinds)
    if pairs:
        print_rows("tokenloom vs llama.cpp on the same file (> 1: tokenloom faster; ITL and TTFT one at a time, "
                   "throughput many at once)", [{"file": k, **v} for k, v in pairs.items()],
                   ["file", "itl_speedup", "ttft_ratio", "throughput_ratio"])
        out["pairs"] = pairs
    files = {e.name: e.file for e in engines if e.file}
    if files and read_gbps:
        paths = set(files.values())
        rows = bound_rows(results.get("d", {}), files, {p: gguf_step_bytes(p) for p in paths},
                          {p: os.path.getsize(p) for p in paths}, {e.name: e.weight_bytes for e in engines},
                          read_gbps)
        print_rows(f"Weight-bandwidth bound at {read_gbps:.1f} GB/s (2-thread read, measured in this run; ITL: (d))",
                   [{**r, "step_MB": r["step_bytes"] / 1e6, "weights_MB": (r["weight_bytes"] or 0) / 1e6 or None,
                     "file_MB": r["file_bytes"] / 1e6} for r in rows],
                   ["engine", "step_MB", "bound_ms", "itl_ms", "itl_over_bound", "weights_MB", "file_MB",
                    "weights_over_file"])
        out["read_gbps_2_threads"] = read_gbps
        out["bounds"] = rows
    many = results.get("e", {})
    if files and e_shape and bf16_gflops and any(n in many for n in files):
        from bench.gguf_ceiling import gguf_token_work, workload_flops

        requests, prompt_len, output_len = e_shape
        flops = {p: workload_flops(gguf_token_work(p), requests, prompt_len, output_len) for p in set(files.values())}
        rows = ceiling_rows(many, files, flops, requests * output_len, bf16_gflops)
        print_rows(f"(e)'s arithmetic ceiling at {bf16_gflops:.0f} GFLOP/s (best bf16 matmul, measured in this run): "
                   "the most output tok/s any server reaching that rate on every multiply-add can give",
                   rows, ["engine", "tflop", "ceiling_tok_s", "tok_s", "share_of_ceiling", "peer_best_tok_s",
                          "target", "needed_tok_s", "ceiling_over_peer", "reachable"])
        out["e_ceiling"] = {"bf16_gflops": bf16_gflops, "rows": rows}
    names = [e.name for e in engines]
    loaded = {wl: degradation(per, names) for wl, per in results.items() if any(LOAD_TAG in n for n in per)}
    for wl, per in loaded.items():
        print_rows(f"Slowdown next to one busy process, workload ({wl}) (target <= {DEGRADATION_TARGET}x)",
                   [{"engine": n, **v} for n, v in per.items()],
                   ["engine", "throughput_slowdown", "itl_slowdown", "met"])
    if loaded:
        out["degradation"] = loaded
    return out
