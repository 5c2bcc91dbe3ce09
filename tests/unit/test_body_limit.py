"""`BodyLimitMiddleware` driven at the ASGI level: a declared length over --max-request-body-bytes is answered
413 before any of the body is read; a chunked body is counted and refused as soon as it passes the limit;
bodies at or under it reach the app whole, and later receives (the disconnect) still come from the client."""

from __future__ import annotations

import asyncio
import json

import pytest

from tokenloom.config import ConfigError, ServerArgs
from tokenloom.entrypoints.body_limit import BodyLimitMiddleware

LIMIT = 100


def scope(headers: list[tuple[bytes, bytes]]) -> dict:
    return {"type": "http", "method": "POST", "path": "/generate", "headers": headers, "query_string": b"",
            "asgi": {"spec_version": "2.4"}}


class Client:
    """The connection's side: the body in `chunks`, then a disconnect; counts what the server read."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
                         for i, c in enumerate(chunks)] + [{"type": "http.disconnect"}]
        self.read = 0
        self.sent: list[dict] = []

    async def receive(self) -> dict:
        self.read += 1
        return self.messages[min(self.read, len(self.messages)) - 1]

    async def send(self, message: dict) -> None:
        self.sent.append(message)


class EchoApp:
    """Reads the whole body, answers 200 with its length, then records the next message it receives."""

    def __init__(self) -> None:
        self.calls = 0
        self.after_body: dict | None = None

    async def __call__(self, sc, receive, send) -> None:
        self.calls += 1
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        self.after_body = await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": str(len(body)).encode()})


def run(chunks: list[bytes], declared: int | None) -> tuple[Client, EchoApp]:
    headers = [(b"content-type", b"application/json")]
    if declared is not None:
        headers.append((b"content-length", str(declared).encode()))
    client, app = Client(chunks), EchoApp()
    asyncio.run(BodyLimitMiddleware(app, LIMIT)(scope(headers), client.receive, client.send))
    return client, app


def status_and_body(client: Client) -> tuple[int, bytes]:
    return client.sent[0]["status"], b"".join(m.get("body", b"") for m in client.sent[1:])


def assert_refused(client: Client, app: EchoApp, size: str) -> None:
    status, body = status_and_body(client)
    assert status == 413 and app.calls == 0
    error = json.loads(body)["error"]
    assert error["code"] == 413 and error["type"] == "invalid_request_error"
    assert error["message"] == f"Request body too large: {size}; the limit is {LIMIT} bytes (--max-request-body-bytes)."


@pytest.mark.parametrize("size", [0, 1, LIMIT - 1, LIMIT])
def test_declared_length_within_the_limit_reaches_the_app(size):
    client, app = run([b"x" * size], declared=size)
    assert status_and_body(client) == (200, str(size).encode()) and app.calls == 1
    assert app.after_body == {"type": "http.disconnect"}


@pytest.mark.parametrize("size", [LIMIT + 1, 10 * LIMIT, 2**40])
def test_declared_length_over_the_limit_is_refused_unread(size):
    client, app = run([b"x" * min(size, 2 * LIMIT)], declared=size)
    assert_refused(client, app, f"{size} bytes")
    assert client.read == 0  # not one byte of the body was read


@pytest.mark.parametrize("chunks", [[b""], [b"a" * 10, b"b" * 20, b"c" * 70], [b"x"] * LIMIT, [b"", b"y" * LIMIT]])
def test_chunked_body_within_the_limit_reaches_the_app_whole(chunks):
    client, app = run(chunks, declared=None)
    size = sum(len(c) for c in chunks)
    assert status_and_body(client) == (200, str(size).encode()) and app.calls == 1
    assert app.after_body == {"type": "http.disconnect"}  # later receives go to the connection


@pytest.mark.parametrize("chunks, read", [
    ([b"x" * (LIMIT + 1)], 1),
    ([b"a" * 60, b"b" * 41, b"c" * 1000, b"d"], 2),  # refused at the chunk that passes the limit
    ([b"x"] * (LIMIT + 50), LIMIT + 1),
])
def test_chunked_body_over_the_limit_is_refused_as_soon_as_it_passes(chunks, read):
    client, app = run(chunks, declared=None)
    assert_refused(client, app, f"more than {LIMIT} bytes")
    assert client.read == read


def test_a_client_gone_while_its_chunked_body_is_read_is_dropped():
    client = Client([b"a" * 10])
    client.messages = [{"type": "http.request", "body": b"a", "more_body": True}, {"type": "http.disconnect"}]
    app = EchoApp()
    asyncio.run(BodyLimitMiddleware(app, LIMIT)(scope([]), client.receive, client.send))
    assert app.calls == 0 and client.sent == []


def test_other_scopes_pass_through():
    seen = []

    async def app(sc, receive, send):
        seen.append(sc["type"])

    asyncio.run(BodyLimitMiddleware(app, LIMIT)({"type": "lifespan"}, None, None))
    assert seen == ["lifespan"]


def test_the_flag():
    assert ServerArgs().max_request_body_bytes == 32 * 2**20
    assert ServerArgs(max_request_body_bytes=1).max_request_body_bytes == 1
    for bad in (0, -5):
        with pytest.raises(ConfigError, match="--max-request-body-bytes must be >= 1"):
            ServerArgs(max_request_body_bytes=bad)
    with pytest.raises(ValueError, match="--max-request-body-bytes"):
        BodyLimitMiddleware(EchoApp(), 0)
