"""bench_serving metrics on synthetic request timings (known TTFT/ITL/TPOT/E2E), peak throughput and
concurrency buckets, cache hit rate, failed requests, per-token ITL from chunk timings and OpenAI chunk token
counts; and the request functions against a scripted fake server (a chunk's gap spread over the tokens it
carried on every backend, native and OpenAI measured alike, errors never raised)."""

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
    chunk_token_counts,
    peak_concurrent_requests,
    peak_output_throughput,
    spread_gap,
    stream_timing,
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


def test_stream_timing_per_token():
    # first chunk: 2 tokens at once (TTFT, no gap); then 3 tokens after 0.3 s, a 0-token chunk, 1 token 0.3 s later
    itl, times = stream_timing([(1.0, 2), (1.3, 3), (1.45, 0), (1.6, 1)])
    assert itl == pytest.approx([0.1, 0.1, 0.1, 0.3])  # the skipped chunk's wait counts in the next gap
    assert times == pytest.approx([1.0, 1.0, 1.1, 1.2, 1.3, 1.6])
    assert len(times) == 2 + 3 + 1 and len(itl) == len(times) - 2
    assert stream_timing([]) == ([], [])
    assert stream_timing([(2.0, 1)]) == ([], [2.0])


def test_chunk_token_counts_rules():
    texts = ["Hel", "lo", " you"]
    by_chars = len  # a stand-in tokenizer: one token per character
    # 1. cumulative counts reported per chunk win (exact), whatever the other hints say
    assert chunk_token_counts(texts, [1, 3, 4], 4, by_chars) == [1, 2, 1]
    # ... unless one is missing or goes backwards: then the next rule
    assert chunk_token_counts(texts, [1, None, 4], 3, by_chars) == [1, 1, 1]
    assert chunk_token_counts(texts, [2, 1, 4], None, by_chars) == [3, 2, 4]
    # 2. final usage == number of text chunks: one token each (exact)
    assert chunk_token_counts(texts, [None] * 3, 3, by_chars) == [1, 1, 1]
    # 3. otherwise tokenize each chunk (at least 1), 4. else 1 per chunk
    assert chunk_token_counts(texts, [None] * 3, 9, by_chars) == [3, 2, 4]
    assert chunk_token_counts(["x", " "], [None] * 2, 5, lambda t: len(t.split())) == [1, 1]
    assert chunk_token_counts(texts, [None] * 3, 9, None) == [1, 1, 1]
    assert chunk_token_counts([], [], 0, by_chars) == []


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


OAI_PIECES = ["", "Hel", "lo", " you"]  # an empty first chunk, then 3 text chunks carrying 1, 2 and 1 tokens
OAI_CUMULATIVE = [0, 1, 3, 4]


async def oai_stream(request: web.Request) -> web.StreamResponse:
    """The model name picks how the stream reports its token counts: "m"/"strict": only a final usage (4 tokens
    in 3 text chunks); "continuous": usage in every chunk; "llama": llama-server's per-chunk `timings`;
    "one-per-chunk": a final usage of 3."""
    body = await request.json()
    chat, mode = "messages" in body, body["model"]
    assert body["max_tokens"] == 5 and body["stream_options"] == {"include_usage": True}
    # ignore_eos is an extension: sent only when wanted (strict OpenAI servers reject unknown fields)
    assert body.get("ignore_eos") is (None if mode == "strict" else True)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for p, so_far in zip(OAI_PIECES, OAI_CUMULATIVE, strict=True):
        choice = {"index": 0, "delta": {"content": p}} if chat else {"index": 0, "text": p}
        event = {"choices": [choice], "usage": None}
        if mode == "continuous":
            event["usage"] = {"prompt_tokens": 7, "completion_tokens": so_far, "total_tokens": 7 + so_far}
        elif mode == "llama":
            event["timings"] = {"predicted_n": so_far, "predicted_ms": 1.0}
        await resp.write(sse(event))
        await asyncio.sleep(GAP)
    total = 3 if mode == "one-per-chunk" else 4
    usage = {"prompt_tokens": 7, "completion_tokens": total, "total_tokens": 7 + total, "prompt_tokens_details":
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


def chars_halved(text: str) -> int:
    """A stand-in tokenizer for chunk texts: "Hel" -> 1, "lo" -> 1, " you" -> 2."""
    return len(text) // 2


@pytest.mark.parametrize("func,path", [(request_completions, "/v1/completions"),
                                       (request_chat, "/v1/chat/completions")])
@pytest.mark.parametrize("model,ignore_eos,count_tokens,per_chunk", [
    ("continuous", True, chars_halved, [1, 2, 1]),  # per-chunk usage: exact, the tokenizer not consulted
    ("llama", True, None, [1, 2, 1]),  # llama-server timings.predicted_n: exact
    ("one-per-chunk", True, chars_halved, [1, 1, 1]),  # final usage == text chunks: exact
    ("m", True, chars_halved, [1, 1, 2]),  # only a final usage of 4 over 3 chunks: the chunks tokenized
    ("strict", False, None, [1, 1, 1]),  # no tokenizer either: one token per chunk
])
def test_openai_stream_per_token_itl_and_usage(func, path, model, ignore_eos, count_tokens, per_chunk):
    out = with_server(lambda session, url: func(session, RequestInput("hi", 7, 5, url + path, model=model,
                                                                      ignore_eos=ignore_eos,
                                                                      count_tokens=count_tokens)))
    assert out.success, out.error
    assert out.generated_text == "Hello you"
    assert out.output_len == (3 if model == "one-per-chunk" else 4)  # from usage, not the requested 5
    assert out.cached_tokens == 2 and out.server_prompt_tokens == 7
    # per token: the first chunk's tokens make the TTFT; each later chunk's gap is split over its k tokens
    assert len(out.itl) == sum(per_chunk) - per_chunk[0]
    expected = [GAP / k for k in per_chunk[1:] for _ in range(k)]
    assert out.itl == pytest.approx(expected, rel=0.5)
    assert sum(out.itl) == pytest.approx(2 * GAP, rel=0.3)
    assert len(out.token_times) == out.output_len and out.token_times == sorted(out.token_times)


async def native_two_per_chunk(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for n in (2, 4, 6):
        await resp.write(sse({"text": "ab" * n, "meta_info": {"prompt_tokens": 4, "completion_tokens": n}}))
        await asyncio.sleep(GAP)
    await resp.write(sse(b"[DONE]"))
    return resp


async def oai_two_per_chunk(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for _ in range(3):
        await resp.write(sse({"choices": [{"index": 0, "text": "abab"}]}))
        await asyncio.sleep(GAP)
    await resp.write(sse({"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 6}}))
    await resp.write(sse(b"[DONE]"))
    return resp


def test_native_and_openai_measure_itl_alike():
    """The same stream (2 tokens per chunk, GAP apart) gives the same per-token ITL on both families."""
    async def main():
        app = web.Application()
        app.router.add_post("/generate", native_two_per_chunk)
        app.router.add_post("/v1/completions", oai_two_per_chunk)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        try:
            async with aiohttp.ClientSession() as session:
                native = await request_native(session, RequestInput("hi", 4, 6, url + "/generate"))
                oai = await request_completions(session, RequestInput("hi", 4, 6, url + "/v1/completions",
                                                                      count_tokens=lambda t: len(t) // 2))
                return native, oai
        finally:
            await runner.cleanup()

    native, oai = asyncio.run(main())
    assert native.success and oai.success, (native.error, oai.error)
    for out in (native, oai):
        assert out.output_len == 6 and len(out.itl) == 4 and len(out.token_times) == 6
        assert out.itl == pytest.approx([GAP / 2] * 4, rel=0.5)
    assert sum(oai.itl) == pytest.approx(sum(native.itl), rel=0.3)


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
