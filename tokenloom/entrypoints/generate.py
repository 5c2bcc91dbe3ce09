"""One-shot generation from the command line: start the engine, run prompts, print the completions.

    tokenloom generate "The capital of France is" --max-new-tokens 32
    python -m tokenloom.entrypoints.generate --chat "Write a haiku about looms"

Every server flag (--model-path, --dtype, --page-size, ...) is accepted. With no --model-path the default
SmolLM2-135M-Instruct GGUF is used. The prompts run through `tokenloom.Engine`, the runtime `tokenloom serve` serves
(scheduler processes, incremental detokenizing: continuous batching, prefix cache, the same stop rule), as one
batch. The runtime's own logs are quiet unless --log-level asks for them: stdout holds one line per prompt, stderr
the timing line.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from tokenloom.config import ConfigError, ServerArgs, check_device
from tokenloom.entrypoints.engine import Engine
from tokenloom.model_config import ModelConfigError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenloom generate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompts", nargs="*", default=["The capital city of France is"],
                        help="Prompt(s); several run as one batch.")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--seed", type=int, default=None, help="Per-request sampling seed.")
    parser.add_argument("--chat", action="store_true", help="Wrap each prompt in the model's chat template.")
    ServerArgs.add_cli_args(parser)
    parser.set_defaults(log_level="warning")  # the output is the completions, not the runtime's start-up log
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        args = ServerArgs.from_cli_namespace(ns)
        check_device(args)
        if args.tp_size > 1:  # one model rank: a one-shot command keeps to the single-rank engine
            raise ConfigError(f"--tp-size {args.tp_size}: `tokenloom generate` runs one process; use "
                              "`tokenloom serve` or tokenloom.Engine for tensor parallelism")
        return _run(ns, args)
    except (ConfigError, ModelConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _run(ns: argparse.Namespace, args: ServerArgs) -> int:
    start = time.perf_counter()
    try:
        engine = Engine(**dataclasses.asdict(args))  # warns about ignored flags itself
    except (RuntimeError, OSError) as e:  # a runtime process failed to start (its log above says why), as serve
        raise ValueError(str(e)) from None
    with engine:
        tokenizer = engine.tokenizer
        load_s = time.perf_counter() - start
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                 add_generation_prompt=True) if ns.chat else text
                   for text in ns.prompts]
        params = {"max_new_tokens": ns.max_new_tokens, "temperature": ns.temperature, "top_p": ns.top_p,
                  "top_k": ns.top_k, "sampling_seed": ns.seed}
        start = time.perf_counter()
        outputs = [out["output_ids"] for out in engine.generate(prompts, [params] * len(prompts))]
        gen_s = time.perf_counter() - start
    for text, out in zip(ns.prompts, outputs, strict=True):
        print(f"{text!r} -> {tokenizer.decode(out, skip_special_tokens=True)!r}")
    total = sum(len(o) for o in outputs)
    print(f"[loaded in {load_s:.1f} s; {total} tokens in {gen_s:.2f} s = {total / gen_s:.1f} tok/s]",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
