"""Accuracy of GGUF files as tokenloom serves them against the same files dequantized to float32, beside
transformers bf16, in one run.

    .venv/bin/python bench/accuracy.py                        # the default file (+ the Q8_0 file if made)
    .venv/bin/python bench/accuracy.py --quick                # a few minutes a file: 8 chunks, 6 continuations
    .venv/bin/python bench/accuracy.py --gguf A.Q8_0.gguf B.Q4_K_M.gguf --reference tokenloom
    .venv/bin/python bench/accuracy.py --quick --kv-cache-dtype fp8_e4m3 fp8_e5m2   # + "served" with an fp8 KV

On a machine other work keeps busy, start it with `GOMP_SPINCOUNT=1000` (the transformers engines run in this
process; libgomp's default spin stalls them as it stalled the servers, tokenloom/executor/cpu_threads.py).

Files (`--gguf`, any number): by default the packaged default file (SmolLM2-135M-Instruct, Q4_1 layers) and,
when it exists, the Q8_0 file `bench/llama_server.py` makes from it (`<tokenloom cache>/gguf/...-q8_0.gguf`;
`bench/serve_vs_peers.py --engines llama.cpp-q8_0` makes it once). Per file, four engines:
- "served": tokenloom with no flags but `--model-path`, the file as a user gets it served (the weights kept
  quantized once `--quantization gguf` is the default for .gguf files; before that, dequantized to bf16);
- "tokenloom fp32": tokenloom `--dtype float32` (plus `--quantization none` where that flag exists): the
  same file dequantized to float32;
- "transformers fp32" / "transformers bf16": transformers' own GGUF loader (it dequantizes to float32) in this
  process, run in that dtype.
`--kv-cache-dtype V ...` adds one engine per value, "served V": "served" with `--kv-cache-dtype V` (the fp8
KV cache is read by the prompt-logprob prefill too, so both metrics see it).
Each tokenloom engine is a real server (`python -m tokenloom.launch_server`) measured through HTTP: prompt
logprobs from `/generate` (`input_ids`, `return_logprob`, `logprob_start_len` 0, `max_new_tokens` 0), greedy
continuations from `/generate` (temperature 0, `ignore_eos`).

Corpus: text shipped with Python (`pydoc_data.topics`, the reference manual's topics, sorted by key and
joined), tokenized with the file's tokenizer; `--chunks` contiguous chunks of `--chunk-len` tokens (capped
at the model's context length) from token `--shift` on. Nothing is downloaded; runs are deterministic, so a
repeated run measures another sample with another `--shift`. Greedy prompts are the first `--prompt-len`
tokens of the first `--greedy-prompts` chunks.

Metrics, against the reference (`--reference`: transformers fp32, the default, or tokenloom fp32):
- perplexity over every chunk position but the first, and its ratio to the reference's;
- greedy agreement: the mean share of each continuation equal to the reference's before the first
  difference (a continuation that diverged stays diverged), and the share equal in full.
Targets (issue 30), per file by its layers' weight type: "served" perplexity within 0.5% of the float32
reference for 8-bit and wider types (Q8_0, BF16, ...), within 1% for narrower ones (Q4_0, Q4_1, Q4_K, ...);
its greedy agreement at least transformers bf16's. The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import torch  # noqa: E402

from tokenloom.models.default_model import default_model_file  # noqa: E402

# perplexity targets, relative to the float32 reference, by the width of the layers' weights
PPL_TARGET_8BIT = 0.005
PPL_TARGET_NARROW = 0.01
WIDE_TYPES = frozenset({"Q8_0", "Q8_1", "Q8_K", "F16", "BF16", "F32", "F64"})
STARTUP_TIMEOUT_S = 600
REQUEST_TIMEOUT_S = 600


# --------------------------------------------------------------------------------------------------------
# pure helpers (tests/unit/test_bench_accuracy.py)


def chunk_tokens(ids: list[int], chunks: int, length: int, shift: int = 0) -> list[list[int]]:
    """`chunks` contiguous, non-overlapping runs of `length` tokens of `ids`, the first at `shift`."""
    if chunks < 1 or length < 2:
        raise ValueError(f"need at least 1 chunk of at least 2 tokens; got {chunks} of {length}")
    if shift < 0 or shift + chunks * length > len(ids):
        raise ValueError(f"the corpus has {len(ids)} tokens: too few for {chunks} chunks of {length} from "
                         f"token {shift}")
    return [ids[shift + i * length: shift + (i + 1) * length] for i in range(chunks)]


def nlls_from_prompt_logprobs(entries: list[list[Any]], window: list[int]) -> list[float]:
    """Negative log-likelihoods of window[1:] from a server's `input_token_logprobs` for `window`
    ([logprob, token id, text] per prompt position, the first position's logprob None: nothing predicts it).
    A reply for other tokens, of another length, or with a missing or positive logprob is an error."""
    if len(entries) != len(window):
        raise ValueError(f"prompt logprobs: {len(entries)} entries for a {len(window)}-token prompt")
    if [e[1] for e in entries] != window:
        raise ValueError("prompt logprobs name other tokens than the prompt's")
    if entries[0][0] is not None:
        raise ValueError(f"prompt logprobs: the first position has a logprob ({entries[0][0]}); expected None")
    logprobs = [e[0] for e in entries[1:]]
    bad = [i + 1 for i, lp in enumerate(logprobs) if lp is None or not math.isfinite(lp) or lp > 1e-6]
    if bad:
        raise ValueError(f"prompt logprobs: positions {bad[:5]} have no finite logprob <= 0")
    return [-lp for lp in logprobs]


def perplexity(nlls: list[float]) -> float:
    if not nlls:
        raise ValueError("perplexity of no tokens")
    return math.exp(sum(nlls) / len(nlls))


def greedy_agreement(ours: list[list[int]], ref: list[list[int]]) -> tuple[float, float]:
    """(mean share of each continuation equal to the reference before the first difference, share equal)."""
    prefix_shares, equal = [], 0
    for mine, theirs in zip(ours, ref, strict=True):
        same = 0
        while same < min(len(mine), len(theirs)) and mine[same] == theirs[same]:
            same += 1
        prefix_shares.append(same / len(theirs))
        equal += mine == theirs
    return sum(prefix_shares) / len(prefix_shares), equal / len(ref)


def dominant_type(tensor_types: dict[str, tuple[str, int]]) -> str:
    """The weight type holding most elements of the layers' matrices ({name: (type, elements)}; the
    `blk.N.*.weight` ones of more than one dimension's worth are what a decode step streams; norms are F32)."""
    counts: Counter[str] = Counter()
    for name, (qtype, elements) in tensor_types.items():
        if name.startswith("blk.") and not name.endswith("norm.weight"):
            counts[qtype] += elements
    if not counts:
        raise ValueError("no layer weight matrices (blk.N.*) in the file")
    return counts.most_common(1)[0][0]


def ppl_target(weight_type: str) -> float:
    """The issue's perplexity target for a file whose layers are mostly `weight_type`."""
    return PPL_TARGET_8BIT if weight_type in WIDE_TYPES else PPL_TARGET_NARROW


# --------------------------------------------------------------------------------------------------------
# files and corpus


def gguf_info(path: str) -> dict[str, Any]:
    """The file's type as its header names it, its layers' dominant weight type and its context length."""
    import gguf

    reader = gguf.GGUFReader(path)
    file_type = reader.fields.get("general.file_type")
    name = gguf.LlamaFileType(int(file_type.parts[file_type.data[0]][0])).name if file_type else "unknown"
    arch_field = reader.fields["general.architecture"]
    arch = bytes(arch_field.parts[arch_field.data[0]]).decode()
    ctx_field = reader.fields.get(f"{arch}.context_length")
    context = int(ctx_field.parts[ctx_field.data[0]][0]) if ctx_field else None
    types = {t.name: (t.tensor_type.name, int(t.n_elements)) for t in reader.tensors}
    return {"path": path, "file_type": name.removeprefix("MOSTLY_"), "weight_type": dominant_type(types),
            "context_length": context}


def default_files() -> list[str]:
    """The packaged default file, and bench/llama_server.py's Q8_0 file of it when it has been made."""
    from bench.llama_server import gguf_cache_path

    source = default_model_file()
    q8_0 = gguf_cache_path(source, "q8_0")
    return [source, *([q8_0] if os.path.exists(q8_0) else [])]


def corpus_ids(tokenizer: Any) -> list[int]:
    import pydoc_data.topics as topics

    return tokenizer("\n\n".join(topics.topics[key] for key in sorted(topics.topics))).input_ids


# --------------------------------------------------------------------------------------------------------
# transformers, in process


def transformers_engine(path: str, dtype: torch.dtype, chunks: list[list[int]], prompts: list[list[int]],
                        new_tokens: int) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=dtype).eval()
    return run_transformers(model, chunks, prompts, new_tokens)


def run_transformers(model: Any, chunks: list[list[int]], prompts: list[list[int]], new_tokens: int
                     ) -> dict[str, Any]:
    """A transformers model's negative log-likelihoods over `chunks` and greedy continuations of `prompts`."""
    nlls: list[float] = []
    with torch.no_grad():
        for chunk in chunks:
            logprobs = model(torch.tensor([chunk])).logits[0].float().log_softmax(-1)
            nlls += (-logprobs[:-1].gather(1, torch.tensor(chunk[1:])[:, None])).squeeze(1).tolist()
        continuations = [greedy_transformers(model, prompt, new_tokens) for prompt in prompts]
    return {"nlls": nlls, "continuations": continuations}


def greedy_transformers(model: Any, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy continuation with the KV cache, no EOS stop (as tokenloom's ignore_eos)."""
    out = model(torch.tensor([prompt]), use_cache=True)
    tokens: list[int] = []
    for _ in range(new_tokens):
        nxt = int(out.logits[0, -1].float().argmax())
        tokens.append(nxt)
        out = model(torch.tensor([[nxt]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens


# --------------------------------------------------------------------------------------------------------
# tokenloom, through its HTTP server


def _post(url: str, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as resp:
        return json.loads(resp.read())


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TokenloomServer:
    """`python -m tokenloom.launch_server` with the given flags on a free port, until `close`, started from
    `checkout` (its code is the one imported; default: this tree)."""

    def __init__(self, flags: list[str], log_dir: str, checkout: str = REPO) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(os.path.join(log_dir, f"tokenloom-{self.port}.log"), "w")  # noqa: SIM115 - closed in close
        self.proc = subprocess.Popen([sys.executable, "-m", "tokenloom.launch_server", "--port", str(self.port),
                                      *flags], stdout=self.log, stderr=subprocess.STDOUT, cwd=checkout)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.close()
                raise RuntimeError(f"server {flags} exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1)
        self.close()
        raise RuntimeError(f"server {flags} not healthy after {STARTUP_TIMEOUT_S} s: {self.log_tail()}")

    def log_tail(self, lines: int = 5) -> str:
        """The log's last lines (it lives in a temporary folder that goes when the run ends)."""
        with open(self.log.name, errors="replace") as f:
            return " | ".join(f.read().strip().splitlines()[-lines:])

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def tokenloom_engine(flags: list[str], chunks: list[list[int]], prompts: list[list[int]], new_tokens: int,
                     log_dir: str, checkout: str = REPO) -> dict[str, Any]:
    server = TokenloomServer(flags, log_dir, checkout)
    try:
        nlls: list[float] = []
        for chunk in chunks:
            out = _post(server.url + "/generate", {
                "input_ids": chunk, "return_logprob": True, "logprob_start_len": 0,
                "sampling_params": {"max_new_tokens": 0, "temperature": 0}})
            nlls += nlls_from_prompt_logprobs(out["meta_info"]["input_token_logprobs"], chunk)
        outs = _post(server.url + "/generate", {
            "input_ids": prompts, "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0,
                                                      "ignore_eos": True}})
        return {"nlls": nlls, "continuations": [o["output_ids"] for o in outs]}
    finally:
        server.close()


def fp32_flags() -> list[str]:
    """tokenloom's flags for the file dequantized to float32: `--quantization none` once that flag exists."""
    from tokenloom.config import ServerArgs

    has_quantization = any(f.name == "quantization" for f in dataclasses.fields(ServerArgs))
    return ["--dtype", "float32", *(["--quantization", "none"] if has_quantization else [])]


# --------------------------------------------------------------------------------------------------------
# the run


def measure_file(path: str, args: argparse.Namespace, log_dir: str) -> dict[str, Any]:
    from tokenloom.config import ServerArgs
    from tokenloom.models.loader import resolve_model_source
    from tokenloom.tokenizer import load_tokenizer

    info = gguf_info(path)
    length = min(args.chunk_len, info["context_length"] or args.chunk_len)
    tokenizer = load_tokenizer(resolve_model_source(ServerArgs(model_path=path)))
    chunks = chunk_tokens(corpus_ids(tokenizer), args.chunks, length, args.shift)
    prompts = [c[: args.prompt_len] for c in chunks[: args.greedy_prompts]]
    started = time.time()
    model = ["--model-path", path]
    engines = {
        "served": lambda: tokenloom_engine(model, chunks, prompts, args.new_tokens, log_dir),
        "tokenloom fp32": lambda: tokenloom_engine([*model, *fp32_flags()], chunks, prompts, args.new_tokens,
                                                   log_dir),
        "transformers fp32": lambda: transformers_engine(path, torch.float32, chunks, prompts, args.new_tokens),
        "transformers bf16": lambda: transformers_engine(path, torch.bfloat16, chunks, prompts, args.new_tokens),
    }
    for kv in args.kv_cache_dtype:
        engines[f"served {kv}"] = lambda kv=kv: tokenloom_engine([*model, "--kv-cache-dtype", kv], chunks, prompts,
                                                                  args.new_tokens, log_dir)
    runs = {}
    for name, run in engines.items():
        runs[name] = run()
        print(f"{os.path.basename(path)}: {name} perplexity {perplexity(runs[name]['nlls']):.4f} "
              f"({time.time() - started:.0f} s)", flush=True)
    ref = runs[f"{args.reference} fp32"]
    ref_ppl = perplexity(ref["nlls"])
    rows = {}
    print(f"\n{os.path.basename(path)}: {info['file_type']} (layers mostly {info['weight_type']}); {args.chunks} "
          f"chunks x {length} tokens, {len(prompts)} greedy continuations of {args.new_tokens} after "
          f"{args.prompt_len}; reference {args.reference} fp32; {time.time() - started:.0f} s")
    print(f"{'engine':20s} {'perplexity':>10s} {'ratio':>8s} {'greedy prefix':>14s} {'greedy equal':>13s}")
    for name, run in runs.items():
        ppl = perplexity(run["nlls"])
        prefix, equal = greedy_agreement(run["continuations"], ref["continuations"])
        rows[name] = {"perplexity": ppl, "ppl_ratio": ppl / ref_ppl, "greedy_prefix": prefix, "greedy_equal": equal}
        print(f"{name:20s} {ppl:10.4f} {ppl / ref_ppl:8.5f} {prefix:14.3f} {equal:13.3f}")
    target = ppl_target(info["weight_type"])
    served, hf_bf16 = rows["served"], rows["transformers bf16"]
    targets = {
        f"ppl_within_{100 * target:g}pct": abs(served["ppl_ratio"] - 1) <= target,
        "greedy_at_least_transformers_bf16": served["greedy_prefix"] >= hf_bf16["greedy_prefix"],
    }
    for name, ok in targets.items():
        print(f"target {name}: {'met' if ok else 'NOT met'}")
    return {**info, "chunk_len": length, "engines": rows, "targets": targets}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", nargs="+", default=None, help="GGUF files (default: see above)")
    parser.add_argument("--reference", choices=("transformers", "tokenloom"), default="transformers",
                        help="which float32 engine the others are measured against")
    parser.add_argument("--quick", action="store_true", help="8 chunks, 6 greedy prompts")
    parser.add_argument("--chunks", "--windows", type=int, default=24)
    parser.add_argument("--chunk-len", "--window-len", type=int, default=256)
    parser.add_argument("--greedy-prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--shift", type=int, default=0,
                        help="the first chunk's first token: another sample of the same corpus (runs are "
                        "deterministic, so repeated runs should differ in --shift)")
    parser.add_argument("--kv-cache-dtype", nargs="*", default=[], choices=["fp8_e4m3", "fp8_e5m2"],
                        help="also measure \"served\" with each of these KV cache dtypes")
    args = parser.parse_args()
    if args.quick:
        args.chunks, args.greedy_prompts = 8, 6
    args.greedy_prompts = min(args.greedy_prompts, args.chunks)
    files = args.gguf or default_files()
    for path in files:
        if not os.path.isfile(path):
            raise SystemExit(f"--gguf {path!r}: no such file")
    results = {}
    with tempfile.TemporaryDirectory(prefix="tokenloom-accuracy-") as log_dir:
        for path in files:
            results[os.path.basename(path)] = measure_file(path, args, log_dir)
    print(json.dumps({"bench": "accuracy", "quick": args.quick, "chunks": args.chunks, "shift": args.shift,
                      "greedy_prompts": args.greedy_prompts, "new_tokens": args.new_tokens,
                      "reference": args.reference, "kv_cache_dtypes": args.kv_cache_dtype, "files": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
