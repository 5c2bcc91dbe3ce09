"""One-shot generation from the command line: load a model, run prompts, print the completions.

    tokenloom generate "The capital of France is" --max-new-tokens 32
    python -m tokenloom.entrypoints.generate --chat "Write a haiku about looms"

Every server flag (--model-path, --dtype, --page-size, ...) is accepted. With no --model-path the default
SmolLM2-135M-Instruct GGUF is used.
"""

from __future__ import annotations

import argparse
import sys
import time

from tokenloom.config import ConfigError, ServerArgs, check_device, warn_ignored_flags
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
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        args = ServerArgs.from_cli_namespace(ns)
        check_device(args)
        if args.tp_size > 1:  # one process, no ranks: the forward path only (`tokenloom serve` runs TP)
            raise ConfigError(f"--tp-size {args.tp_size}: `tokenloom generate` runs one process; use "
                              "`tokenloom serve` or tokenloom.Engine for tensor parallelism")
        warn_ignored_flags(args)
        return _run(ns, args)
    except (ConfigError, ModelConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _run(ns: argparse.Namespace, args: ServerArgs) -> int:
    from tokenloom.executor.model_runner import ModelRunner
    from tokenloom.executor.sequence_driver import SequenceDriver
    from tokenloom.sampling.sampling_params import SamplingParams
    from tokenloom.tokenizer import eos_token_ids, load_tokenizer

    start = time.perf_counter()
    runner = ModelRunner(args)
    tokenizer = load_tokenizer(runner.source, args.tokenizer_path)
    load_s = time.perf_counter() - start
    prompts = []
    for text in ns.prompts:
        if ns.chat:
            text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                 add_generation_prompt=True)
        prompts.append(tokenizer(text).input_ids)
    params = [SamplingParams.from_dict({"max_new_tokens": ns.max_new_tokens, "temperature": ns.temperature,
                                        "top_p": ns.top_p, "top_k": ns.top_k, "sampling_seed": ns.seed},
                                       runner.vocab_size) for _ in prompts]
    start = time.perf_counter()
    outputs = SequenceDriver(runner).generate(prompts, params, eos_token_ids(runner.source, tokenizer))
    gen_s = time.perf_counter() - start
    for text, out in zip(ns.prompts, outputs, strict=True):
        print(f"{text!r} -> {tokenizer.decode(out, skip_special_tokens=True)!r}")
    total = sum(len(o) for o in outputs)
    print(f"[loaded in {load_s:.1f} s; {total} tokens in {gen_s:.2f} s = {total / gen_s:.1f} tok/s]",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
