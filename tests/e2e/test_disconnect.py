"""A client that goes away (mid-stream, or while waiting for a non-streaming answer) gets its request
aborted: /metrics counts the abort and /get_server_info shows the KV pool back to full."""

from __future__ import annotations

import asyncio
import contextlib
import re

import aiohttp
import pytest

from tests.e2e.server_process import http

LONG = {"max_new_tokens": None, "ignore_eos": True}  # until the 8192-token context limit: far longer than we wait


def aborted_total(url: str) -> float:
    status, text = http("GET", url + "/metrics")
    assert status == 200
    return float(re.search(r"^sglang:num_aborted_requests_total\{[^}]*\} (\S+)$", text, re.M).group(1))


async def read_then_close(url: str, route: str, body: dict, events: int) -> int:
    """Read `events` SSE events, then drop the connection; returns how many were read."""
    seen = 0
    async with aiohttp.ClientSession() as session:
        resp = await session.post(url + route, json=body)
        assert resp.status == 200
        async for line in resp.content:
            if line.startswith(b"data: "):
                seen += 1
                if seen == events:
                    break
        resp.close()
    return seen


async def post_with_timeout(url: str, route: str, body: dict, seconds: float) -> None:
    async with aiohttp.ClientSession() as session:
        with contextlib.suppress(asyncio.TimeoutError):
            async with session.post(url + route, json=body, timeout=aiohttp.ClientTimeout(total=seconds)) as resp:
                raise AssertionError(f"the request finished instead of timing out: {resp.status}")


@pytest.mark.parametrize("route, body, expected_aborts", [
    ("/generate", {"text": "Tell me a story", "sampling_params": LONG, "stream": True}, 1),
    ("/generate", {"text": ["One", "Two", "Three"], "sampling_params": LONG, "stream": True}, 3),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "stream": True,
                              "ignore_eos": True}, 1),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 8000, "stream": True, "ignore_eos": True}, 1),
], ids=["generate", "generate_batch", "chat", "completions"])
def test_disconnect_mid_stream_aborts_and_frees_kv(tiny_server, route, body, expected_aborts):
    before = aborted_total(tiny_server.url)
    assert asyncio.run(read_then_close(tiny_server.url, route, body, events=4)) == 4
    tiny_server.wait_idle_and_pool_full()
    assert aborted_total(tiny_server.url) - before == expected_aborts
    assert http("POST", tiny_server.url + "/generate", {"text": "ok", "sampling_params": {"max_new_tokens": 1}})[0] \
        == 200


@pytest.mark.parametrize("route, body", [
    ("/generate", {"text": "Tell me a story", "sampling_params": LONG}),
    ("/v1/completions", {"prompt": "Tell me a story", "max_tokens": 8000, "ignore_eos": True}),
], ids=["generate", "completions"])
def test_disconnect_while_waiting_non_stream_aborts(tiny_server, route, body):
    before = aborted_total(tiny_server.url)
    asyncio.run(post_with_timeout(tiny_server.url, route, body, seconds=1.0))
    tiny_server.wait_idle_and_pool_full()
    assert aborted_total(tiny_server.url) - before == 1
