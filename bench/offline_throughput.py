"""Offline throughput: N prompts through `tokenloom.Engine.generate` and, in the same run, through
`transformers` batched `generate` (static batches, left padding) on the same weights and dtype.

    .venv/bin/python bench/offline_throughput.py            # 256 prompts, input 128..512, output 128
    .venv/bin/python bench/offline_throughput.py --quick    # about a minute

Prints output tokens/s of each, their ratio, and the fraction of the bf16 matmul roofline (measured in the
same run) that the workload's FLOPs reach. The last line is one JSON object with the headline figures.
Both sides generate exactly `--output-len` tokens per prompt (ignore_eos / min_new_tokens), greedy.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import ModelShape, measure_roofline  # noqa: E402
from tokenloom import Engine  # noqa: E402


def make_prompts(n: int, min_len: int, max_len: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(min_len, max_len + 1, (n,), generator=g).tolist()
    return [torch.randint(100, vocab - 100, (length,), generator=g).tolist() for length in lens]


def run_tokenloom(prompts: list[list[int]], output_len: int, dtype: str) -> dict:
    with Engine(dtype=dtype, log_level="warning", max_running_requests=256) as engine:
        params = {"temperature": 0, "max_new_tokens": output_len, "ignore_eos": True}
        engine.generate(input_ids=prompts[0], sampling_params=dict(params, max_new_tokens=4))  # warmup
        start = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        elapsed = time.perf_counter() - start
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    return {"seconds": elapsed, "output_tokens": tokens, "tok_s": tokens / elapsed}


def run_transformers(prompts: list[list[int]], output_len: int, dtype: str, batch_size: int) -> dict:
    from transformers import AutoModelForCausalLM

    from tokenloom.models.default_model import default_model_file

    path = default_model_file()
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=getattr(torch, dtype)).eval()
    pad = 2
    tokens = 0
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i:i + batch_size]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=output_len,
                                 min_new_tokens=output_len, do_sample=False, pad_token_id=pad)
        tokens += (out.shape[1] - width) * len(chunk)
    elapsed = time.perf_counter() - start
    return {"seconds": elapsed, "output_tokens": tokens, "tok_s": tokens / elapsed}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--min-input-len", type=int, default=128)
    parser.add_argument("--max-input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--hf-batch-size", type=int, default=64)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--quick", action="store_true", help="32 prompts, 64..128 in, 32 out")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.quick:
        args.num_prompts, args.min_input_len, args.max_input_len, args.output_len = 32, 64, 128, 32
        args.hf_batch_size = 32
    torch.set_num_threads(os.cpu_count() or 1)
    shape = ModelShape.smollm2()
    prompts = make_prompts(args.num_prompts, args.min_input_len, args.max_input_len, shape.vocab, args.seed)
    roof = measure_roofline(quick=True)
    ours = run_tokenloom(prompts, args.output_len, args.dtype)
    theirs = None if args.skip_transformers else run_transformers(prompts, args.output_len, args.dtype,
                                                                  args.hf_batch_size)
    flops = sum(shape.prefill_flops(1, len(p)) for p in prompts)
    flops += sum(shape.decode_flops(1, len(p) + k) for p in prompts for k in range(args.output_len - 1))
    frac = flops / ours["seconds"] / 1e9 / roof["bf16_gflops"]
    print(f"workload: {args.num_prompts} prompts, input {args.min_input_len}..{args.max_input_len}, "
          f"output {args.output_len}, dtype {args.dtype}; bf16 roofline {roof['bf16_gflops']:.0f} GFLOP/s")
    print(f"tokenloom    : {ours['tok_s']:8.1f} output tok/s ({ours['seconds']:.1f} s), "
          f"{100 * frac:.1f}% of bf16 roofline")
    if theirs:
        print(f"transformers : {theirs['tok_s']:8.1f} output tok/s ({theirs['seconds']:.1f} s, static batch "
              f"{args.hf_batch_size})")
        print(f"ratio        : {ours['tok_s'] / theirs['tok_s']:.2f}x")
    print(json.dumps({
        "tokenloom_tok_s": round(ours["tok_s"], 1),
        "transformers_tok_s": round(theirs["tok_s"], 1) if theirs else None,
        "ratio": round(ours["tok_s"] / theirs["tok_s"], 2) if theirs else None,
        "roofline_frac": round(frac, 3), "bf16_gflops": round(roof["bf16_gflops"], 1),
        "num_prompts": args.num_prompts, "output_len": args.output_len,
    }))


if __name__ == "__main__":
    main()
