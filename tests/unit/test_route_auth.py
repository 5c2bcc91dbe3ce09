"""`--api-key` on a real app (`create_app`, every route and middleware; a stub engine behind it): every route
of `app.routes`, with every method it takes, answers 401 without the key, so a route added later cannot
escape the check; only /health and /metrics are open. With the key, routes answer as usual; the key is
compared with hmac.compare_digest; the body limit sits inside the key check (an unauthenticated body is never
read); the default host is loopback."""

from __future__ import annotations

import asyncio
import json
import re
from types import SimpleNamespace

import pytest

from tokenloom.entrypoints.http_server import OPEN_PATHS, create_app
from tokenloom.entrypoints.launch_server import parse_args
from tokenloom.frontend.tokenizer_manager import EngineDeadError

KEY = "k3y-for-tests"
AUTH = [(b"authorization", f"Bearer {KEY}".encode())]


class StubEngine:
    """What the routes read of a TokenizerManager before they generate anything."""

    source = SimpleNamespace(kind="gguf", path="/models/stub.gguf", tokenizer_dir="/models",
                             config=SimpleNamespace(architecture="LlamaForCausalLM"))
    context_len, vocab_size = 2048, 256
    scheduler_info: dict = {}
    processes: dict = {}
    dead_error = None

    async def get_internal_state(self) -> dict:
        raise EngineDeadError("a stub engine has no runtime")  # answered 503


def make_app(*flags: str):
    return create_app(StubEngine(), parse_args(["--api-key", KEY, "--enable-metrics", *flags]))  # type: ignore[arg-type]


def call(app, method: str, path: str, headers: list[tuple[bytes, bytes]] | None = None,
         body: bytes = b"") -> tuple[int, bytes]:
    sent: list[dict] = []
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict:
        if messages:
            return messages.pop(0)
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    all_headers = [(b"content-length", str(len(body)).encode()), *(headers or [])]
    scope = {"type": "http", "method": method, "path": path, "raw_path": path.encode(), "headers": all_headers,
             "query_string": b"", "scheme": "http", "server": ("127.0.0.1", 30000), "client": ("127.0.0.1", 5),
             "root_path": "", "http_version": "1.1", "asgi": {"version": "3.0", "spec_version": "2.4"}}
    asyncio.run(asyncio.wait_for(app(scope, receive, send), timeout=10))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def every_route_and_method(app) -> list[tuple[str, str]]:
    found = []
    for route in app.routes:
        path = re.sub(r"\{[^}]*\}", "x", route.path)  # a value for every path parameter
        found += [(method, path) for method in sorted(route.methods or ())]
    return found


def test_every_route_needs_the_key_but_health_and_metrics():
    app = make_app()
    routes = every_route_and_method(app)
    paths = {path for _, path in routes}
    assert {"/generate", "/v1/chat/completions", "/v1/completions", "/get_server_info", "/flush_cache",
            "/abort_request", "/openapi.json", "/docs"} <= paths  # the walk sees the app's routes, docs too
    open_paths = set()
    for method, path in routes:
        for headers in (None, [(b"authorization", b"Bearer wrong")], [(b"authorization", KEY.encode())]):
            status, body = call(app, method, path, headers)
            if status != 401:
                open_paths.add(path)
                continue
            if method != "HEAD":
                assert "Authorization: Bearer" in json.loads(body)["error"]["message"], (method, path)
    assert open_paths == set(OPEN_PATHS) == {"/health", "/metrics"}


@pytest.mark.parametrize("method, path, status", [
    ("GET", "/v1/models", 200), ("GET", "/v1/models/nope", 404), ("GET", "/get_model_info", 200),
    ("GET", "/docs", 200), ("POST", "/abort_request", 400), ("GET", "/health", 503),
])
def test_with_the_key_routes_answer_as_usual(method, path, status):
    code, body = call(make_app(), method, path, AUTH, b"{}" if method == "POST" else b"")
    assert code == status, body
    if path == "/v1/models":
        assert [m["id"] for m in json.loads(body)["data"]] == ["smollm2"]


def test_the_body_limit_sits_inside_the_key_check():
    app = make_app("--max-request-body-bytes", "64")
    big = json.dumps({"text": "x" * 100}).encode()
    assert call(app, "POST", "/generate", None, big)[0] == 401  # never read without the key
    status, body = call(app, "POST", "/generate", AUTH, big)
    assert status == 413 and "the limit is 64 bytes" in json.loads(body)["error"]["message"]


def test_the_key_is_compared_in_constant_time(monkeypatch):
    import hmac

    from tokenloom.entrypoints import http_server

    compared, original = [], hmac.compare_digest

    def recording_compare(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return original(a, b)

    monkeypatch.setattr(http_server.hmac, "compare_digest", recording_compare)
    app = make_app()
    assert call(app, "GET", "/v1/models", [(b"authorization", b"Bearer nope")])[0] == 401
    assert call(app, "GET", "/v1/models", AUTH)[0] == 200
    assert compared == [(b"Bearer nope", f"Bearer {KEY}".encode()), (f"Bearer {KEY}".encode(),) * 2]


def test_the_server_listens_on_loopback_by_default():
    assert parse_args([]).host == "127.0.0.1"
