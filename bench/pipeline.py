"""Issue 18's speed check: PP=1 vs PP=2 through the real engine (launcher, stage processes, `PipelineLoop`), one run.

    .venv/bin/python bench/pipeline.py                 # every configuration, 3 rounds
    .venv/bin/python bench/pipeline.py --quick         # fewer prompts and tokens, 1 round
    .venv/bin/python bench/pipeline.py --json-out F    # also write the runs for `bench/pp_sim.py --validate F`

Model: a random ~0.22B Llama (hidden 1024, 16 layers, 16 heads / 4 KV heads, intermediate 2816, vocabulary 8192;
SmolLM2's tokenizer), `--load-format dummy`, bf16: large enough that the forward dominates a step, and a LM head
no heavier than a layer, so SGLang's even split (8 / 8) balances the stages and what is measured is the
pipeline's own cost. `--vocab 49152` (SmolLM2's vocabulary) makes the last stage's LM head and sampling outweigh
many layers: then stage 0 idles whatever the split (`--partition`). The two stage processes share this machine's
two cores (one thread each), while PP=1 runs one process with both threads. No gain is expected here: the figure
shows what the pipeline costs.

Configurations (PP=2): depth 0, 1, 2 with the loop's two send optimizations on (the early output send: the last
stage's output leaves for stage 0 as its forward ends; overlapped sends: sends posted right behind their step,
overlapping the next receives); at depth 0 each off alone and both off (`pp2_d0_seed_off`, a name kept for existing
results; TOKENLOOM_PP_EARLY_OUTPUT_SEND=0 / TOKENLOOM_PP_OVERLAP_SENDS=0); `_nobind`: depth 0 or 2 with the stages
not bound to a core each (TOKENLOOM_CPU_OMP_THREADS_BIND=nobind). The PP=1 engine stays up the whole run; each PP=2
engine is started in turn and its rounds alternate with PP=1's (who goes first alternates), so every ratio is side
by side. Workload per run: `--num-prompts` (64) random-id prompts of `--input-len` tokens (new prompts every round,
the same for both engines: no prefix-cache hits), submitted at once with --max-running-requests = the prompt count
(64 running requests: two micro-batches of 32 at PP=2), greedy, `--output-len` new tokens each.

Reported per configuration (medians over rounds), from the loops' cumulative counters around each run:
- output throughput and its ratio to PP=1's within the round (PP1 / PP2: the slowdown);
- mean ITL: the mean period between one lane's consecutive decode results (one token of its requests);
- per stage: busy = its own forward time / wall, bubble = 1 - busy (the time its forward sat idle while the
  run was going), and its time blocked receiving (requests, proxy, outputs), sending and waiting for its
  forward;
- the same busy and bubble fractions over the steady state only: both engines' counters are sampled every
  0.5 s during a run, and the window runs from the first sample at which the last stage had prefilled every
  prompt to the last at which all the requests still ran on every stage (`steady_window`). So the fill (the
  first lane's prefill, which the other stage cannot overlap) and the drain are out of it: that is the
  bubble "at 64 running requests"; the whole-run figure above includes them;
- the stage costs `bench/pp_sim.py --validate` needs (decode step and prefill token times of each stage,
  scheduler CPU per step, and a gloo link measured by a ping-pong of a small and a proxy-sized message).
Targets (issue 18): PP=2 bubble below 15% at 64 running requests (the worse stage); PP=2 throughput within
1.3x of PP=1's. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import dummy_model_folder  # noqa: E402
from tokenloom import Engine  # noqa: E402

MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 1024,
    "intermediate_size": 2816, "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 4,
    "vocab_size": 8192, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False, "hidden_act": "silu",
    "torch_dtype": "bfloat16",
}
# name -> (depth, early output send, overlapped sends, each stage bound to its own core)
CONFIGS: dict[str, tuple[int, bool, bool, bool]] = {
    "pp2_d0": (0, True, True, True), "pp2_d1": (1, True, True, True), "pp2_d2": (2, True, True, True),
    "pp2_d0_no_early_send": (0, False, True, True), "pp2_d0_no_overlap_sends": (0, True, False, True),
    "pp2_d0_seed_off": (0, False, False, True),
    "pp2_d0_nobind": (0, True, True, False), "pp2_d2_nobind": (2, True, True, False),
}
BUBBLE_TARGET = 0.15
SLOWDOWN_TARGET = 1.3


def model_folder(vocab: int) -> str:
    """config.json of the benchmark's shape plus SmolLM2's tokenizer (weights: --load-format dummy)."""
    return dummy_model_folder(f"tokenloom-bench-pp-v{vocab}", {**MODEL_CONFIG, "vocab_size": vocab})


def make_prompts(n: int, length: int, seed: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (n, length), generator=g).tolist()


# --------------------------------------------------------------------------------------------------------
# pure arithmetic (unit-tested in tests/unit/test_bench_pipeline.py)


def stage_figures(before: dict, after: dict, wall_s: float) -> dict:
    """One stage's share of a run from its cumulative counters (`pp_stages` entries) before and after."""
    def d(key: str) -> float:
        return after[key] - before[key]

    busy = d("stage_forward_s") / wall_s if wall_s > 0 else 0.0
    steps, reqs, tokens = d("stage_decode_steps"), d("stage_decode_reqs"), d("stage_prefill_tokens")
    return {"busy": busy, "bubble": max(0.0, 1.0 - busy), "recv_wait_s": d("recv_wait_s"),
            "send_wait_s": d("send_wait_s"), "forward_wait_s": d("forward_wait_s"),
            "decode_step_s": d("stage_decode_s") / steps if steps else float("nan"),
            "decode_batch": reqs / steps if steps else float("nan"),
            "prefill_token_s": d("stage_prefill_s") / tokens if tokens else float("nan"), "prefill_tokens": tokens,
            "scheduler_cpu_per_step_s": d("scheduler_cpu_s") / d("iterations") if d("iterations") else 0.0}


def steady_window(samples: list[tuple[float, dict]],
                  num_requests: int) -> tuple[tuple[float, dict], tuple[float, dict]] | None:
    """The run's steady state, from its (time, server info) samples: the samples at which all `num_requests`
    ran on every stage, none waited, and the last stage had prefilled as many tokens as stage 0 (no prefill
    in the pipe; a prompt's prefix-cache hit makes that fewer than its length), first to last. None when
    fewer than two samples fall inside (a run too short to sample)."""
    def steady(info: dict) -> bool:
        stages = info["pp_stages"]
        return all(st["num_running_reqs"] >= num_requests and st["num_waiting_reqs"] == 0 for st in stages) \
            and stages[-1]["stage_prefill_tokens"] == stages[0]["stage_prefill_tokens"]

    inside = [(t, info) for t, info in samples if steady(info)]
    return (inside[0], inside[-1]) if len(inside) >= 2 else None


def steady_figures(window: tuple[tuple[float, dict], tuple[float, dict]] | None) -> dict:
    """Each stage's busy and bubble fractions over the steady window (`steady_window`), and its length."""
    if window is None:
        return {"window_s": 0.0, "stages": [], "bubble_worst": float("nan")}
    (t0, first), (t1, last) = window
    wall = t1 - t0
    stages = []
    for before, after in zip(first["pp_stages"], last["pp_stages"], strict=True):
        busy = (after["stage_forward_s"] - before["stage_forward_s"]) / wall
        stages.append({"busy": busy, "bubble": max(0.0, 1.0 - busy)})
    return {"window_s": wall, "stages": stages, "bubble_worst": max(s["bubble"] for s in stages)}


def single_figures(before: dict, after: dict, wall_s: float) -> dict:
    """PP=1's counterpart of `stage_figures` (its loop counts forward+sample time as `forward_busy_s`)."""
    busy = (after["forward_busy_s"] - before["forward_busy_s"]) / wall_s if wall_s > 0 else 0.0
    return {"busy": busy, "bubble": max(0.0, 1.0 - busy)}


def median_of(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


# --------------------------------------------------------------------------------------------------------
# runs


async def _generate_sampled(engine: Engine, prompts: list[list[int]], params: dict,
                            every_s: float | None) -> tuple[list[dict], list[tuple[float, dict]]]:
    """Generate, and every `every_s` seconds meanwhile (None: never) take the server's counters."""
    task = asyncio.ensure_future(engine.async_generate(input_ids=prompts, sampling_params=params))
    samples: list[tuple[float, dict]] = []
    while every_s is not None and not task.done():
        await asyncio.wait([task], timeout=every_s)
        if not task.done():
            samples.append((time.perf_counter(), await engine.async_get_server_info()))
    return await task, samples


def run_once(engine: Engine, prompts: list[list[int]], output_len: int, sample_every_s: float | None = None) -> dict:
    """One timed run; with `sample_every_s` (PP only) also the steady state's figures (`steady_window`)."""
    params = {"temperature": 0, "max_new_tokens": output_len, "ignore_eos": True}
    before = engine.get_server_info()
    start = time.perf_counter()
    outs, samples = engine.run(_generate_sampled(engine, prompts, params, sample_every_s))
    wall = time.perf_counter() - start
    after = engine.get_server_info()
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    steps = after["decode_steps"] - before["decode_steps"]
    res = {"output_tok_s": tokens / wall, "wall_s": wall,
           "mean_itl_ms": 1e3 * (after["decode_period_s"] - before["decode_period_s"]) / steps if steps else 0.0}
    if "pp_stages" in after:
        res["stages"] = [stage_figures(b, a, wall) for b, a in zip(before["pp_stages"], after["pp_stages"],
                                                                   strict=True)]
        res["bubble_worst"] = max(s["bubble"] for s in res["stages"])
        res["steady"] = steady_figures(steady_window(samples, len(prompts)))
    else:
        res.update(single_figures(before, after, wall))
        res["bubble_worst"] = res["bubble"]
    return res


def _link_worker(rank: int, port: int, sizes: list[int], reps: int, out: Any) -> None:
    from tokenloom.distributed.groups import destroy_distributed, init_distributed
    from tokenloom.distributed.pp_channel import PPChannel

    torch.set_num_threads(1)
    ctx = init_distributed(1, 2, rank, f"127.0.0.1:{port}", "cpu", init_timeout_s=60, op_timeout_s=60)
    try:
        chan = PPChannel(ctx.world_cpu_group, 1 - rank, 1 - rank)
        result = {}
        for size in sizes:
            x = torch.zeros(size // 2, dtype=torch.bfloat16)
            times = []
            for _ in range(reps):
                start = time.perf_counter()
                if rank == 0:
                    chan.isend("x", {"x": x})
                    chan.recv("x")
                else:
                    chan.recv("x")
                    chan.isend("x", {"x": x})
                times.append(time.perf_counter() - start)
            chan.wait_send()
            result[size] = statistics.median(times) / 2  # one way
        if rank == 0:
            out.put(result)
    finally:
        destroy_distributed()


def measure_link(proxy_bytes: int, reps: int = 30) -> dict:
    """One-way time of a tiny message (latency) and of a proxy-sized one (-> bandwidth) over PPChannel/gloo."""
    import torch.multiprocessing as mp

    from tokenloom.entrypoints.launcher import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    sizes = [16, proxy_bytes]
    procs = [ctx.Process(target=_link_worker, args=(r, port, sizes, reps, out)) for r in range(2)]
    for p in procs:
        p.start()
    result = out.get(timeout=120)
    for p in procs:
        p.join(timeout=30)
    latency = result[16]
    bandwidth = proxy_bytes / max(result[proxy_bytes] - latency, 1e-9)
    return {"link_latency_s": latency, "link_bytes_per_s": bandwidth, "proxy_one_way_s": result[proxy_bytes]}


def stage_costs(runs: list[dict], link: dict) -> dict:
    """The cost model `bench/pp_sim.py` takes, from a configuration's measured runs: the forward costs per
    stage (lists, medians over the runs: the last stage also samples, so the stages differ), the scheduler CPU
    per iteration (the median over stages and runs; the sim charges every stage the same, half before the
    forward, half after) and the link. A prefill token's cost is a stage's extend forward time over the
    tokens it computed (prefix-cache hits excluded: see `cached_prompt_tokens`)."""
    n = len(runs[0]["stages"])

    def per_stage(fn) -> list[float]:
        return [statistics.median(fn(r["stages"][i]) for r in runs) for i in range(n)]

    cpu = statistics.median(s["scheduler_cpu_per_step_s"] for r in runs for s in r["stages"])
    return {"prefill_a_s": 0.0, "prefill_b_s_per_token": per_stage(lambda s: s["prefill_token_s"]),
            "decode_c_s": 0.0, "decode_d_s_per_req": per_stage(lambda s: s["decode_step_s"] / s["decode_batch"]),
            "decode_e_s_per_kv_token": 0.0, "sched_s": cpu / 2, "process_s": cpu / 2,
            "link_latency_s": link["link_latency_s"], "link_bytes_per_s": link["link_bytes_per_s"],
            "hidden_size": MODEL_CONFIG["hidden_size"]}


def cached_prompt_tokens(runs: list[dict], num_requests: int, input_len: int) -> int:
    """Prompt tokens per request the engine took from its prefix cache rather than prefilling, from stage 0's
    prefilled-token count (median over the runs). Every run repeats the warm-up's prompts, so the cache holds
    them: all but the last token of each match (`Req.init_next_round_input`), one token is prefilled."""
    prefilled = statistics.median(r["stages"][0]["prefill_tokens"] for r in runs) / num_requests
    return max(0, round(input_len - prefilled))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=48)
    p.add_argument("--sample-every", type=float, default=0.5,
                   help="seconds between counter samples during a timed run (the steady window); 0: none")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--quick", action="store_true", help="16 prompts, 16 output tokens, 1 round")
    p.add_argument("--json-out", default=None)
    p.add_argument("--partition", default="",
                   help="TOKENLOOM_PP_LAYER_PARTITION of the PP=2 engines (default: SGLang's even split)")
    p.add_argument("--vocab", type=int, default=MODEL_CONFIG["vocab_size"],
                   help="the model's vocabulary (49152 = SmolLM2's: a last stage heavy with the LM head)")
    ns = p.parse_args()
    if ns.quick:
        ns.num_prompts, ns.output_len, ns.rounds = 16, 16, 1
    fresh = iter(range(1, 1_000_000))  # every run gets prompts no engine has seen (no prefix-cache hits)

    def prompts() -> list[list[int]]:
        return make_prompts(ns.num_prompts, ns.input_len, seed=next(fresh), vocab=ns.vocab)
    common = dict(model_path=model_folder(ns.vocab), load_format="dummy", dtype="bfloat16", log_level="warning",
                  max_running_requests=ns.num_prompts,
                  max_total_tokens=ns.num_prompts * (ns.input_len + ns.output_len + 16) + 4096)
    link = measure_link(2 * MODEL_CONFIG["hidden_size"] * 2 * (ns.num_prompts // 2))
    print(f"link: one-way latency {1e6 * link['link_latency_s']:.0f} us, "
          f"{link['link_bytes_per_s'] / 1e6:.0f} MB/s", flush=True)
    report: dict[str, Any] = {"bench": "pipeline", "num_prompts": ns.num_prompts, "input_len": ns.input_len,
                              "output_len": ns.output_len, "rounds": ns.rounds, "link": link, "configs": {}}
    pp1 = Engine(**common)
    try:
        run_once(pp1, prompts(), 16)
        for name in ns.configs.split(","):
            depth, early, overlap, bind = CONFIGS[name]
            os.environ["TOKENLOOM_CPU_OMP_THREADS_BIND"] = "auto" if bind else "nobind"
            os.environ["TOKENLOOM_PP_EARLY_OUTPUT_SEND"] = "1" if early else "0"
            os.environ["TOKENLOOM_PP_OVERLAP_SENDS"] = "1" if overlap else "0"
            partition = ns.partition
            if partition:
                os.environ["TOKENLOOM_PP_LAYER_PARTITION"] = partition
            else:
                os.environ.pop("TOKENLOOM_PP_LAYER_PARTITION", None)
            pp2 = Engine(pp_size=2, pp_async_batch_depth=depth, **common)
            try:
                run_once(pp2, prompts(), 16)  # untimed: the full batch once (allocator, kernels, both stages)
                runs1, runs2, ratios = [], [], []
                for r in range(ns.rounds):
                    order = [(pp1, runs1), (pp2, runs2)] if r % 2 == 0 else [(pp2, runs2), (pp1, runs1)]
                    round_prompts = prompts()  # the same prompts for both engines in a round
                    for engine, runs in order:
                        runs.append(run_once(engine, round_prompts, ns.output_len, ns.sample_every or None))
                    ratios.append(runs1[-1]["output_tok_s"] / runs2[-1]["output_tok_s"])
                    s = runs2[-1]["stages"]
                    print(f"[{name}] round {r + 1}: PP1 {runs1[-1]['output_tok_s']:7.1f} tok/s, PP2 "
                          f"{runs2[-1]['output_tok_s']:7.1f} tok/s (PP1/PP2 {ratios[-1]:.3f}); PP2 bubble "
                          + " / ".join(f"{100 * x['bubble']:.1f}%" for x in s)
                          + f", ITL {runs2[-1]['mean_itl_ms']:.0f} vs {runs1[-1]['mean_itl_ms']:.0f} ms; steady "
                          + " / ".join(f"{100 * x['bubble']:.1f}%" for x in runs2[-1]["steady"]["stages"])
                          + f" over {runs2[-1]['steady']['window_s']:.1f} s", flush=True)
            finally:
                pp2.shutdown()
            report["configs"][name] = {
                "depth": depth, "early_output_send": early, "overlap_sends": overlap,
                "layer_partition": partition or "8,8 (SGLang's split)", "vocab_size": ns.vocab,
                "pp1_output_tok_s": median_of(runs1, "output_tok_s"), "pp2_output_tok_s": median_of(runs2,
                                                                                                     "output_tok_s"),
                "slowdown_pp1_over_pp2": statistics.median(ratios), "slowdown_runs": ratios,
                "pp1_mean_itl_ms": median_of(runs1, "mean_itl_ms"), "pp2_mean_itl_ms": median_of(runs2, "mean_itl_ms"),
                "pp1_bubble": median_of(runs1, "bubble"), "pp2_bubble_worst": median_of(runs2, "bubble_worst"),
                "pp2_stages": [{key: statistics.median(r["stages"][i][key] for r in runs2)
                                for key in runs2[0]["stages"][i]} for i in range(2)],
                "stage_costs": stage_costs(runs2, link),
                "cached_prompt_tokens": cached_prompt_tokens(runs2, ns.num_prompts, ns.input_len),
                "bubble_under_15pct_met": median_of(runs2, "bubble_worst") < BUBBLE_TARGET,
                "pp2_steady_bubble_worst": statistics.median(r["steady"]["bubble_worst"] for r in runs2),
                "pp2_steady_stages": [{"bubble": statistics.median([r["steady"]["stages"][i]["bubble"] for r in runs2
                                                                    if r["steady"]["stages"]] or [float("nan")])}
                                      for i in range(2)],
                "steady_window_s": statistics.median(r["steady"]["window_s"] for r in runs2),
                "steady_bubble_under_15pct_met": statistics.median(r["steady"]["bubble_worst"] for r in runs2)
                < BUBBLE_TARGET,
                "within_1_3x_met": statistics.median(ratios) <= SLOWDOWN_TARGET,
            }
    finally:
        pp1.shutdown()
    print()
    print(f"{'config':24} {'PP1 tok/s':>9} {'PP2 tok/s':>9} {'PP1/PP2':>8} {'bubble s0/s1':>14} {'ITL ms':>7} "
          f"{'recv wait s0/s1':>16} {'steady s0/s1':>14}")
    for name, c in report["configs"].items():
        st = c["pp2_stages"]
        print(f"{name:24} {c['pp1_output_tok_s']:9.1f} {c['pp2_output_tok_s']:9.1f} {c['slowdown_pp1_over_pp2']:8.3f} "
              f"{100 * st[0]['bubble']:6.1f}/{100 * st[1]['bubble']:5.1f}% {c['pp2_mean_itl_ms']:7.0f} "
              f"{st[0]['recv_wait_s']:7.2f}/{st[1]['recv_wait_s']:6.2f} s "
              + "/".join(f"{100 * x['bubble']:5.1f}" for x in c["pp2_steady_stages"]) + "%")
    if ns.json_out:
        from tokenloom.config import ServerArgs

        runs = [{"pp": 2, "depth": c["depth"], "early_output_send": c["early_output_send"],
                 "grouped_sends": c["overlap_sends"], "num_requests": ns.num_prompts, "input_len": ns.input_len,
                 "output_len": ns.output_len, "max_running_requests": ns.num_prompts,
                 "cached_prompt_tokens": c["cached_prompt_tokens"],
                 "chunked_prefill_size": ServerArgs().chunked_prefill_size,
                 "measured": {"output_throughput": c["pp2_output_tok_s"],
                              "bubble_fraction": [s["bubble"] for s in c["pp2_stages"]],
                              "itl_ms_mean": c["pp2_mean_itl_ms"]},
                 "stage_costs": c["stage_costs"]} for c in report["configs"].values()]
        with open(ns.json_out, "w") as f:
            json.dump({"runs": runs}, f, indent=1)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
