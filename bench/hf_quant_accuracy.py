"""Accuracy of Hugging Face checkpoints with integer weights as tokenloom serves them (GPTQ 4-bit, and a float
checkpoint with `--torchao-config int4wo-64 | int8wo`) against the same integer weights dequantized to float32
and run by transformers, beside transformers bf16, in one run; optionally an older checkout's server beside
this one's (`--base-dir`: what a change to the integer weights' kernels costs or gains in accuracy).

    .venv/bin/python bench/hf_quant_accuracy.py --quick
    .venv/bin/python bench/hf_quant_accuracy.py --quick --base-dir /path/to/old/checkout --methods gptq-64
    .venv/bin/python bench/hf_quant_accuracy.py --make-only     # print the checkpoint folders, measure nothing

The checkpoints are made once from the packaged default GGUF (SmolLM2-135M-Instruct; nothing is downloaded) in
`<tokenloom cache>/hf/`: the float one by transformers' own GGUF loader (the file dequantized), saved in bf16
with its tokenizer (bench/serve_vs_peers.py's `ensure_hf_folder`); the GPTQ ones from it by
tests/hf_quant_factory.py (round-to-nearest 4-bit codes per group of 64 input features, fp16 scales, integer
zero points: the format's own packing, checkpoint_format "gptq"; "gptq-act-64" with act-order, desc_act true:
each layer input's features quantized in a random order, g_idx naming their groups; "gptq8-64" 8-bit and
symmetric, the form of Qwen's GPTQ-Int8 checkpoints, in groups of 64 since SmolLM2's 576 features are not whole
groups of 128); the compressed-tensors ones by tests/hf_quant_factory.py's `compressed_from_folder` with the
compressed-tensors library's own compressor: "ct-w4a16-64" (llm-compressor's W4A16 scheme, symmetric, groups of
64 for the same reason), "ct-w8a16" (W8A16: 8 bits symmetric per channel) and "ct-w8a8" (W8A8 int8: the int8
weight per channel, activations rounded to int8 per token at run time, which the reference does not do), their
float32 references the dequantized checkpoints written beside them).
The float32 reference of each method is transformers with every linear weight (not the embedding and LM head,
which tokenloom keeps in --dtype) replaced by exactly the integer weights dequantized (GPTQ: (q - z) s;
torchao: `quantize_for_method(w).dequantize()`); transformers bf16 is that model in bf16.

Engines per method: "served" (this tree, no flags but the model and the method's flag: bf16 activations),
"served fp32" (`--dtype float32`: torch's kernels with exact float32 scales), "served base" (`--base-dir`'s
server with the served flags), and the two transformers engines. Metrics and targets as bench/accuracy.py's
(perplexity through the server's prompt logprobs on the same corpus chunks, greedy agreement): within 1% of
the float32 reference for the 4-bit methods, 0.5% for int8wo; greedy agreement at least transformers bf16's.
The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import torch  # noqa: E402

from bench.accuracy import (  # noqa: E402
    PPL_TARGET_8BIT,
    PPL_TARGET_NARROW,
    chunk_tokens,
    corpus_ids,
    greedy_agreement,
    perplexity,
    run_transformers,
    tokenloom_engine,
)

# SmolLM2's 576 input features: groups of 64
METHODS = ("gptq-64", "gptq-act-64", "gptq8-64", "ct-w4a16-64", "ct-w8a16", "ct-w8a8", "int4wo-64", "int8wo")
# (bits, group; -1: per channel), symmetric; None: W8A8
COMPRESSED: dict[str, tuple[int, int] | None] = {"ct-w4a16-64": (4, 64), "ct-w8a16": (8, -1), "ct-w8a8": None}
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _hf_root() -> str:
    from tokenloom.local_cache import cache_dir

    return os.path.join(cache_dir(), "hf")


def float_checkpoint() -> str:
    """The default GGUF as a bf16 Hugging Face folder (bench/serve_vs_peers.py's, made once)."""
    from bench.serve_vs_peers import ensure_hf_folder
    from tokenloom.models.default_model import default_model_file

    return ensure_hf_folder(str(default_model_file()))


def _gptq(method: str) -> dict[str, Any]:
    """"gptq-64" / "gptq-act-64" / "gptq8-64" -> write_prequant's keywords (group, act-order, bits, symmetry)."""
    bits = 8 if method.startswith("gptq8-") else 4
    return {"group": int(method.rsplit("-", 1)[1]), "desc_act": "-act-" in method, "bits": bits, "sym": bits == 8}


def gptq_checkpoint(float_folder: str, method: str) -> str:
    """A GPTQ 4-bit checkpoint of the float one (round-to-nearest, asymmetric, groups of input features; with
    act-order each layer input's features quantized in a random order, g_idx naming their groups), made once."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.hf_quant_factory import write_prequant

    folder = os.path.join(_hf_root(), f"SmolLM2-135M-Instruct-{method}")
    if not os.path.exists(os.path.join(folder, "config.json")):
        model = AutoModelForCausalLM.from_pretrained(float_folder, dtype=torch.float32)
        write_prequant(folder, model, "gptq", v1=True, **_gptq(method))
        AutoTokenizer.from_pretrained(float_folder).save_pretrained(folder)
    return folder


def compressed_checkpoint(float_folder: str, method: str) -> tuple[str, str]:
    """(a compressed-tensors checkpoint of the float one, the folder of its exact dequantized weights), made
    once."""
    from tests.hf_quant_factory import compressed_from_folder, w8a8_from_folder

    folder = os.path.join(_hf_root(), f"SmolLM2-135M-Instruct-{method}")
    reference = folder + "_dequantized"
    if not os.path.exists(os.path.join(folder, "config.json")):
        for path in (folder, reference):
            if os.path.exists(path):
                import shutil

                shutil.rmtree(path)
        if COMPRESSED[method] is None:
            w8a8_from_folder(float_folder, folder)
        else:
            bits, group = COMPRESSED[method]
            compressed_from_folder(float_folder, folder, bits, group, symmetric=True)
    return folder, reference


def reference_model(float_folder: str, method: str, scratch: str) -> torch.nn.Module:
    """transformers float32 with every linear layer's weight the method's integer weight, dequantized exactly
    (GPTQ: the model tests/hf_quant_factory.py returns beside the checkpoint it writes again in `scratch`)."""
    from transformers import AutoModelForCausalLM

    from tests.hf_quant_factory import write_prequant
    from tokenloom.layers.int_quant import quantize_for_method

    if method in COMPRESSED:
        return AutoModelForCausalLM.from_pretrained(compressed_checkpoint(float_folder, method)[1],
                                                    dtype=torch.float32).eval()
    model = AutoModelForCausalLM.from_pretrained(float_folder, dtype=torch.float32).eval()
    if method.startswith("gptq"):
        return write_prequant(os.path.join(scratch, method), model, "gptq", v1=True, **_gptq(method))[1]
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in LINEARS:
                module.weight.copy_(quantize_for_method(module.weight, method).dequantize())
    return model


def measure_method(method: str, args: argparse.Namespace, log_dir: str) -> dict[str, Any]:
    from transformers import AutoTokenizer

    float_folder = float_checkpoint()
    if method.startswith("gptq"):
        flags = ["--model-path", gptq_checkpoint(float_folder, method)]
    elif method in COMPRESSED:
        flags = ["--model-path", compressed_checkpoint(float_folder, method)[0]]
    else:
        flags = ["--model-path", float_folder, "--torchao-config", method]
    tokenizer = AutoTokenizer.from_pretrained(float_folder)
    chunks = chunk_tokens(corpus_ids(tokenizer), args.chunks, args.chunk_len, args.shift)
    prompts = [c[: args.prompt_len] for c in chunks[: args.greedy_prompts]]
    ref_model = reference_model(float_folder, method, log_dir)
    started = time.time()
    engines = {
        "served": lambda: tokenloom_engine(flags, chunks, prompts, args.new_tokens, log_dir),
        **({} if args.no_served_fp32 else {"served fp32": lambda: tokenloom_engine(
            [*flags, "--dtype", "float32"], chunks, prompts, args.new_tokens, log_dir)}),
        "transformers fp32": lambda: run_transformers(ref_model, chunks, prompts, args.new_tokens),
        "transformers bf16": lambda: run_transformers(copy.deepcopy(ref_model).to(torch.bfloat16), chunks,
                                                      prompts, args.new_tokens),
    }
    if args.base_dir:
        engines["served base"] = lambda: tokenloom_engine(flags, chunks, prompts, args.new_tokens, log_dir,
                                                          checkout=os.path.abspath(args.base_dir))
    runs = {}
    for name, run in engines.items():
        runs[name] = run()
        print(f"{method}: {name} perplexity {perplexity(runs[name]['nlls']):.4f} ({time.time() - started:.0f} s)",
              flush=True)
    ref = runs["transformers fp32"]
    ref_ppl = perplexity(ref["nlls"])
    print(f"\n{method}: {args.chunks} chunks x {args.chunk_len} tokens, {len(prompts)} greedy continuations of "
          f"{args.new_tokens} after {args.prompt_len}; reference transformers fp32 on the dequantized integer weights")
    print(f"{'engine':20s} {'perplexity':>10s} {'ratio':>8s} {'greedy prefix':>14s} {'greedy equal':>13s}")
    rows = {}
    for name, run in runs.items():
        ppl = perplexity(run["nlls"])
        prefix, equal = greedy_agreement(run["continuations"], ref["continuations"])
        rows[name] = {"perplexity": ppl, "ppl_ratio": ppl / ref_ppl, "greedy_prefix": prefix, "greedy_equal": equal}
        print(f"{name:20s} {ppl:10.4f} {ppl / ref_ppl:8.5f} {prefix:14.3f} {equal:13.3f}")
    target = PPL_TARGET_8BIT if method in ("int8wo", "gptq8-64", "ct-w8a16", "ct-w8a8") else PPL_TARGET_NARROW
    served, hf_bf16 = rows["served"], rows["transformers bf16"]
    targets = {f"ppl_within_{100 * target:g}pct": abs(served["ppl_ratio"] - 1) <= target,
               "greedy_at_least_transformers_bf16": served["greedy_prefix"] >= hf_bf16["greedy_prefix"]}
    for name, ok in targets.items():
        print(f"target {name}: {'met' if ok else 'NOT met'}")
    return {"engines": rows, "targets": targets}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--base-dir", default=None, help="an older checkout: its server as \"served base\"")
    parser.add_argument("--make-only", action="store_true", help="make the checkpoints, print their folders")
    parser.add_argument("--no-served-fp32", action="store_true",
                        help="leave out \"served fp32\" (torch's int4 kernel in float32 is the slowest engine)")
    parser.add_argument("--quick", action="store_true", help="8 chunks, 6 greedy prompts")
    parser.add_argument("--chunks", type=int, default=24)
    parser.add_argument("--chunk-len", type=int, default=256)
    parser.add_argument("--greedy-prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--shift", type=int, default=0, help="the first chunk's first token (another sample)")
    args = parser.parse_args()
    if args.make_only:
        folder = float_checkpoint()
        print(json.dumps({"float": folder, **{m: gptq_checkpoint(folder, m) for m in METHODS if "gptq" in m},
                          **{m: compressed_checkpoint(folder, m)[0] for m in COMPRESSED}}))
        return 0
    if args.quick:
        args.chunks, args.greedy_prompts = 8, 6
    args.greedy_prompts = min(args.greedy_prompts, args.chunks)
    with tempfile.TemporaryDirectory(prefix="tokenloom-hf-accuracy-") as log_dir:
        results = {method: measure_method(method, args, log_dir) for method in args.methods}
    print(json.dumps({"bench": "hf_quant_accuracy", "quick": args.quick, "chunks": args.chunks, "shift": args.shift,
                      "base_dir": args.base_dir, "methods": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
