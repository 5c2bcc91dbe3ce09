"""Accuracy of tokenloom's default configuration (bf16) against float32, beside transformers bf16, in one run.

    .venv/bin/python bench/accuracy.py            # 32 windows of 256 tokens, 16 greedy continuations of 64 tokens
    .venv/bin/python bench/accuracy.py --quick    # about a minute: 8 windows, 6 continuations
    .venv/bin/python bench/accuracy.py --quick --kv-cache-dtype fp8_e4m3 fp8_e5m2   # + the default with an fp8 KV

On the default model (SmolLM2-135M-Instruct, its GGUF weights), four engines:
- tokenloom default (no --dtype: bf16, native decode step) and tokenloom --dtype float32, each a real server
  (`python -m tokenloom.launch_server`), measured through HTTP: perplexity from the server's prompt logprobs
  (`/generate` with `input_ids`, `return_logprob`, `logprob_start_len` 0, `max_new_tokens` 0), greedy
  continuations from `/generate` (temperature 0, `ignore_eos`);
- transformers bf16 and float32 on the same GGUF file (transformers' own GGUF loader), in this process:
  perplexity from one forward per window, greedy continuations from a cached greedy loop.

The corpus is text shipped with Python (`pydoc_data.topics`, the reference manual's topics, sorted by key and
joined), tokenized once with the model's tokenizer; window i starts at token i * (len / windows). Nothing is
downloaded. Greedy prompts are the first `--prompt-len` tokens of the windows. The run is deterministic: a
repeated run measures another sample with `--shift N` (every window moved by N tokens).

Metrics, each against transformers float32 on the same tokens:
- perplexity over every window position but the first, and its relative distance from float32's;
- greedy agreement: the mean share of the continuation equal to float32's before the first difference
  (a continuation that diverges stays diverged, so later tokens are not comparable), and the share of
  continuations equal to float32's in full.
`--kv-cache-dtype V ...` adds one engine per value: the default server with `--kv-cache-dtype V` (the fp8 KV
cache is read by the prompt-logprob prefill too, so both metrics see it), measured the same way.
Targets (issue 16): the default's perplexity within 0.5% of float32's and closer to it than transformers
bf16's; its greedy agreement above transformers bf16's. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import torch  # noqa: E402

from tokenloom.models.default_model import default_model_file  # noqa: E402

PPL_TARGET = 0.005
STARTUP_TIMEOUT_S = 600
REQUEST_TIMEOUT_S = 600


# --------------------------------------------------------------------------------------------------------
# corpus


def corpus_windows(tokenizer: Any, windows: int, length: int, shift: int = 0) -> list[list[int]]:
    """`windows` token windows of `length`, evenly spaced over the pydoc topics text, the first at `shift`."""
    import pydoc_data.topics as topics

    text = "\n\n".join(topics.topics[key] for key in sorted(topics.topics))
    ids = tokenizer(text).input_ids
    stride = len(ids) // windows
    if stride < length:
        raise SystemExit(f"corpus has {len(ids)} tokens: too few for {windows} windows of {length}")
    starts = [(i * stride + shift) % (len(ids) - length) for i in range(windows)]
    return [ids[start: start + length] for start in starts]


def perplexity(nlls: list[float]) -> float:
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


# --------------------------------------------------------------------------------------------------------
# transformers, in process


def transformers_engine(dtype: torch.dtype, windows: list[list[int]], prompts: list[list[int]], new_tokens: int
                        ) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    path = default_model_file()
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=dtype).eval()
    nlls: list[float] = []
    with torch.no_grad():
        for window in windows:
            logprobs = model(torch.tensor([window])).logits[0].float().log_softmax(-1)
            nlls += (-logprobs[:-1].gather(1, torch.tensor(window[1:])[:, None])).squeeze(1).tolist()
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
    """`python -m tokenloom.launch_server` with the given flags on a free port, until `close`."""

    def __init__(self, flags: list[str], log_dir: str) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(os.path.join(log_dir, f"tokenloom-{self.port}.log"), "w")  # noqa: SIM115 - closed in close
        self.proc = subprocess.Popen([sys.executable, "-m", "tokenloom.launch_server", "--port", str(self.port),
                                      *flags], stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server {flags} exited with {self.proc.returncode}; see {self.log.name}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1)
        self.close()
        raise RuntimeError(f"server {flags} not healthy after {STARTUP_TIMEOUT_S} s; see {self.log.name}")

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def tokenloom_engine(flags: list[str], windows: list[list[int]], prompts: list[list[int]], new_tokens: int,
                     log_dir: str) -> dict[str, Any]:
    server = TokenloomServer(flags, log_dir)
    try:
        nlls: list[float] = []
        for window in windows:
            out = _post(server.url + "/generate", {
                "input_ids": window, "return_logprob": True, "logprob_start_len": 0,
                "sampling_params": {"max_new_tokens": 0, "temperature": 0}})
            entries = out["meta_info"]["input_token_logprobs"]
            if len(entries) != len(window) or entries[0][0] is not None:
                raise RuntimeError(f"prompt logprobs: {len(entries)} entries for {len(window)} tokens")
            if [e[1] for e in entries] != window:
                raise RuntimeError("prompt logprobs name other tokens than the window's")
            nlls += [-e[0] for e in entries[1:]]
        outs = _post(server.url + "/generate", {
            "input_ids": prompts, "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0,
                                                      "ignore_eos": True}})
        return {"nlls": nlls, "continuations": [o["output_ids"] for o in outs]}
    finally:
        server.close()


# --------------------------------------------------------------------------------------------------------
# the run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="8 windows, 6 greedy prompts")
    parser.add_argument("--windows", type=int, default=32)
    parser.add_argument("--window-len", type=int, default=256)
    parser.add_argument("--greedy-prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--shift", type=int, default=0,
                        help="tokens to move every window by: another sample of the same corpus (runs are "
                        "deterministic, so repeated runs should differ in --shift)")
    parser.add_argument("--kv-cache-dtype", nargs="*", default=[], choices=["fp8_e4m3", "fp8_e5m2"],
                        help="also measure the default server with each of these KV cache dtypes")
    args = parser.parse_args()
    if args.quick:
        args.windows, args.greedy_prompts = 8, 6
    from tokenloom.config import ServerArgs
    from tokenloom.models.loader import resolve_model_source
    from tokenloom.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model_source(ServerArgs()))
    windows = corpus_windows(tokenizer, args.windows, args.window_len, args.shift)
    prompts = [w[: args.prompt_len] for w in windows[: args.greedy_prompts]]
    started = time.time()
    runs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="tokenloom-accuracy-") as log_dir:
        runs["transformers fp32"] = transformers_engine(torch.float32, windows, prompts, args.new_tokens)
        runs["transformers bf16"] = transformers_engine(torch.bfloat16, windows, prompts, args.new_tokens)
        runs["tokenloom default"] = tokenloom_engine([], windows, prompts, args.new_tokens, log_dir)
        runs["tokenloom fp32"] = tokenloom_engine(["--dtype", "float32"], windows, prompts, args.new_tokens,
                                                  log_dir)
        for kv in args.kv_cache_dtype:
            runs[f"tokenloom {kv}"] = tokenloom_engine(["--kv-cache-dtype", kv], windows, prompts, args.new_tokens,
                                                       log_dir)
    ref = runs["transformers fp32"]
    ref_ppl = perplexity(ref["nlls"])
    rows = {}
    print(f"\n{args.windows} windows x {args.window_len} tokens (pydoc_data.topics), {args.greedy_prompts} greedy "
          f"continuations of {args.new_tokens} tokens after {args.prompt_len}; {time.time() - started:.0f} s")
    print(f"{'engine':20s} {'perplexity':>10s} {'vs fp32':>9s} {'greedy prefix':>14s} {'greedy equal':>13s}")
    for name, run in runs.items():
        ppl = perplexity(run["nlls"])
        prefix, equal = greedy_agreement(run["continuations"], ref["continuations"])
        rows[name] = {"perplexity": ppl, "ppl_rel_diff": ppl / ref_ppl - 1, "greedy_prefix": prefix,
                      "greedy_equal": equal}
        print(f"{name:20s} {ppl:10.4f} {100 * (ppl / ref_ppl - 1):+8.3f}% {prefix:14.3f} {equal:13.3f}")
    default, hf_bf16 = rows["tokenloom default"], rows["transformers bf16"]
    targets = {
        "ppl_within_0.5pct": abs(default["ppl_rel_diff"]) <= PPL_TARGET,
        "ppl_closer_than_transformers_bf16": abs(default["ppl_rel_diff"]) < abs(hf_bf16["ppl_rel_diff"]),
        "greedy_above_transformers_bf16": default["greedy_prefix"] > hf_bf16["greedy_prefix"],
    }
    for name, ok in targets.items():
        print(f"target {name}: {'met' if ok else 'NOT met'}")
    print(json.dumps({"bench": "accuracy", "quick": args.quick, "windows": args.windows, "shift": args.shift,
                      "window_len": args.window_len, "greedy_prompts": args.greedy_prompts,
                      "new_tokens": args.new_tokens, "kv_cache_dtypes": args.kv_cache_dtype, "engines": rows,
                      "targets": targets}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
