"""Many short requests at once, where per-request CPU work (KV indices, batching) weighs most (scaled to
this machine): per-step CPU time outside the forward, and its share of the step, at the largest decode batch.

    .venv/bin/python bench/many_requests.py                 # 2000 prompts, input 32, output 128, 2048 slots
    .venv/bin/python bench/many_requests.py --num-prompts 512 --output-len 32    # a few minutes

SmolLM2-135M-Instruct (bf16) in a `tokenloom.Engine` with `--enable-step-profile`, all prompts submitted at
once (rate inf), `--max-running-requests 2048`, a KV pool sized so every request fits (no retraction), greedy
with ignore_eos. Runs once with `--overlap-schedule off` (the scheduler's work sits on the critical path, so
its share is what a user pays) and, unless `--modes off`, once with `on` (where it is hidden unless it
exceeds the forward).

Per mode: decode steps at the largest batch size seen (steps with batch >= 90% of the maximum), mean ms of
each phase (schedule, prepare, forward, sample, process), the CPU time outside the forward per step and its
share of the step period; output throughput. Target (issue 7): under 10% of the step at the largest batch.
The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tokenloom import Engine  # noqa: E402

PHASES = ("schedule", "prepare", "forward", "sample", "process")


def run_mode(mode: str, prompts: list[list[int]], output_len: int, max_running: int) -> dict:
    tokens = len(prompts) * (len(prompts[0]) + output_len + 8) + 4096
    with Engine(dtype="bfloat16", log_level="warning", overlap_schedule=mode, enable_step_profile=True,
                max_running_requests=max_running, max_total_tokens=tokens, chunked_prefill_size=4096,
                max_prefill_tokens=4096) as engine:
        engine.generate(input_ids=prompts[:4], sampling_params={"temperature": 0, "max_new_tokens": 4})
        start = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": output_len,
                                                                   "ignore_eos": True})
        wall = time.perf_counter() - start
        big = engine.get_server_info()["step_profile"]["largest_batch"]
    generated = sum(o["meta_info"]["completion_tokens"] for o in outs)
    result = {"mode": mode, "output_tok_s": generated / wall, "max_decode_batch": big["mean_batch_size"],
              "steps_at_max": big["steps"]}
    for name in (*PHASES, "period"):
        result[f"{name}_ms"] = big[name]["mean_ms"]
    result["cpu_outside_forward_ms"] = result["schedule_ms"] + result["prepare_ms"] + result["process_ms"]
    result["cpu_outside_forward_share"] = result["cpu_outside_forward_ms"] / result["period_ms"]
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=2000)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-running-requests", type=int, default=2048)
    p.add_argument("--modes", default="off,on")
    ns = p.parse_args()
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(100, 49000, (ns.num_prompts, ns.input_len), generator=g).tolist()
    report = {"bench": "many_requests", "num_prompts": ns.num_prompts, "input_len": ns.input_len,
              "output_len": ns.output_len, "max_running_requests": ns.max_running_requests, "runs": []}
    for mode in ns.modes.split(","):
        res = run_mode(mode, prompts, ns.output_len, ns.max_running_requests)
        report["runs"].append(res)
        print(f"overlap {mode:>3}: {res['output_tok_s']:.1f} tok/s; at decode batch {res['max_decode_batch']:.0f} "
              f"({res['steps_at_max']} steps): " + ", ".join(f"{n} {res[n + '_ms']:.1f}" for n in PHASES)
              + f" ms; period {res['period_ms']:.1f} ms; CPU outside the forward {res['cpu_outside_forward_ms']:.1f}"
              f" ms = {100 * res['cpu_outside_forward_share']:.1f}% of the step (target < 10%)", flush=True)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
