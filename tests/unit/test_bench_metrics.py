"""bench_serving metrics on synthetic request timings (known TTFT/ITL/TPOT/E2E), peak throughput and
concurrency buckets, cache hit rate, failed requests; and the request functions against a scripted fake server
(chunk gaps spread over the tokens a chunk carried, errors never raised)."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web

from tokenloom.bench.backends import RequestInput, request_chat, request_completions, request_native
from tokenloom.bench.metrics import (
    RequestOutput,
    calculate_metrics,
    peak_concurrent_requests,
    peak_output_throughput,
    spread_gap,
)


class WordTokenizer:
    """Retokenization stand-in: one token per whitespace-separated word."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(range(len(text.split())))


def make_output(start: float, ttft: float, itl: list[float], prompt_len: int = 10, text: str = "",
                cached: int | None = None, server_prompt: int | None = None) -> RequestOutput:
    times = [start + ttft]
    for gap in itl:
        times.append(times[-1] + gap)
    return RequestOutput(success=True, prompt_len=prompt_len, output_len=len(itl) + 1, generated_text=text,
                         ttft=ttft, latency=ttft + sum(itl), itl=list(itl), token_times=times, start_time=start,
                         cached_tokens=cached, server_prompt_tokens=server_prompt)


def test_spread_gap():
    assert spread_gap(0.3, 3) == pytest.approx([0.1, 0.1, 0.1])
    assert spread_gap(0.5, 0) == []


def test_known_latencies():
    a = make_output(100.0, 0.5, [0.1] * 4, prompt_len=8, text="one two three four five")  # latency 0.9
    b = make_output(100.2, 1.0, [0.2, 0.2], prompt_len=12, text="x y z")  # latency 1.4
    failed = RequestOutput(success=False, prompt_len=99, error="HTTP 503: The request queue is full.")
    m = calculate_metrics([a, b, failed], duration=2.0, tokenizer=WordTokenizer())
    assert (m.completed, m.failed) == (2, 1)
    assert m.errors == {"HTTP 503: The request queue is full.": 1}
    assert m.total_input == 20 and m.total_output == 8 and m.total_output_retokenized == 8
    assert m.request_throughput == pytest.approx(1.0)
    assert m.output_throughput == pytest.approx(4.0)
    assert m.total_throughput == pytest.approx(14.0)
    assert m.concurrency == pytest.approx((0.9 + 1.4) / 2.0)
    assert m.ttft.mean == pytest.approx(750.0) and m.ttft.median == pytest.approx(750.0)
    assert m.ttft.p99 == pytest.approx(500 + 0.99 * 500)
    # TPOT per request: (latency - ttft) / (output_len - 1) = 0.1 and 0.2 s
    assert m.tpot.mean == pytest.approx(150.0) and m.tpot.p99 == pytest.approx(100 + 0.99 * 100)
    # ITL pooled over all gaps: four 100 ms and two 200 ms
    assert m.itl.mean == pytest.approx(800 / 6) and m.itl.median == pytest.approx(100.0)
    assert m.itl.max == pytest.approx(200.0) and m.itl.p95 == pytest.approx(200.0)
    assert m.e2e_latency.mean == pytest.approx(1150.0) and m.e2e_latency.p90 == pytest.approx(900 + 0.9 * 500)
    assert m.cache_hit_rate is None


def test_single_token_requests_have_no_tpot():
    m = calculate_metrics([make_output(0.0, 0.3, [])], duration=1.0, tokenizer=None)
    assert m.tpot.mean == 0.0 and m.itl.mean == 0.0 and m.ttft.mean == pytest.approx(300.0)
    assert m.total_output_retokenized == 0


def test_peaks():
    # 10 tokens inside the first second for a, 3 tokens at 1.x s for b
    a = make_output(0.0, 0.05, [0.09] * 9)  # tokens at 0.05 .. 0.86
    b = make_output(0.5, 0.6, [0.1, 0.1])  # tokens at 1.1, 1.2, 1.3
    c = make_output(2.5, 0.1, [])  # alive only in bucket 2
    outputs = [a, b, c]
    assert peak_output_throughput(outputs) == 10.0
    # bucket 0: a, b; bucket 1: b; bucket 2: c
    assert peak_concurrent_requests(outputs) == 2
    assert peak_concurrent_requests([]) == 0 and peak_output_throughput([]) == 0.0


def test_cache_hit_rate_from_reporting_requests():
    outs = [make_output(0, 0.1, [0.1], cached=30, server_prompt=40), make_output(0, 0.1, [0.1], cached=0,
                                                                                 server_prompt=60),
            make_output(0, 0.1, [0.1])]  # reports nothing: not counted
    m = calculate_metrics(outs, 1.0, None)
    assert m.cached_tokens == 30 and m.cache_prompt_tokens == 100 and m.cache_hit_rate == pytest.approx(0.3)


def test_all_failed():
    m = calculate_metrics([RequestOutput(error="boom"), RequestOutput(error="boom")], 1.0, WordTokenizer())
    assert m.completed == 0 and m.failed == 2 and m.errors == {"boom": 2}
    assert m.output_throughput == 0.0 and m.ttft.mean == 0.0 and m.max_concurrent_requests == 0


# ---- request functions against a scripted server -------------------------------------------------------------

GAP = 0.15


def sse(obj) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"


async def native_stream(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    assert body["sampling_params"] == {"temperature": 0.0, "max_new_tokens": 5, "ignore_eos": True, "top_k": 3}
    assert body["stream"] is True and body["text"] == "hi" and body["rid"] == "r1"
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    meta = {"prompt_tokens": 4, "cached_tokens": 1}
    events = [("", 0), ("a", 1), ("abc", 3), ("abc", 3), ("abcde", 5)]  # an empty first chunk, a 0-token chunk
    for text, n in events:
        await resp.write(sse({"text": text, "meta_info": {**meta, "completion_tokens": n}}))
        await asyncio.sleep(GAP)
    await resp.write(sse(b"[DONE]"))
    return resp


async def native_error(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await resp.write(sse({"error": {"message": "bad thing"}}))
    await resp.write(sse(b"[DONE]"))
    return resp


async def oai_stream(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    chat = "messages" in body
    assert body["max_tokens"] == 5 and body["stream_options"] == {"include_usage": True}
    # ignore_eos is an extension: sent only when wanted (strict OpenAI servers reject unknown fields)
    assert body.get("ignore_eos") is (None if body["model"] == "strict" else True)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    pieces = ["", "Hel", "lo", " you"]
    for p in pieces:
        choice = {"index": 0, "delta": {"content": p}} if chat else {"index": 0, "text": p}
        await resp.write(sse({"choices": [choice], "usage": None}))
        await asyncio.sleep(GAP)
    usage = {"prompt_tokens": 7, "completion_tokens": 4, "total_tokens": 11, "prompt_tokens_details":
             {"cached_tokens": 2}}
    await resp.write(sse({"choices": [], "usage": usage}))
    await resp.write(sse(b"[DONE]"))
    return resp


async def full_queue(request: web.Request) -> web.Response:
    return web.json_response({"error": {"message": "The request queue is full."}}, status=503)


def with_server(coro_factory):
    async def main():
        app = web.Application()
        app.router.add_post("/generate", native_stream)
        app.router.add_post("/err", native_error)
        app.router.add_post("/v1/completions", oai_stream)
        app.router.add_post("/v1/chat/completions", oai_stream)
        app.router.add_post("/full", full_queue)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            async with aiohttp.ClientSession() as session:
                return await coro_factory(session, f"http://127.0.0.1:{port}")
        finally:
            await runner.cleanup()

    return asyncio.run(main())


def test_native_stream_spreads_chunk_gaps():
    def go(session, url):
        req = RequestInput("hi", 4, 5, url + "/generate", extra_body={"rid": "r1", "sampling_params": {"top_k": 3}})
        return request_native(session, req)

    out = with_server(go)
    assert out.success, out.error
    assert out.output_len == 5 and out.generated_text == "abcde"
    assert out.server_prompt_tokens == 4 and out.cached_tokens == 1
    # first text after one gap; then 2 tokens after one gap, the 0-token chunk skipped, 2 tokens after two gaps
    assert out.ttft >= GAP * 0.9
    assert len(out.itl) == 4
    assert out.itl[0] == pytest.approx(out.itl[1]) and out.itl[2] == pytest.approx(out.itl[3])
    assert out.itl[2] > out.itl[0]  # the skipped chunk's time counts in the next gap
    assert out.ttft + sum(out.itl) <= out.latency + 1e-9
    assert len(out.token_times) == 5 and out.token_times == sorted(out.token_times)


@pytest.mark.parametrize("func,path", [(request_completions, "/v1/completions"),
                                       (request_chat, "/v1/chat/completions")])
@pytest.mark.parametrize("model,ignore_eos", [("m", True), ("strict", False)])
def test_openai_stream_raw_gaps_and_usage(func, path, model, ignore_eos):
    out = with_server(lambda session, url: func(session, RequestInput("hi", 7, 5, url + path, model=model,
                                                                      ignore_eos=ignore_eos)))
    assert out.success, out.error
    assert out.generated_text == "Hello you"
    assert out.output_len == 4  # from usage, not the requested 5
    assert len(out.itl) == 2 and all(g >= GAP * 0.9 for g in out.itl)
    assert out.cached_tokens == 2 and out.server_prompt_tokens == 7
    assert len(out.token_times) == 4


def test_request_errors_are_outputs():
    out = with_server(lambda s, url: request_native(s, RequestInput("hi", 1, 5, url + "/err")))
    assert not out.success and out.error == "bad thing"
    out = with_server(lambda s, url: request_completions(s, RequestInput("hi", 1, 5, url + "/full")))
    assert not out.success and out.error == "HTTP 503: The request queue is full."

    async def refused():
        async with aiohttp.ClientSession() as session:
            return await request_chat(session, RequestInput("hi", 1, 5, "http://127.0.0.1:9/v1/chat/completions"))

    out = asyncio.run(refused())
    assert not out.success and "ClientConnectorError" in out.error
