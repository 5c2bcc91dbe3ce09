"""`python -m tokenloom.bench_serving`: the online serving benchmark client, with SGLang `bench_serving`'s
flags, pacing and "Serving Benchmark Result" block.

Run: parse and check the flags -> find the model (`/v1/models`) and a tokenizer -> build the dataset ->
warm-up requests (copies of the first prompt, at most 32 output tokens; all failing ends the run) -> optional
`/flush_cache` -> 1 s pause -> start the clock and issue the requests in dataset order, waiting an
exponential gap with mean 1/`--request-rate` after each (none at `inf`), each under the `--max-concurrency`
semaphore -> gather -> (native backends: one `/get_server_info` round trip inside the clock) -> metrics,
block, one JSON line appended to the output file, optional plot.

Bad input (flags, dataset, unreachable server, no tokenizer) ends with one `bench_serving: error: ...` line and
exit status 1 (2 for argparse usage errors); a run where every request failed exits 1 after its report.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import AsyncIterator
from datetime import datetime
from typing import Any

import aiohttp
import numpy as np

from tokenloom.bench.backends import (
    BACKENDS,
    NATIVE_BACKENDS,
    RequestFunc,
    RequestInput,
    default_port,
    endpoint_of,
    request_func_of,
)
from tokenloom.bench.datasets import DATASET_NAMES, DatasetError, DatasetRow, build_dataset
from tokenloom.bench.metrics import BenchmarkMetrics, RequestOutput, calculate_metrics
from tokenloom.bench.report import (
    append_json_line,
    default_output_file,
    format_block,
    format_errors,
    result_dict,
)
from tokenloom.bench.server import (
    BenchError,
    check_reachable,
    discover_model,
    flush_cache,
    get_server_info,
    load_bench_tokenizer,
)

PROG = "python -m tokenloom.bench_serving"
WARMUP_MAX_OUTPUT = 32
REQUEST_TIMEOUT_S = 6 * 3600


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="Benchmark the online serving throughput and latency of a "
                                "tokenloom, SGLang or OpenAI-compatible server.")
    p.add_argument("--backend", choices=BACKENDS, default="tokenloom",
                   help="native /generate (tokenloom, sglang, sglang-native), /v1/completions (sglang-oai, vllm, "
                        "openai) or /v1/chat/completions (sglang-oai-chat, vllm-chat, openai-chat)")
    p.add_argument("--base-url", default=None, help="server URL; overrides --host/--port")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=None, help="default 30000 (tokenloom/sglang*), else 8000")
    p.add_argument("--dataset-name", choices=DATASET_NAMES, default="sharegpt")
    p.add_argument("--dataset-path", default="", help="ShareGPT-format JSON (sharegpt; optional text for random)")
    p.add_argument("--model", default=None, help="model id; default: the first of GET /v1/models")
    p.add_argument("--served-model-name", default=None, help="model name sent in OpenAI requests (default --model)")
    p.add_argument("--tokenizer", default=None, help="tokenizer: HF folder, .gguf file or 'smollm2' (default: model)")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--sharegpt-output-len", type=int, default=None)
    p.add_argument("--sharegpt-context-len", type=int, default=None)
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=1024)
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform on [max(int(L*ratio),1), L]; 1 = fixed lengths")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson arrivals); inf")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--warmup-requests", type=int, default=1)
    p.add_argument("--disable-stream", action="store_true")
    p.add_argument("--disable-ignore-eos", action="store_true")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--extra-request-body", default=None, metavar="JSON",
                   help="JSON object merged into every request body")
    p.add_argument("--apply-chat-template", action="store_true")
    p.add_argument("--tokenize-prompt", action="store_true", help="send token ids (native backends only)")
    p.add_argument("--output-file", default=None, help="append one JSON line (default: a name from the flags)")
    p.add_argument("--output-details", action="store_true", help="add per-request arrays to the JSON line")
    p.add_argument("--flush-cache", action="store_true", help="POST /flush_cache before the timed run")
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="save throughput / TTFT / ITL plots")
    p.add_argument("--tag", default=None, help="a label stored in the JSON line")
    p.add_argument("--gsp-num-groups", type=int, default=64)
    p.add_argument("--gsp-prompts-per-group", type=int, default=16)
    p.add_argument("--gsp-system-prompt-len", type=int, default=2048)
    p.add_argument("--gsp-question-len", type=int, default=128)
    p.add_argument("--gsp-output-len", type=int, default=256)
    p.add_argument("--gsp-range-ratio", type=float, default=1.0)
    p.add_argument("--gsp-fast-prepare", action="store_true", help="skip tokenizing the prompts (lengths = targets)")
    p.add_argument("--gsp-ordered", action="store_true", help="keep the groups in order (default: shuffled)")
    return p


def check_args(args: argparse.Namespace) -> None:
    """Value checks argparse cannot express; raises `BenchError` with the flag's name."""
    positive = {"--num-prompts": args.num_prompts, "--random-input-len": args.random_input_len,
                "--random-output-len": args.random_output_len, "--gsp-num-groups": args.gsp_num_groups,
                "--gsp-prompts-per-group": args.gsp_prompts_per_group,
                "--gsp-system-prompt-len": args.gsp_system_prompt_len,
                "--gsp-question-len": args.gsp_question_len, "--gsp-output-len": args.gsp_output_len}
    for flag, value in positive.items():
        if value < 1:
            raise BenchError(f"{flag} must be at least 1, got {value}")
    if not args.request_rate > 0:
        raise BenchError(f"--request-rate must be > 0 (or inf), got {args.request_rate}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise BenchError(f"--max-concurrency must be at least 1, got {args.max_concurrency}")
    if args.warmup_requests < 0:
        raise BenchError(f"--warmup-requests must be >= 0, got {args.warmup_requests}")
    for flag, ratio in (("--random-range-ratio", args.random_range_ratio), ("--gsp-range-ratio", args.gsp_range_ratio)):
        if not 0.0 <= ratio <= 1.0:
            raise BenchError(f"{flag} must be in [0, 1], got {ratio}")
    if args.tokenize_prompt and args.backend not in NATIVE_BACKENDS:
        raise BenchError(f"--tokenize-prompt needs a native backend ({', '.join(NATIVE_BACKENDS)})")
    if args.extra_request_body is not None:
        try:
            extra = json.loads(args.extra_request_body)
        except json.JSONDecodeError as e:
            raise BenchError(f"--extra-request-body is not valid JSON: {e}") from None
        if not isinstance(extra, dict):
            raise BenchError("--extra-request-body must be a JSON object")
    if args.plot and not args.plot.lower().endswith(".png"):
        raise BenchError(f"--plot expects a .png file name, got {args.plot!r}")


async def paced(rows: list[DatasetRow], request_rate: float, rng: np.random.Generator) -> AsyncIterator[DatasetRow]:
    """Yield the rows in order, sleeping an Exp(1/rate) gap after each (no gap at rate inf)."""
    for row in rows:
        yield row
        if request_rate != float("inf"):
            await asyncio.sleep(float(rng.exponential(1.0 / request_rate)))


async def run_benchmark(args: argparse.Namespace, rows: list[DatasetRow], request_func: RequestFunc,
                        template: RequestInput, base_url: str) -> tuple[list[RequestOutput], float, Any]:
    """Warm up, then the timed run. Returns (outputs in dataset order, duration, server info)."""
    from tqdm.auto import tqdm

    def make(row: DatasetRow, output_len: int | None = None) -> RequestInput:
        return RequestInput(prompt=row.prompt, prompt_len=row.prompt_len,
                            output_len=row.output_len if output_len is None else output_len,
                            api_url=template.api_url, model=template.model, stream=template.stream,
                            ignore_eos=template.ignore_eos, extra_body=template.extra_body,
                            headers=template.headers, count_tokens=template.count_tokens)

    # A connection per request, as SGLang's client (a session per request): with 8 in flight, llama-server
    # dropped pooled connections between streamed responses without saying so, and 1-5 of 16 requests failed
    # ("ClientOSError: Can not write request body"), counting it at 150-174 tok/s where it serves 211-222.
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, trust_env=False) as session:
        if args.warmup_requests > 0:
            warm = make(rows[0], min(rows[0].output_len, WARMUP_MAX_OUTPUT))
            results = await asyncio.gather(*(request_func(session, warm) for _ in range(args.warmup_requests)))
            if not any(r.success for r in results):
                raise BenchError(f"every warm-up request failed: {results[0].error}")
            print(f"Warm-up: {sum(r.success for r in results)}/{len(results)} request(s) succeeded")
        if args.flush_cache:
            problem = await asyncio.to_thread(flush_cache, base_url, template.headers)
            if problem:
                print(f"warning: flushing the cache failed: {problem}", file=sys.stderr)
        await asyncio.sleep(1.0)

        pbar = tqdm(total=len(rows), disable=args.disable_tqdm, desc="requests")
        semaphore = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None

        async def one(row: DatasetRow) -> RequestOutput:
            if semaphore is None:
                out = await request_func(session, make(row))
            else:
                async with semaphore:
                    out = await request_func(session, make(row))
            pbar.update(1)
            return out

        rng = np.random.default_rng(args.seed)
        start = time.perf_counter()
        tasks = [asyncio.create_task(one(row)) async for row in paced(rows, args.request_rate, rng)]
        outputs = list(await asyncio.gather(*tasks))
        server_info = None
        if args.backend in NATIVE_BACKENDS:
            server_info = await asyncio.to_thread(get_server_info, base_url, template.headers)
        duration = time.perf_counter() - start
        pbar.close()
    if args.backend not in NATIVE_BACKENDS:
        server_info = get_server_info(base_url, template.headers)
    return outputs, duration, server_info


def _headers() -> dict[str, str]:
    key = os.environ.get("OPENAI_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def run(args: argparse.Namespace) -> tuple[BenchmarkMetrics, dict[str, Any]]:
    """The whole benchmark for parsed flags; prints the block and returns (metrics, JSON result)."""
    check_args(args)
    base_url = (args.base_url or f"http://{args.host}:{args.port or default_port(args.backend)}").rstrip("/")
    headers = _headers()
    if args.model is None:
        args.model = discover_model(base_url, headers)
    else:
        check_reachable(base_url, headers)
    tokenizer = load_bench_tokenizer(args.tokenizer or args.model, base_url, headers)
    rows = build_dataset(args, tokenizer)
    if not rows:
        raise BenchError("the dataset is empty")
    print(f"Dataset {args.dataset_name}: {len(rows)} prompts, #Input tokens: {sum(r.prompt_len for r in rows)}, "
          f"#Output tokens: {sum(r.output_len for r in rows)}")
    template = RequestInput(prompt="", prompt_len=0, output_len=0, api_url=base_url + endpoint_of(args.backend),
                            model=args.served_model_name or args.model, stream=not args.disable_stream,
                            ignore_eos=not args.disable_ignore_eos,
                            extra_body=json.loads(args.extra_request_body) if args.extra_request_body else {},
                            headers=headers,
                            count_tokens=lambda text: len(tokenizer.encode(text, add_special_tokens=False)))
    print(f"Backend {args.backend} at {template.api_url}, model {template.model}, request rate "
          f"{args.request_rate}, max concurrency {args.max_concurrency or 'not set'}")
    outputs, duration, server_info = asyncio.run(run_benchmark(args, rows, request_func_of(args.backend), template,
                                                               base_url))
    metrics = calculate_metrics(outputs, duration, tokenizer)
    errors = format_errors(metrics)
    if errors:
        print(errors)
    print(format_block(metrics, args.backend, args.request_rate, args.max_concurrency))
    result = result_dict(metrics, args, server_info, outputs if args.output_details else None)
    output_file = args.output_file or default_output_file(args, datetime.now().strftime("%m%d"))
    append_json_line(output_file, result)
    if args.plot:
        from tokenloom.bench.plot import save_plot

        save_plot(outputs, metrics, args.plot, f"{args.backend}: {args.dataset_name}, {len(rows)} prompts, "
                                               f"rate {args.request_rate}")
        print(f"Plot saved to {args.plot}")
    return metrics, result


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        metrics, _ = run(args)
    except (BenchError, DatasetError, OSError) as e:
        print(f"bench_serving: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("bench_serving: interrupted", file=sys.stderr)
        return 130
    if metrics.completed == 0:
        print("bench_serving: error: every request failed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
