"""ASGI-level pieces driven directly (no server): the API-key middleware, the disconnect-aware SSE
response, and the launch command's argument parsing."""

from __future__ import annotations

import asyncio
import json

import pytest

from tokenloom.entrypoints.http_server import ApiKeyMiddleware, public_server_args, served_model_name
from tokenloom.entrypoints.launch_server import parse_args
from tokenloom.entrypoints.serving_utils import DisconnectAwareStream


def scope(path: str, headers: list[tuple[bytes, bytes]] | None = None) -> dict:
    return {"type": "http", "method": "GET", "path": path, "headers": headers or [], "query_string": b"",
            "asgi": {"spec_version": "2.4"}}


async def call(app, sc, receive=None) -> list[dict]:
    sent = []

    async def default_receive():
        await asyncio.sleep(10)
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    await app(sc, receive or default_receive, send)
    return sent


async def inner_app(sc, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.mark.parametrize("path, auth, status", [
    ("/generate", None, 401),
    ("/generate", b"Bearer wrong", 401),
    ("/generate", b"key", 401),
    ("/generate", b"Bearer key", 200),
    ("/v1/models", b"bearer key", 401),
    ("/health", None, 200),
    ("/metrics", None, 200),
    ("/health_generate", None, 401),
])
def test_api_key_middleware(path, auth, status):
    app = ApiKeyMiddleware(inner_app, "key")
    headers = [(b"authorization", auth)] if auth else []
    sent = asyncio.run(call(app, scope(path, headers)))
    assert sent[0]["status"] == status
    if status == 401:
        assert "Authorization: Bearer" in json.loads(sent[1]["body"])["error"]["message"]


def test_disconnect_aware_stream_closes_its_body_on_disconnect():
    closed = []

    async def body():
        try:
            yield "data: 1\n\n"
            await asyncio.sleep(10)  # e.g. a queued request: no chunk is due for a long time
            yield "data: 2\n\n"
        finally:
            closed.append(True)

    async def receive():
        await asyncio.sleep(0.05)
        return {"type": "http.disconnect"}

    async def scenario():
        return await asyncio.wait_for(call(DisconnectAwareStream(body()), scope("/"), receive), timeout=5)

    sent = asyncio.run(scenario())
    assert closed == [True]
    assert [m.get("body") for m in sent if m["type"] == "http.response.body"] == [b"data: 1\n\n"]
    assert dict(sent[0]["headers"])[b"content-type"].startswith(b"text/event-stream")


def test_disconnect_aware_stream_completes_normally():
    async def body():
        yield "data: a\n\n"
        yield "data: [DONE]\n\n"

    sent = asyncio.run(call(DisconnectAwareStream(body()), scope("/")))
    bodies = [m["body"] for m in sent if m["type"] == "http.response.body"]
    assert bodies == [b"data: a\n\n", b"data: [DONE]\n\n", b""]


def test_parse_args_usage_errors(capsys):
    args = parse_args(["--port", "8000", "--api-key", "k", "--host", "0.0.0.0", "--enable-metrics"])
    assert (args.port, args.api_key, args.host, args.enable_metrics) == (8000, "k", "0.0.0.0", True)
    assert parse_args([]).port == 30000 and parse_args([]).host == "127.0.0.1"
    for bad in (["--port", "0"], ["--nope"], ["--page-size", "0"]):
        with pytest.raises(SystemExit) as err:
            parse_args(bad)
        assert err.value.code == 2
    assert "usage: tokenloom serve" in capsys.readouterr().err


def test_served_model_name_and_redacted_key():
    assert served_model_name(parse_args([])) == "smollm2"
    assert served_model_name(parse_args(["--model-path", "/m"])) == "/m"
    assert served_model_name(parse_args(["--model-path", "/m", "--served-model-name", "x"])) == "x"
    assert public_server_args(parse_args(["--api-key", "secret"]))["api_key"] == "<redacted>"
    assert public_server_args(parse_args([]))["api_key"] is None
