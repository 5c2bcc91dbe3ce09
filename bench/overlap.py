"""Overlap scheduler benchmark: `--overlap-schedule off` vs `on` vs `auto`, in one run, alternating.

    .venv/bin/python bench/overlap.py                    # SmolLM2 and a ~1B random model, 2 rounds
    .venv/bin/python bench/overlap.py --quick            # small counts, 1 round (a few minutes)
    .venv/bin/python bench/overlap.py --models smollm2   # one model only

Models: (1) SmolLM2-135M-Instruct (the default GGUF, bf16); (2) a random ~1.1B-parameter Llama
(TinyLlama's shape: hidden 2048, 22 layers, 32 heads / 4 KV heads, intermediate 5632; SmolLM2's vocabulary
and tokenizer) with `--load-format dummy`, bf16, so the forward dominates the step.

Workload per run: `--num-prompts` (default 128) random-id prompts of `--input-len` tokens, all submitted at
once with `--max-running-requests` equal to the prompt count (so 128 requests decode together), greedy,
`--output-len` new tokens each (ignore_eos). The three engines (one per mode) are started up front and run
the same prompts in rotating order, round after round; idle engines only poll their inbox.

Reported per model and mode (means over rounds), from the loop's cumulative counters around each run:
- output throughput (generated tokens / wall time of the `generate` call);
- mean ITL: the mean decode-step period (every running request gets one token per decode step);
- forward idle: the fraction of the run's wall time in which no forward or sampling was executing,
  i.e. the scheduler work left on the critical path (plus prefill/decode hand-offs);
- scheduler CPU share: the scheduler's CPU time outside the forward / wall time (hidden when overlapped).
Targets (issue 6): overlap >= 1.10x normal on the 1B model; auto within noise (5%) of the better fixed
mode on both; forward idle under 5% with overlap at 128 running requests. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import dummy_model_folder  # noqa: E402
from tokenloom import Engine  # noqa: E402

MODES = ("off", "on", "auto")
ONE_B_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
    "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32, "num_key_value_heads": 4,
    "vocab_size": 49152, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False, "hidden_act": "silu",
    "torch_dtype": "bfloat16",
}


def one_b_folder() -> str:
    """config.json of the ~1B shape plus SmolLM2's tokenizer (weights come from --load-format dummy)."""
    return dummy_model_folder("tokenloom-bench-1b", ONE_B_CONFIG)


def make_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 49000, (n, length), generator=g).tolist()


def counters(engine: Engine) -> dict:
    return engine.get_server_info()


def run_once(engine: Engine, prompts: list[list[int]], output_len: int) -> dict:
    params = {"temperature": 0, "max_new_tokens": output_len, "ignore_eos": True}
    before = counters(engine)
    start = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    wall = time.perf_counter() - start
    after = counters(engine)
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)

    def delta(key: str) -> float:
        return after[key] - before[key]

    loop_wall = delta("loop_wall_s")
    steps = delta("decode_steps")
    return {
        "output_tok_s": tokens / wall,
        "wall_s": wall,
        "mean_itl_ms": 1e3 * delta("decode_period_s") / steps if steps else float("nan"),
        "forward_idle": max(0.0, 1 - delta("forward_busy_s") / loop_wall),
        "scheduler_cpu_share": delta("scheduler_cpu_s") / loop_wall,
        "decode_steps": steps,
        "overlap_active_after": after.get("overlap_active"),
        "overlap_decision": after.get("overlap_decision"),
    }


def bench_model(name: str, engine_args: dict, prompts: list[list[int]], output_len: int, rounds: int) -> dict:
    engines = {}
    try:
        for mode in MODES:
            t = time.perf_counter()
            engines[mode] = Engine(overlap_schedule=mode, **engine_args)
            print(f"[{name}] engine {mode} ready in {time.perf_counter() - t:.0f} s", flush=True)
        for mode in MODES:  # warm-up: kernels, allocator, first probe of auto
            engines[mode].generate(input_ids=prompts[:8], sampling_params={"temperature": 0, "max_new_tokens": 8,
                                                                            "ignore_eos": True})
        runs: dict[str, list[dict]] = {m: [] for m in MODES}
        for r in range(rounds):
            order = MODES[r % 3:] + MODES[: r % 3]
            for mode in order:
                res = run_once(engines[mode], prompts, output_len)
                runs[mode].append(res)
                print(f"[{name}] round {r + 1} {mode:>4}: {res['output_tok_s']:8.1f} tok/s, mean ITL "
                      f"{res['mean_itl_ms']:7.1f} ms, forward idle {100 * res['forward_idle']:5.1f}%, scheduler "
                      f"CPU {100 * res['scheduler_cpu_share']:5.1f}%"
                      + (f", auto chose {res['overlap_decision']['chosen']}" if mode == "auto"
                         and res["overlap_decision"] else ""), flush=True)
    finally:
        for eng in engines.values():
            eng.shutdown()
    summary = {}
    for mode, results in runs.items():
        summary[mode] = {key: sum(x[key] for x in results) / len(results)
                         for key in ("output_tok_s", "mean_itl_ms", "forward_idle", "scheduler_cpu_share")}
        summary[mode]["decisions"] = [x["overlap_decision"]["chosen"] for x in results
                                      if x.get("overlap_decision")]
    return summary


def targets(model: str, summary: dict) -> dict:
    off, on, auto = (summary[m]["output_tok_s"] for m in MODES)
    best = max(off, on)
    out = {"overlap_vs_normal": on / off, "auto_vs_best_fixed": auto / best,
           "overlap_forward_idle": summary["on"]["forward_idle"]}
    out["auto_within_5pct_met"] = auto >= 0.95 * best
    out["overlap_idle_under_5pct_met"] = summary["on"]["forward_idle"] < 0.05
    if model == "1b":
        out["overlap_10pct_ahead_met"] = on >= 1.10 * off
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="smollm2,1b")
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="32 prompts, 48 output tokens, 1 round")
    ns = p.parse_args()
    if ns.quick:
        ns.num_prompts, ns.output_len, ns.rounds = 32, 48, 1
    prompts = make_prompts(ns.num_prompts, ns.input_len, seed=0)
    common = dict(dtype="bfloat16", log_level="warning", max_running_requests=ns.num_prompts,
                  max_total_tokens=ns.num_prompts * (ns.input_len + ns.output_len + 16) + 4096)
    models = {"smollm2": dict(model_path=None), "1b": dict(model_path=one_b_folder(), load_format="dummy")}
    report = {"bench": "overlap", "num_prompts": ns.num_prompts, "input_len": ns.input_len,
              "output_len": ns.output_len, "rounds": ns.rounds, "threads": torch.get_num_threads(), "models": {}}
    for name in ns.models.split(","):
        summary = bench_model(name, {**common, **models[name]}, prompts, ns.output_len, ns.rounds)
        report["models"][name] = {"modes": summary, "targets": targets(name, summary)}
    print()
    print(f"{'model':8} {'mode':5} {'tok/s':>8} {'ITL ms':>8} {'fwd idle':>9} {'sched CPU':>10}")
    for name, entry in report["models"].items():
        for mode in MODES:
            s = entry["modes"][mode]
            print(f"{name:8} {mode:5} {s['output_tok_s']:8.1f} {s['mean_itl_ms']:8.1f} "
                  f"{100 * s['forward_idle']:8.1f}% {100 * s['scheduler_cpu_share']:9.1f}%")
        print(f"{name:8} targets: {entry['targets']}")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
