"""The native API over real HTTP (aiohttp): /generate single, batch, n, input_ids, streaming, logprobs,
rid + /abort_request, and the info/control routes."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import aiohttp
import pytest

from tests.e2e.server_process import http

GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
PROMPTS = ["The capital city of France is", "1, 2, 3, 4,", "Once upon a time"]


async def post(session: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, Any]:
    async with session.post(url, json=body) as resp:
        return resp.status, await resp.json(content_type=None)


async def stream_events(session: aiohttp.ClientSession, url: str, body: Any) -> list[Any]:
    events = []
    async with session.post(url, json=body) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        async for line in resp.content:
            line = line.strip()
            if line.startswith(b"data: "):
                payload = line[len(b"data: "):]
                events.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return events


def run(coro: Any) -> Any:
    async def wrapped() -> Any:
        async with aiohttp.ClientSession() as session:
            return await coro(session)

    return asyncio.run(wrapped())


@pytest.fixture(scope="module")
def url(tiny_server):
    return tiny_server.url


def test_single_generate_shape(url, tiny_server):
    async def scenario(s):
        return await post(s, url + "/generate", {"text": PROMPTS[0], "sampling_params": GREEDY})

    status, out = run(scenario)
    assert status == 200
    assert set(out) == {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 12}
    assert meta["completion_tokens"] == len(out["output_ids"]) == 12
    assert meta["prompt_tokens"] > 0 and meta["e2e_latency"] > 0 and meta["id"]
    assert isinstance(out["text"], str) and out["text"]
    tiny_server.wait_idle_and_pool_full()


def test_put_batch_and_input_ids_match_single(url):
    async def scenario(s):
        singles = [await post(s, url + "/generate", {"text": p, "sampling_params": GREEDY}) for p in PROMPTS]
        status, batch = await post(s, url + "/generate", {"text": PROMPTS, "sampling_params": GREEDY})
        async with s.put(url + "/generate", json={"text": PROMPTS[0], "sampling_params": GREEDY}) as resp:
            put = (resp.status, await resp.json())
        return singles, (status, batch), put

    singles, (status, batch), put = run(scenario)
    assert status == 200 and isinstance(batch, list) and len(batch) == 3
    assert [b["output_ids"] for b in batch] == [s[1]["output_ids"] for s in singles]
    assert put[0] == 200 and put[1]["output_ids"] == singles[0][1]["output_ids"]

    async def by_ids(s):
        one = await post(s, url + "/generate", {"input_ids": [1, 504, 3458, 282], "sampling_params": GREEDY})
        many = await post(s, url + "/generate", {"input_ids": [[1, 504, 3458, 282], [1, 2, 3]],
                                                 "sampling_params": [GREEDY, dict(GREEDY, max_new_tokens=3)]})
        return one, many

    (s1, one), (s2, many) = run(by_ids)
    assert s1 == 200 and one["meta_info"]["prompt_tokens"] == 4
    assert s2 == 200 and many[0]["output_ids"] == one["output_ids"] and len(many[1]["output_ids"]) == 3


def test_n_expands_and_seed_reproduces(url):
    params = {"temperature": 1.0, "max_new_tokens": 8, "n": 3, "ignore_eos": True}

    async def scenario(s):
        a = await post(s, url + "/generate", {"text": PROMPTS[2], "sampling_params": params})
        b = await post(s, url + "/generate", {"text": PROMPTS[:2], "sampling_params": params})
        seeded = {"temperature": 1.0, "max_new_tokens": 8, "sampling_seed": 7, "ignore_eos": True}
        c = await post(s, url + "/generate", {"text": PROMPTS[2], "sampling_params": seeded})
        d = await post(s, url + "/generate", {"text": PROMPTS[2], "sampling_params": seeded})
        return a, b, c, d

    (sa, a), (sb, b), (sc, c), (sd, d) = run(scenario)
    assert sa == 200 and len(a) == 3 and all(len(x["output_ids"]) == 8 for x in a)
    assert sb == 200 and len(b) == 6
    assert sc == sd == 200 and c["output_ids"] == d["output_ids"]


def test_stream_is_cumulative_and_ends_with_done(url):
    async def scenario(s):
        final = await post(s, url + "/generate", {"text": PROMPTS[1], "sampling_params": GREEDY})
        events = await stream_events(s, url + "/generate", {"text": PROMPTS[1], "sampling_params": GREEDY,
                                                            "stream": True})
        return final[1], events

    final, events = run(scenario)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) >= 2
    for a, b in zip(chunks, chunks[1:], strict=False):
        assert b["text"].startswith(a["text"])
        assert b["output_ids"][: len(a["output_ids"])] == a["output_ids"]
    assert all(c["meta_info"]["completion_tokens"] == len(c["output_ids"]) for c in chunks)
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["text"] == final["text"] and chunks[-1]["output_ids"] == final["output_ids"]


def test_batch_stream_carries_index(url):
    async def scenario(s):
        return await stream_events(s, url + "/generate", {"text": PROMPTS[:2], "stream": True,
                                                          "sampling_params": dict(GREEDY, max_new_tokens=4)})

    events = run(scenario)
    assert events[-1] == "[DONE]"
    finals = {e["index"]: e for e in events[:-1] if e["meta_info"]["finish_reason"] is not None}
    assert set(finals) == {0, 1} and all(len(f["output_ids"]) == 4 for f in finals.values())


def test_logprobs_non_stream_and_stream(url):
    body = {"text": PROMPTS[0], "sampling_params": dict(GREEDY, max_new_tokens=5), "return_logprob": True,
            "top_logprobs_num": 3, "logprob_start_len": -1}

    async def scenario(s):
        plain = await post(s, url + "/generate", body)
        texts = await post(s, url + "/generate", dict(body, return_text_in_logprobs=True))
        events = await stream_events(s, url + "/generate", dict(body, stream=True))
        return plain, texts, events

    (status, out), (_, with_text), events = run(scenario)
    assert status == 200
    lps = out["meta_info"]["output_token_logprobs"]
    assert [t[1] for t in lps] == out["output_ids"]
    assert all(t[0] <= 0 and t[2] is None for t in lps)
    tops = out["meta_info"]["output_top_logprobs"]
    assert len(tops) == 5 and all(len(pos) == 3 for pos in tops)
    # greedy: the sampled token is the most likely one
    assert all(pos[0][1] == tok and abs(pos[0][0] - t[0]) < 1e-4 for pos, tok, t in zip(tops, out["output_ids"], lps,
                                                                                       strict=True))
    assert all(isinstance(t[2], str) for t in with_text["meta_info"]["output_token_logprobs"])
    last = events[-2]
    assert last["meta_info"]["output_token_logprobs"] == lps  # cumulative in the stream too
    assert len(events[0]["meta_info"]["output_token_logprobs"]) == len(events[0]["output_ids"])


def test_abort_request_by_rid(url, tiny_server):
    async def scenario(s):
        task = asyncio.ensure_future(post(s, url + "/generate", {
            "text": PROMPTS[0], "rid": "abort-me", "sampling_params": {"max_new_tokens": None, "ignore_eos": True}}))
        for _ in range(200):
            await asyncio.sleep(0.05)
            async with s.get(url + "/get_server_info") as resp:
                if (await resp.json())["num_running_reqs"]:
                    break
        status, _ = await post(s, url + "/abort_request", {"rid": "abort-me"})
        return status, await task

    status, (code, out) = run(scenario)
    assert status == 200
    assert code == 200 and out["meta_info"]["finish_reason"]["type"] == "abort"
    assert "status_code" not in out["meta_info"]["finish_reason"]
    tiny_server.wait_idle_and_pool_full()
    assert http("POST", url + "/abort_request", {"nothing": 1})[0] == 400


def test_info_routes(url, tiny_server):
    status, info = http("GET", url + "/get_server_info")
    assert status == 200
    assert info["max_total_num_tokens"] == 16384 and info["dtype"] == "float32" and info["port"] == tiny_server.port
    assert {"kv_tokens_in_use", "available_kv_tokens", "free_request_slots", "last_gen_throughput"} <= set(info)
    assert info["internal_states"][0]["max_total_num_tokens"] == 16384
    assert http("GET", url + "/server_info")[0] == 200
    status, model = http("GET", url + "/get_model_info")
    assert status == 200 and model["is_generation"] and model["architectures"] == ["LlamaForCausalLM"]
    assert http("GET", url + "/model_info")[1] == model
    assert http("GET", url + "/health")[0] == 200 and http("GET", url + "/health_generate")[0] == 200
    status, text = http("GET", url + "/metrics")
    assert status == 200 and "sglang:num_requests_total" in text and "sglang:token_usage" in text


def test_flush_cache_refused_while_running(url, tiny_server):
    async def scenario(s):
        task = asyncio.ensure_future(post(s, url + "/generate", {
            "text": PROMPTS[0], "sampling_params": {"max_new_tokens": None, "ignore_eos": True}}))
        for _ in range(200):
            await asyncio.sleep(0.05)
            async with s.get(url + "/get_server_info") as resp:
                if (await resp.json())["num_running_reqs"]:
                    break
        async with s.post(url + "/flush_cache") as resp:
            busy = resp.status, await resp.text()
        task.cancel()  # disconnects; the server aborts the request
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return busy

    busy = run(scenario)
    assert busy[0] == 400 and "running or waiting" in busy[1]
    tiny_server.wait_idle_and_pool_full()
    status, text = http("POST", url + "/flush_cache")
    assert status == 200 and "flushed" in text
    assert http("GET", url + "/flush_cache")[0] == 200
    info = tiny_server.server_info()
    assert info["evictable_kv_tokens"] == 0 and info["available_kv_tokens"] == info["max_total_num_tokens"]
