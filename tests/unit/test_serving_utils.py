"""Pure pieces of the HTTP layer: body reading, error shapes, stream merging, disconnect handling, usage
and finish-reason translation, batch helpers of the TokenizerManager."""

from __future__ import annotations

import asyncio
import json
import math

import pytest
from starlette.requests import Request

from tokenloom.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from tokenloom.entrypoints.openai.serving_base import finish_reason_of, usage_of
from tokenloom.entrypoints.serving_utils import (
    BadRequestBody,
    ClientDisconnected,
    abort_error,
    cancel_on_disconnect,
    format_validation_errors,
    gather_or_cancel,
    merge_streams,
    read_json_body,
    sse,
)
from tokenloom.frontend.batch_fields import batch_rids, common_n
from tokenloom.frontend.logprob_accumulator import LOGPROB_FLOOR
from tokenloom.frontend.logprob_accumulator import triple as _triple


def make_request(body: bytes, content_type: str | None, disconnect_after: float | None = None) -> Request:
    headers = [(b"content-type", content_type.encode())] if content_type else []
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive():
        if messages:
            return messages.pop(0)
        if disconnect_after is None:
            await asyncio.Event().wait()  # never
        await asyncio.sleep(disconnect_after)
        return {"type": "http.disconnect"}

    return Request({"type": "http", "method": "POST", "path": "/", "headers": headers, "query_string": b""},
                   receive)


# --- bodies ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("body, ctype, strict, expected", [
    (b'{"a": 1}', "application/json", True, {"a": 1}),
    (b'{"a": 1}', "application/json; charset=utf-8", True, {"a": 1}),
    (b'{"a": 1}', None, False, {"a": 1}),
    (b'{"a": 1}', "application/x-www-form-urlencoded", False, {"a": 1}),
    (b"[1]", "application/vnd.api+json", True, [1]),
])
def test_read_json_body_accepts(body, ctype, strict, expected):
    assert asyncio.run(read_json_body(make_request(body, ctype), strict)) == expected


@pytest.mark.parametrize("body, ctype, strict, fragment", [
    (b'{"a": 1}', "text/plain", True, "Unsupported Media Type: Only 'application/json' is allowed (got text/plain)"),
    (b'{"a": 1}', None, True, "got no Content-Type"),
    (b'{"a": ', "application/json", False, "Malformed JSON body"),
    (b"\xff\xfe", "application/json", False, "Malformed JSON body"),
    (b"  ", "application/json", False, "request body is empty"),
])
def test_read_json_body_rejects(body, ctype, strict, fragment):
    with pytest.raises(BadRequestBody, match=None) as err:
        asyncio.run(read_json_body(make_request(body, ctype), strict))
    assert fragment in err.value.message


def test_format_validation_errors_names_fields():
    errors = [{"loc": ("body", "messages"), "msg": "Field required"}, {"loc": ("n",), "msg": "bad"}, {"msg": "x"}]
    assert format_validation_errors(errors) == "messages: Field required; n: bad; x"
    assert format_validation_errors([]) == "Invalid request body."


def test_abort_error_only_for_aborts_with_status():
    def out(finish):
        return {"meta_info": {"finish_reason": finish}}

    assert abort_error(out({"type": "abort", "message": "full", "status_code": 503})) == (503, "full")
    assert abort_error(out({"type": "abort", "message": "Aborted by the client."})) is None
    assert abort_error(out({"type": "length", "length": 3})) is None
    assert abort_error(out(None)) is None


def test_sse_frames_json():
    assert sse({"text": "é"}) == 'data: {"text":"é"}\n\n'
    assert json.loads(sse([1])[len("data: "):]) == [1]
    # integer keys as strings (as the stdlib writes them); what orjson refuses falls back to the stdlib encoder
    assert json.loads(sse({1: [2**70, -0.5]})[len("data: "):-2]) == {"1": [2**70, -0.5]}
    assert json.loads(sse({"ids": list(range(300)), "t": "x" * 5000})[len("data: "):-2])["ids"][-1] == 299


# --- streams and tasks -------------------------------------------------------------------------------
def test_merge_streams_interleaves_and_closes_sources_early():
    closed = []

    async def source(name, delays):
        try:
            for i, d in enumerate(delays):
                await asyncio.sleep(d)
                yield f"{name}{i}"
        finally:
            closed.append(name)

    async def scenario():
        merged = merge_streams([source("a", [0.0, 0.03, 0.03]), source("b", [0.01, 0.01, 1.0])])
        got = []
        async for i, item in merged:
            got.append((i, item))
            if len(got) == 4:
                break
        await merged.aclose()
        return got

    got = asyncio.run(scenario())
    assert got == [(0, "a0"), (1, "b0"), (1, "b1"), (0, "a1")]
    assert sorted(closed) == ["a", "b"]


def test_merge_streams_single_and_error():
    async def ok():
        yield 1
        yield 2

    async def bad():
        yield 1
        raise ValueError("boom")

    async def collect(gens):
        return [x async for x in merge_streams(gens)]

    assert asyncio.run(collect([ok()])) == [(0, 1), (0, 2)]
    with pytest.raises(ValueError, match="boom"):
        asyncio.run(collect([ok(), bad()]))


def test_gather_or_cancel_cancels_the_rest_on_failure():
    cancelled = []

    async def slow():
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def fail():
        await asyncio.sleep(0.01)
        raise RuntimeError("x")

    async def scenario():
        with pytest.raises(RuntimeError):
            await gather_or_cancel([slow(), fail()])
        await asyncio.sleep(0.01)

    asyncio.run(scenario())
    assert cancelled == [True]
    assert asyncio.run(gather_or_cancel([asyncio.sleep(0, result=1), asyncio.sleep(0, result=2)])) == [1, 2]


def test_cancel_on_disconnect():
    cancelled = []

    async def work(seconds):
        try:
            await asyncio.sleep(seconds)
            return "done"
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def scenario(seconds, disconnect_after):
        request = make_request(b"{}", "application/json", disconnect_after)
        await request.body()
        return await cancel_on_disconnect(request, work(seconds))

    assert asyncio.run(scenario(0.01, None)) == "done"
    with pytest.raises(ClientDisconnected):
        asyncio.run(scenario(10, 0.02))
    assert cancelled == [True]


# --- OpenAI translation ------------------------------------------------------------------------------
def test_usage_counts_each_prompt_once():
    outs = [{"meta_info": {"prompt_tokens": p, "completion_tokens": c}} for p, c in [(5, 1), (5, 2), (7, 3), (7, 4)]]
    usage = usage_of(enumerate(outs), n=2)
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (12, 10, 22)
    assert usage_of(enumerate(outs[:1]), n=1).total_tokens == 6
    assert usage_of([(3, outs[3])], n=2).prompt_tokens == 7


def test_finish_reason_of():
    assert finish_reason_of(None) == (None, None)
    assert finish_reason_of({"type": "length", "length": 4}) == ("length", None)
    assert finish_reason_of({"type": "stop", "matched": 2}) == ("stop", 2)
    assert finish_reason_of({"type": "stop", "matched": "\n"}) == ("stop", "\n")
    assert finish_reason_of({"type": "abort", "message": "x"}) == ("abort", None)


def test_openai_request_schemas():
    for prompt in ("hi", ["a", "b"], [1, 2], [[1], [2, 3]]):
        assert CompletionRequest(prompt=prompt).prompt == prompt
    req = CompletionRequest(prompt="hi", some_future_field=1)  # unknown fields are ignored
    assert req.max_tokens == 16 and req.n == 1 and req.logprobs is None
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": [{"type": "text", "text": "x"}]}])
    assert chat.messages[0].content[0].text == "x" and chat.max_completion_tokens is None


# --- TokenizerManager helpers ------------------------------------------------------------------------
def testbatch_rids():
    assert batch_rids(None, 2, True) == [None, None]
    assert batch_rids("a", 1, False) == ["a"]
    assert batch_rids(["a", "b"], 2, True) == ["a", "b"]
    with pytest.raises(ValueError, match="one id per prompt"):
        batch_rids(["a"], 2, True)
    with pytest.raises(ValueError, match="must be a string for a single prompt"):
        batch_rids(["a"], 1, False)
    with pytest.raises(ValueError, match="non-empty string"):
        batch_rids([""], 1, True)


def testcommon_n():
    assert common_n([{}, {"n": 1}]) == 1
    assert common_n([{"n": 3}, {"n": 3}]) == 3
    with pytest.raises(ValueError, match="same n; got n values \\[1, 2\\]"):
        common_n([{"n": 1}, {"n": 2}])
    for bad in (0, -1, True, "2", 1.5):
        with pytest.raises(ValueError, match="n must be a positive integer"):
            common_n([{"n": bad}])


def test_logprob_triples_stay_json_safe():
    assert _triple(-0.5, 7) == [-0.5, 7, None]
    assert _triple(-math.inf, 3) == [LOGPROB_FLOOR, 3, None]
    assert _triple(math.nan, 3)[0] == LOGPROB_FLOOR
