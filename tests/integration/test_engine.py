"""The Engine end to end: scheduler and detokenizer subprocesses over ZMQ, on a tiny random model with
SmolLM2's tokenizer (fast) and on the real SmolLM2 (once)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import torch

from tests.engine_checks import wait_idle_pools_full
from tokenloom import Engine
from tokenloom.frontend.tokenizer_manager import EngineDeadError

GREEDY = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
PROMPTS = ["The capital city of France is", "1, 2, 3, 4, 5,", "Once upon a time", "def fibonacci(n):",
           "A long long prompt " * 30]


@pytest.fixture(scope="module")
def engine(tiny_runtime_model):
    with Engine(tiny_runtime_model, dtype="float32", max_total_tokens=8192, max_running_requests=16,
                chunked_prefill_size=64, log_level="warning") as eng:
        yield eng
        _assert_pools_full(eng)


def _assert_pools_full(eng: Engine) -> None:
    info = wait_idle_pools_full(eng)
    assert info["free_request_slots"] >= 16


def test_response_shape(engine):
    out = engine.generate(PROMPTS[0], GREEDY)
    assert set(out) == {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 24}
    assert meta["completion_tokens"] == len(out["output_ids"]) == 24
    assert meta["prompt_tokens"] == len(engine.tokenizer(PROMPTS[0]).input_ids)
    assert meta["e2e_latency"] > 0 and meta["total_retractions"] == 0
    assert out["text"] == engine.tokenizer.decode(out["output_ids"], skip_special_tokens=True)
    _assert_pools_full(engine)


def test_batch_equals_one_at_a_time(engine):
    single = [engine.generate(p, GREEDY)["output_ids"] for p in PROMPTS]
    batch = engine.generate(PROMPTS, GREEDY)
    assert [b["output_ids"] for b in batch] == single
    per_request = engine.generate(PROMPTS, [dict(GREEDY, max_new_tokens=5 + i) for i in range(len(PROMPTS))])
    assert [len(b["output_ids"]) for b in per_request] == [5 + i for i in range(len(PROMPTS))]
    _assert_pools_full(engine)


def test_input_ids_and_n(engine):
    ids = engine.tokenizer(PROMPTS[2]).input_ids
    assert engine.generate(input_ids=ids, sampling_params=GREEDY)["output_ids"] == \
        engine.generate(PROMPTS[2], GREEDY)["output_ids"]
    outs = engine.generate(PROMPTS[2], {"temperature": 0.8, "max_new_tokens": 6, "n": 3})
    assert len(outs) == 3


def test_streaming_is_cumulative_and_matches(engine):
    final = engine.generate(PROMPTS[1], GREEDY)
    chunks = list(engine.generate(PROMPTS[1], GREEDY, stream=True))
    assert len(chunks) >= 2
    for a, b in zip(chunks, chunks[1:], strict=False):
        assert b["text"].startswith(a["text"]) and b["output_ids"][: len(a["output_ids"])] == a["output_ids"]
    assert chunks[-1]["text"] == final["text"] and chunks[-1]["output_ids"] == final["output_ids"]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])


def test_shared_prefix_reports_cached_tokens(engine):
    system = "You are a very helpful assistant. Answer briefly and precisely. " * 4
    first = engine.generate(system + "What is 2+2?", GREEDY)
    second = engine.generate(system + "What is the capital of Italy?", GREEDY)
    assert first["meta_info"]["cached_tokens"] == 0
    assert second["meta_info"]["cached_tokens"] > 0.5 * len(engine.tokenizer(system).input_ids)


def test_stop_string_across_tokens_and_stop_token_ids(engine):
    base = engine.generate(PROMPTS[3], dict(GREEDY, max_new_tokens=16))
    ids, text = base["output_ids"], base["text"]
    # A stop string made of the last character of one token and the first of the next (spans a boundary).
    pieces = [engine.tokenizer.decode(ids[:k]) for k in range(len(ids) + 1)]
    k = next(k for k in range(4, len(ids))
             if len(pieces[k]) > len(pieces[k - 1]) and len(pieces[k + 1]) > len(pieces[k]))
    stop = pieces[k][-1] + pieces[k + 1][len(pieces[k])]
    out = engine.generate(PROMPTS[3], dict(GREEDY, max_new_tokens=16, stop=[stop]))
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == text[: text.find(stop)]
    kept = engine.generate(PROMPTS[3], dict(GREEDY, max_new_tokens=16, stop=[stop], no_stop_trim=True))
    assert kept["text"] == text[: text.find(stop) + len(stop)] or kept["text"].startswith(text[: text.find(stop)])
    assert stop in kept["text"]
    token = ids[6]
    out = engine.generate(PROMPTS[3], dict(GREEDY, max_new_tokens=16, stop_token_ids=[token]))
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": token}
    assert out["output_ids"] == ids[: ids.index(token) + 1]


def test_async_generate_and_abort_midway(engine):
    async def scenario():
        params = {"temperature": 0, "max_new_tokens": 1000, "ignore_eos": True}
        stream = await engine.async_generate(PROMPTS[0], params, rid="long-one", stream=True)
        seen = 0
        async for chunk in stream:
            seen += 1
            if seen == 3:
                engine.abort("long-one")
            if chunk["meta_info"]["finish_reason"] is not None:
                return chunk
        return None

    last = asyncio.run(scenario())
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert last["meta_info"]["completion_tokens"] < 1000
    _assert_pools_full(engine)


def test_cancelled_caller_aborts_request(engine):
    async def scenario():
        task = asyncio.ensure_future(engine.async_generate(
            PROMPTS[0], {"temperature": 0, "max_new_tokens": 1500, "ignore_eos": True}))
        await asyncio.sleep(1.0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())
    _assert_pools_full(engine)


def test_bad_requests_raise_value_error(engine):
    with pytest.raises(ValueError, match="temperature"):
        engine.generate("hi", {"temperature": -1})
    with pytest.raises(ValueError, match="unknown sampling parameter"):
        engine.generate("hi", {"tempreature": 1})
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate(input_ids=[1, 2, 10**7])
    with pytest.raises(ValueError, match="context length"):
        engine.generate("word " * 3000)
    assert engine.generate("still serving", dict(GREEDY, max_new_tokens=2))["meta_info"]["completion_tokens"] == 2


def test_prompt_logprobs_and_token_ids_logprob(engine, tiny_runtime_model):
    from transformers import AutoModelForCausalLM

    prompt, k, ids = PROMPTS[4], 50, [3, 1000]  # longer than the 64-token chunks, start inside the second
    out = engine.generate(prompt, dict(GREEDY, max_new_tokens=3), return_logprob=True, logprob_start_len=k,
                          top_logprobs_num=2, token_ids_logprob=ids)
    meta, tokens = out["meta_info"], engine.tokenizer(prompt).input_ids
    model = AutoModelForCausalLM.from_pretrained(tiny_runtime_model, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([tokens + out["output_ids"]])).logits[0].float(), dim=-1)
    n = len(tokens)
    assert meta["input_token_logprobs"][0] == [None, tokens[k], None]
    assert [t[1] for t in meta["input_token_logprobs"]] == tokens[k:]
    got = torch.tensor([t[0] for t in meta["input_token_logprobs"][1:]])
    assert torch.allclose(got, ref[range(k, n - 1), tokens[k + 1:]], atol=1e-4)
    assert meta["input_top_logprobs"][0] is None and len(meta["input_top_logprobs"]) == n - k
    assert [t[1] for t in meta["input_top_logprobs"][1]] == ref[k].topk(2).indices.tolist()
    by_id = meta["input_token_ids_logprobs"]
    assert by_id[0] is None and [t[1] for t in by_id[1]] == ids
    assert torch.allclose(torch.tensor([[t[0] for t in pos] for pos in by_id[1:]]), ref[k:n - 1][:, ids], atol=1e-4)
    out_ids = meta["output_token_ids_logprobs"]
    assert len(out_ids) == 3
    assert torch.allclose(torch.tensor([[t[0] for t in pos] for pos in out_ids]), ref[n - 1:n + 2][:, ids], atol=1e-4)
    plain = engine.generate(prompt, dict(GREEDY, max_new_tokens=1), return_logprob=True)
    assert "input_token_logprobs" not in plain["meta_info"]  # -1: output logprobs only
    with pytest.raises(ValueError, match="logprob_start_len"):
        engine.generate(prompt, GREEDY, return_logprob=True, logprob_start_len=n)
    with pytest.raises(ValueError, match="logprob_start_len must be -1"):
        engine.generate(prompt, GREEDY, return_logprob=True, logprob_start_len=-2)
    with pytest.raises(ValueError, match="token_ids_logprob contains token id"):
        engine.generate(prompt, GREEDY, return_logprob=True, token_ids_logprob=[10**7])
    _assert_pools_full(engine)


def test_flush_cache(engine):
    engine.generate("a prompt to cache " * 5, dict(GREEDY, max_new_tokens=2))
    assert engine.flush_cache()["success"]
    info = engine.get_server_info()
    assert info["evictable_kv_tokens"] == 0 and info["available_kv_tokens"] == info["max_total_num_tokens"]


def test_dead_scheduler_fails_pending_calls_fast(tiny_runtime_model):
    eng = Engine(tiny_runtime_model, dtype="float32", max_total_tokens=4096, log_level="error")
    try:
        pid = eng.tokenizer_manager.processes["scheduler"].pid

        async def scenario():
            task = asyncio.ensure_future(eng.async_generate(
                "hello", {"max_new_tokens": 100000 // 100, "ignore_eos": True}))
            await asyncio.sleep(0.5)
            os.kill(pid, signal.SIGKILL)
            start = time.monotonic()
            with pytest.raises(EngineDeadError, match="scheduler process died"):
                await asyncio.wait_for(task, timeout=10)
            return time.monotonic() - start

        assert asyncio.run(scenario()) < 5
        with pytest.raises(EngineDeadError):
            eng.generate("again")
    finally:
        eng.shutdown()


def test_real_smollm2_engine_matches_in_process_generation():
    from tests.scheduler_harness import generate_in_process
    from tokenloom.config import ServerArgs
    from tokenloom.executor.model_runner import ModelRunner

    prompts = ["The capital city of France is", "Write a short poem about the sea:"]
    params = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
    with Engine(dtype="float32", max_total_tokens=4096, log_level="warning") as eng:
        outs = eng.generate(prompts, params)
        ids = [eng.tokenizer(p).input_ids for p in prompts]
    runner = ModelRunner(ServerArgs(dtype="float32", max_total_tokens=1024, max_running_requests=4))
    ref = [generate_in_process(runner, [i], [params])[0] for i in ids]
    assert [o["output_ids"] for o in outs] == ref
    assert "Paris" in outs[0]["text"]
