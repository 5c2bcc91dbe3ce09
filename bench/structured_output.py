"""Structured output cost: 64 concurrent requests with a JSON schema vs the same requests unconstrained.

    .venv/bin/python bench/structured_output.py             # SmolLM2 (bf16), 64 requests, 3 rounds
    .venv/bin/python bench/structured_output.py --quick     # 1 round
    .venv/bin/python bench/structured_output.py --jump-forward   # jump-forward on vs off (issue 32)

One engine (the default SmolLM2, overlap on) serves both workloads alternately, round after round. The schema
asks for a fixed-size array of short strings; each unconstrained request runs (ignore_eos) to the length of
its own constrained answer, measured at warm-up (`--output-len` sets one length instead), so both workloads
decode the same tokens per request and their batches shrink alike;
both report output tokens per second of wall time and the mean decode-step period from the loop's counters,
side by side (ratios: the machine is shared).

Also measured in this process, on the same vocabulary: the mask's cost per decode step at batch 64 (fill 64
matchers mid-answer + apply the mask to [64, vocab] float32 logits + accept one token each), reported as a
share of the unconstrained decode step; and the compile time of a schema corpus, cold (a new backend) and
cached (the `GrammarCompiler` cache), for xgrammar, llguidance and outlines. CPU times (time.thread_time) for the
in-process figures. The last line is one JSON object.

`--jump-forward`: two engines (SmolLM2 bf16, overlap on), `--enable-jump-forward` off and on, serve the same
requests for a record schema of seven fixed keys (enums, bounded strings and integers) in alternating order,
round after round; reported per engine (medians of the rounds): wall seconds, output tokens per second,
requests per second, decode steps and forced tokens. Jump-forward tokenizes forced text itself, so the two
engines' token counts may differ: requests per second (the same requests) is the like-for-like figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tokenloom import Engine  # noqa: E402
from tokenloom.config import ServerArgs  # noqa: E402
from tokenloom.grammar.backends import make_backend  # noqa: E402
from tokenloom.grammar.compiler import GrammarCompiler  # noqa: E402
from tokenloom.grammar.mask import allocate_bitmask  # noqa: E402
from tokenloom.grammar.spec import GrammarSpec  # noqa: E402
from tokenloom.layers.sampler import apply_grammar_mask  # noqa: E402
from tokenloom.models.loader import resolve_model_source  # noqa: E402
from tokenloom.tokenizer import load_tokenizer  # noqa: E402

BENCH_SCHEMA = {"type": "object", "properties": {"items": {
    "type": "array", "items": {"type": "string", "minLength": 3, "maxLength": 12}, "minItems": 12, "maxItems": 12}},
    "required": ["items"]}

CORPUS = [
    BENCH_SCHEMA,
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}, "required": ["name"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer"}, "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}}}}}},
    {"type": "object", "properties": {"v": {"anyOf": [{"type": "string", "pattern": "^[a-z]{3}$"},
                                                      {"type": "number"}]}, "ok": {"type": "boolean"}}},
    {"type": "array", "items": {"type": "object", "properties": {"x": {"type": "number"}, "when": {
        "type": "string", "format": "date-time"}}, "required": ["x"]}},
    {"type": "object", "properties": {"address": {"type": "object", "properties": {
        "street": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
        "country": {"enum": ["FR", "DE", "US", "JP"]}}, "required": ["street", "country"]},
        "emails": {"type": "array", "items": {"type": "string", "format": "email"}, "maxItems": 4}},
     "required": ["address"]},
]
VOCAB = 49152
BACKENDS_MEASURED = ("xgrammar", "llguidance", "outlines")  # mask cost and compile times, in process
JUMP_SCHEMA = {"type": "object", "properties": {
    "customer_name": {"type": "string", "maxLength": 16},
    "customer_email_address": {"type": "string", "maxLength": 24},
    "shipping_country": {"enum": ["France", "Germany", "Japan", "United States"]},
    "order_priority_level": {"enum": ["low", "normal", "urgent"]},
    "number_of_items": {"type": "integer", "minimum": 1, "maximum": 99},
    "gift_wrapping_requested": {"type": "boolean"},
    "delivery_instructions": {"type": "string", "maxLength": 24}},
    "required": ["customer_name", "customer_email_address", "shipping_country", "order_priority_level",
                 "number_of_items", "gift_wrapping_requested", "delivery_instructions"],
    "additionalProperties": False}


def run(engine: Engine, prompts: list[str], params: dict | list[dict]) -> dict:
    before = engine.get_server_info()
    start = time.perf_counter()
    outs = engine.generate(prompts, sampling_params=params)
    wall = time.perf_counter() - start
    after = engine.get_server_info()
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    steps = after["decode_steps"] - before["decode_steps"]
    return {"output_tok_s": tokens / wall, "tokens": tokens,
            "step_ms": 1e3 * (after["decode_period_s"] - before["decode_period_s"]) / steps if steps else None,
            "texts": [o["text"] for o in outs], "lengths": [o["meta_info"]["completion_tokens"] for o in outs]}


def mask_cost(backend_name: str, tokenizer, batch: int) -> dict:
    """CPU ms per decode step of the grammar work at `batch` rows (fill, apply, accept), mid-answer."""
    backend = make_backend(backend_name, tokenizer, VOCAB, (2,))
    compiled = backend.compile(GrammarSpec("json_schema", json.dumps(BENCH_SCHEMA)))
    matchers = [backend.new_matcher(compiled) for _ in range(batch)]
    # the backends write JSON differently (xgrammar with ": " separators, llguidance compact): the first
    # spelling of the same prefix the grammar takes
    for text in ('{"items": ["abc', '{"items":["abc'):
        prefix = tokenizer(text, add_special_tokens=False).input_ids
        probe = backend.new_matcher(compiled)
        if all(probe.accept(t) for t in prefix):
            break
    else:
        raise AssertionError(f"{backend_name}: no spelling of the prefix fits the schema")
    for m in matchers:
        for t in prefix:
            assert m.accept(t), f"{backend_name}: the prefix does not fit the schema"
    logits = torch.randn(batch, VOCAB)
    rows = torch.arange(batch)
    token = tokenizer("d", add_special_tokens=False).input_ids[0]
    fill, apply, accept = [], [], []
    for _ in range(20):
        t0 = time.thread_time()
        mask = allocate_bitmask(batch, VOCAB)
        for j, m in enumerate(matchers):
            m.fill(mask, j)
        t1 = time.thread_time()
        apply_grammar_mask(logits, mask, rows)  # what the sampler runs
        t2 = time.thread_time()
        for m in matchers:
            m.accept(token)
            m.rollback(1)
        t3 = time.thread_time()
        fill.append(t1 - t0)
        apply.append(t2 - t1)
        accept.append(t3 - t2)
    med = statistics.median
    return {"fill_ms": 1e3 * med(fill), "apply_ms": 1e3 * med(apply), "accept_ms": 1e3 * med(accept),
            "total_ms": 1e3 * (med(fill) + med(apply) + med(accept))}


def compile_times(backend_name: str, tokenizer) -> dict:
    compiler = GrammarCompiler(lambda: make_backend(backend_name, tokenizer, VOCAB, (2,)))
    try:
        compiler.submit(GrammarSpec("regex", "warm")).result()  # builds the backend (vocabulary index) first
        cold = []
        for schema in CORPUS:
            start = time.perf_counter()
            compiler.submit(GrammarSpec("json_schema", json.dumps(schema))).result()
            cold.append(time.perf_counter() - start)
        start = time.perf_counter()
        for schema in CORPUS:
            compiler.submit(GrammarSpec("json_schema", json.dumps(schema))).result()
        cached = (time.perf_counter() - start) / len(CORPUS)
    finally:
        compiler.shutdown()
    return {"cold_ms_each": [round(1e3 * c, 2) for c in cold], "cold_ms_mean": 1e3 * statistics.mean(cold),
            "cached_us_mean": 1e6 * cached}


def jump_forward(ns: argparse.Namespace, rounds: int) -> dict:
    """Jump-forward off vs on: the same schema requests on two engines, alternating, medians of `rounds`."""
    prompts = [f"Write the order record of customer number {i} as JSON." for i in range(ns.num_prompts)]
    params = {"json_schema": json.dumps(JUMP_SCHEMA), "temperature": 0, "max_new_tokens": 256}
    engines = {name: Engine(dtype="bfloat16", log_level="warning", max_running_requests=ns.num_prompts,
                            overlap_schedule="on", enable_jump_forward=name == "on") for name in ("off", "on")}
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    try:
        for engine in engines.values():
            engine.generate(prompts[:8], sampling_params=params)  # warm-up + compile (cached after)
        for r in range(rounds):
            for name in (("off", "on") if r % 2 == 0 else ("on", "off")):
                engine = engines[name]
                before = engine.get_server_info()
                res = run(engine, prompts, params)
                after = engine.get_server_info()
                for text in res.pop("texts"):
                    json.loads(text)  # every answer parses
                res["wall_s"] = res["tokens"] / res["output_tok_s"]
                res["req_s"] = ns.num_prompts / res["wall_s"]
                res["decode_steps"] = after["decode_steps"] - before["decode_steps"]
                forced = "num_jump_forward_tokens"
                res["forced_tokens"] = after.get(forced, 0) - before.get(forced, 0)
                runs[name].append(res)
                print(f"round {r + 1} jump-forward {name:>3}: {res['output_tok_s']:7.1f} tok/s, {res['req_s']:.2f} "
                      f"req/s, {res['tokens']} tokens ({res['forced_tokens']} forced), {res['decode_steps']} decode "
                      f"steps", flush=True)
    finally:
        for engine in engines.values():
            engine.shutdown()
    med = statistics.median
    summary = {name: {k: med(x[k] for x in v) for k in ("output_tok_s", "req_s", "wall_s", "tokens",
                                                         "decode_steps", "forced_tokens")}
               for name, v in runs.items()}
    return {"bench": "structured_output_jump_forward", "num_prompts": ns.num_prompts, "rounds": rounds,
            "serving": summary, "req_s_ratio_on_off": summary["on"]["req_s"] / summary["off"]["req_s"],
            "output_tok_s_ratio_on_off": summary["on"]["output_tok_s"] / summary["off"]["output_tok_s"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--output-len", type=int, default=0,
                   help="unconstrained max_new_tokens (ignore_eos); 0: each request its own constrained answer's "
                        "length, measured at warm-up")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--jump-forward", action="store_true", help="measure --enable-jump-forward off vs on instead")
    ns = p.parse_args()
    rounds = 1 if ns.quick else ns.rounds
    if ns.jump_forward:
        report = jump_forward(ns, rounds)
        print(f"jump-forward on / off: requests/s x{report['req_s_ratio_on_off']:.3f}, output tokens/s "
              f"x{report['output_tok_s_ratio_on_off']:.3f}")
        print(json.dumps(report))
        return
    tokenizer = load_tokenizer(resolve_model_source(ServerArgs()))
    report: dict = {"bench": "structured_output", "num_prompts": ns.num_prompts, "rounds": rounds,
                    "threads": torch.get_num_threads()}
    report["compile"] = {name: compile_times(name, tokenizer) for name in BACKENDS_MEASURED}
    report["mask_cost_batch64"] = {name: mask_cost(name, tokenizer, 64) for name in BACKENDS_MEASURED}
    print(json.dumps(report["compile"]), json.dumps(report["mask_cost_batch64"]), flush=True)
    engine = Engine(dtype="bfloat16", log_level="warning", max_running_requests=ns.num_prompts,
                    overlap_schedule="on")
    try:
        prompts = [f"List twelve short words about topic number {i}, as JSON." for i in range(ns.num_prompts)]
        constrained = {"json_schema": json.dumps(BENCH_SCHEMA), "temperature": 0, "max_new_tokens": 256}
        engine.generate(prompts[:8], sampling_params={"temperature": 0, "max_new_tokens": 8})  # warm-up
        warm = run(engine, prompts, constrained)  # warm-up + compile (cached after) + the answers' length
        lengths = [ns.output_len] * ns.num_prompts if ns.output_len else warm["lengths"]
        report["unconstrained_output_lens"] = {"mean": statistics.mean(lengths), "min": min(lengths),
                                               "max": max(lengths)}
        free = [{"temperature": 0, "max_new_tokens": n, "ignore_eos": True} for n in lengths]
        runs = {"json_schema": [], "unconstrained": []}
        for r in range(rounds):
            for name in (("json_schema", "unconstrained") if r % 2 == 0 else ("unconstrained", "json_schema")):
                res = run(engine, prompts, constrained if name == "json_schema" else free)
                runs[name].append(res)
                print(f"round {r + 1} {name:>13}: {res['output_tok_s']:7.1f} tok/s, {res['tokens']} tokens, "
                      f"step {res['step_ms']:.1f} ms", flush=True)
        for res in runs["json_schema"]:
            for text in res["texts"]:
                json.loads(text)  # every constrained answer parses
    finally:
        engine.shutdown()
    med = statistics.median
    summary = {name: {"output_tok_s": med(x["output_tok_s"] for x in v), "step_ms": med(x["step_ms"] for x in v),
                      "tokens": med(x["tokens"] for x in v)} for name, v in runs.items()}
    report["serving"] = summary
    report["round_ratios"] = [c["output_tok_s"] / u["output_tok_s"]
                              for c, u in zip(runs["json_schema"], runs["unconstrained"], strict=True)]
    report["throughput_ratio"] = summary["json_schema"]["output_tok_s"] / summary["unconstrained"]["output_tok_s"]
    report["step_ratio"] = summary["json_schema"]["step_ms"] / summary["unconstrained"]["step_ms"]
    report["mask_share_of_step"] = {name: c["total_ms"] / summary["unconstrained"]["step_ms"]
                                    for name, c in report["mask_cost_batch64"].items()}
    print(f"throughput json_schema / unconstrained: {report['throughput_ratio']:.3f} (rounds "
          + " / ".join(f"{x:.3f}" for x in report["round_ratios"]) + "); "
          f"step ratio {report['step_ratio']:.3f}; mask share of the step at batch 64: "
          + ", ".join(f"{k} {100 * v:.1f}%" for k, v in report["mask_share_of_step"].items()))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
