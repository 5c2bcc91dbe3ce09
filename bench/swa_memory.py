"""KV memory one request holds in a sliding-window model at 8k context: the sliding-window pool against one
full pool (`--disable-hybrid-swa-memory`), measured from the pools' own accounting.

    .venv/bin/python bench/swa_memory.py                 # Gemma-3-like layer pattern, window 512, 8k prompt
    .venv/bin/python bench/swa_memory.py --window 1024 --prompt 8000 --pattern mistral

The model: random weights in a tiny Qwen2-style config (hidden 256, head_dim 64, 4 KV heads) whose layers are
`--pattern gemma3` (five sliding, then one full, x2: 12 layers) or `mistral` (every layer sliding), written by
transformers to a temporary folder. One request (`--prompt` random tokens, `--new` greedy tokens, chunked
prefill of `--chunk`) runs through the real scheduler loop; after every step the bytes it holds are read
from the allocators: full-pool slots in use x the bytes a slot holds over the full layers, plus (sliding-window
pool) sliding slots in use x the bytes one holds over the sliding layers. Reported: the peak over the run and
the figure at the last decode step, for both pools, their ratio, the bound (window + chunk positions of the
sliding layers plus every position of the full ones) and the pools' allocated bytes. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tokenloom.config import ServerArgs  # noqa: E402
from tokenloom.executor.model_runner import ModelRunner  # noqa: E402
from tokenloom.executor.worker import ModelWorker  # noqa: E402
from tokenloom.ipc import LocalChannel  # noqa: E402
from tokenloom.protocol import TokenizedRequest  # noqa: E402
from tokenloom.sampling.sampling_params import SamplingParams  # noqa: E402
from tokenloom.scheduler.loops import make_event_loop  # noqa: E402
from tokenloom.scheduler.scheduler import Scheduler  # noqa: E402


def make_model(folder: str, window: int, pattern: str, context: int) -> list[str]:
    import transformers

    layers = 12 if pattern == "gemma3" else 6
    types = [("full_attention" if pattern == "gemma3" and i % 6 == 5 else "sliding_attention") for i in range(layers)]
    config = transformers.Qwen2Config(hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=4, head_dim=64, vocab_size=1024,
                                      max_position_embeddings=context, use_sliding_window=True,
                                      sliding_window=window, layer_types=types)
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    return types


def held_bytes(runner: ModelRunner) -> int:
    """KV bytes held now, from the allocators (one request running: all of it is that request's)."""
    memory, alloc, pool = runner.memory, runner.memory.token_allocator, runner.memory.kv_pool
    full_slots = memory.max_total_num_tokens - alloc.full_available_size()
    if hasattr(pool, "bytes_per_token"):
        full_bpt, swa_bpt = pool.bytes_per_token()
        return full_slots * full_bpt + alloc.swa_in_use() * swa_bpt
    return full_slots * (pool.nbytes() // pool.rows)


def run(folder: str, args: argparse.Namespace, hybrid: bool) -> dict:
    server_args = ServerArgs(model_path=folder, dtype="bfloat16", max_total_tokens=args.prompt + args.new + 64,
                             max_running_requests=2, chunked_prefill_size=args.chunk, overlap_schedule="off",
                             disable_hybrid_swa_memory=not hybrid, swa_full_tokens_ratio=args.swa_ratio,
                             num_threads=args.threads)
    runner = ModelRunner(server_args)
    inbox, outbox = LocalChannel(), LocalChannel()
    scheduler = Scheduler(server_args, ModelWorker(runner, ()), None, outbox.send, runner.memory)
    loop = make_event_loop(server_args, scheduler, inbox)
    prompt = torch.randint(0, 1024, (args.prompt,), generator=torch.Generator().manual_seed(1)).tolist()
    params = SamplingParams.from_dict({"temperature": 0, "max_new_tokens": args.new, "ignore_eos": True}, 1024)
    inbox.send(TokenizedRequest("r", None, prompt, params))
    peak = last = steps = 0
    while loop.run_once():
        steps += 1
        now = held_bytes(runner)
        peak = max(peak, now)
        if scheduler.running:
            last = now
    runner.memory.check_idle_integrity()
    return {"peak_bytes": peak, "last_decode_bytes": last, "pool_bytes": runner.memory.kv_pool.nbytes(),
            "steps": steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--prompt", type=int, default=8000)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--pattern", choices=("gemma3", "mistral"), default="gemma3")
    ap.add_argument("--swa-ratio", type=float, default=0.8, help="--swa-full-tokens-ratio of the sliding pool")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        types = make_model(folder, args.window, args.pattern, 8192)
        swa, full = run(folder, args, True), run(folder, args, False)
    layers, sliding = len(types), types.count("sliding_attention")
    per_layer_token = 2 * 4 * 64 * 2  # K and V, 4 KV heads, head_dim 64, bf16
    total = args.prompt + args.new
    bound = (per_layer_token * (layers - sliding) * total
             + per_layer_token * sliding * (args.window + 1 + args.chunk + args.window + 1))
    result = {"pattern": args.pattern, "layers": layers, "sliding_layers": sliding, "window": args.window,
              "context_tokens": total, "chunk": args.chunk, "swa_pool": swa, "full_pool": full,
              "peak_ratio": round(swa["peak_bytes"] / full["peak_bytes"], 4),
              "bound_bytes": bound, "within_bound": swa["peak_bytes"] <= bound}
    for name, r in (("sliding-window pool", swa), ("one full pool", full)):
        print(f"{name:>20}: peak {r['peak_bytes'] / 2**20:7.2f} MiB, at the last decode step "
              f"{r['last_decode_bytes'] / 2**20:7.2f} MiB, pool allocated {r['pool_bytes'] / 2**20:7.2f} MiB")
    print(f"peak ratio {result['peak_ratio']:.3f}; bound {bound / 2**20:.2f} MiB "
          f"({'within' if result['within_bound'] else 'OVER'})")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
