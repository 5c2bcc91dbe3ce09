"""A server with --api-key, one running slot and a one-request queue: 401s without the key (but not on
/health and /metrics), 503 when the queue is full, and — last, since it ends the server — a scheduler
that dies makes pending requests fail and the server exit non-zero with the reason."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time

import aiohttp
import openai
import pytest

from tests.e2e.server_process import ServerProcess, http

KEY = "s3cret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
LONG = {"max_new_tokens": None, "ignore_eos": True}


@pytest.fixture(scope="module")
def guarded(tiny_runtime_model):
    # --context-length far beyond the model's 2048 positions: the long requests below must keep running.
    server = ServerProcess("--model-path", tiny_runtime_model, "--dtype", "float32", "--context-length", "16384",
                           "--max-total-tokens", "32768", "--max-running-requests", "1", "--max-queued-requests", "1",
                           "--num-threads", "1", "--api-key", KEY, "--enable-metrics").wait_healthy()
    server.metrics_when_healthy = http("GET", server.url + "/metrics")[1]
    server.info_when_healthy = server.server_info(AUTH)
    yield server
    server.stop()


ROUTES = [("GET", "/v1/models", None), ("GET", "/v1/models/x", None), ("GET", "/get_server_info", None),
          ("GET", "/server_info", None), ("GET", "/get_model_info", None), ("GET", "/health_generate", None),
          ("POST", "/flush_cache", None), ("POST", "/abort_request", {"rid": "x"}),
          ("POST", "/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 1}}),
          ("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 1}),
          ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1})]


@pytest.mark.parametrize("method, route, body", ROUTES, ids=[r[1] for r in ROUTES])
def test_api_key_required(guarded, method, route, body):
    status, out = http(method, guarded.url + route, body)
    assert status == 401 and "Authorization: Bearer" in out["error"]["message"]
    assert http(method, guarded.url + route, body, headers={"Authorization": "Bearer wrong"})[0] == 401
    assert http(method, guarded.url + route, body, headers={"Authorization": KEY})[0] == 401  # no scheme
    assert http(method, guarded.url + route, body, headers=AUTH)[0] != 401


def metric(text: str, name: str) -> float:
    return float(re.search(rf"^sglang:{name}{{[^}}]*}} (\S+)$", text, re.M).group(1))


def test_healthy_only_after_the_warm_up_generation(guarded):
    # The warm-up ("The capital city of France is", 6 tokens, max_new_tokens 8) had finished when /health
    # first answered 200: its 6 + 8 - 1 tokens with KV are in the prefix cache (a health check alone is a
    # 1-token prompt and at most 1 new token). Neither it nor the health checks count in /metrics.
    assert guarded.info_when_healthy["evictable_kv_tokens"] >= 13
    text = guarded.metrics_when_healthy
    assert metric(text, "num_requests_total") == 0 and metric(text, "num_aborted_requests_total") == 0
    assert metric(text, "prompt_tokens_total") == 0 and metric(text, "generation_tokens_total") == 0


def test_health_and_metrics_need_no_key(guarded):
    assert http("GET", guarded.url + "/health")[0] == 200
    status, text = http("GET", guarded.url + "/metrics")
    assert status == 200 and "sglang:num_running_reqs" in text


def test_openai_client_with_and_without_key(guarded):
    with openai.OpenAI(base_url=guarded.url + "/v1", api_key="nope", max_retries=0) as bad, \
            pytest.raises(openai.AuthenticationError):
        bad.models.list()
    with openai.OpenAI(base_url=guarded.url + "/v1", api_key=KEY, max_retries=0) as good:
        out = good.completions.create(model="any", prompt="Hi", max_tokens=2, temperature=0)
        assert out.usage.completion_tokens == 2


async def _first_event(resp: aiohttp.ClientResponse) -> dict:
    async for line in resp.content:
        if line.startswith(b"data: "):
            return json.loads(line[6:])
    raise AssertionError("stream ended without events")


async def _wait_info(session: aiohttp.ClientSession, url: str, key: str, value: int) -> None:
    for _ in range(600):
        async with session.get(url + "/get_server_info", headers=AUTH) as resp:
            if (await resp.json())[key] == value:
                return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{key} never reached {value}")


def test_full_queue_answers_503(guarded):
    async def scenario():
        async with aiohttp.ClientSession(headers=AUTH) as s:
            running = await s.post(guarded.url + "/generate", json={"text": "A", "sampling_params": LONG,
                                                                    "stream": True})
            await _first_event(running)  # holds the only running slot
            waiting = await s.post(guarded.url + "/generate", json={"text": "B", "sampling_params": LONG,
                                                                    "stream": True})
            await _wait_info(s, guarded.url, "num_waiting_reqs", 1)  # fills the queue
            results = []
            for route, body in (("/generate", {"text": "C"}), ("/v1/completions", {"prompt": "C"})):
                async with s.post(guarded.url + route, json=body) as resp:
                    results.append((resp.status, await resp.json()))
            for route, body in (("/generate", {"text": "C", "stream": True}),
                                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "C"}],
                                                          "stream": True})):
                async with s.post(guarded.url + route, json=body) as resp:  # refused: an error status, no stream
                    results.append((resp.status, await resp.json()))
            assert waiting.status == 200  # queued: its stream started before its first token
            running.close()
            waiting.close()
            return results

    native, oai, native_stream, chat_stream = asyncio.run(scenario())
    assert native == native_stream == (503, {"error": {"message": "The request queue is full."}})
    for status, out in (oai, chat_stream):
        assert status == 503 and out["message"] == "The request queue is full." and out["code"] == 503
    guarded.wait_idle_and_pool_full(headers=AUTH)
    status, out = http("POST", guarded.url + "/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 2}},
                       headers=AUTH)
    assert status == 200 and out["meta_info"]["completion_tokens"] == 2


def test_zz_scheduler_death_fails_requests_and_exits_nonzero(guarded):
    """Runs last in this module: it ends the server."""
    scheduler = guarded.server_info(AUTH)["process_ids"]["scheduler"]

    async def scenario():
        async with aiohttp.ClientSession(headers=AUTH) as s:
            pending = asyncio.ensure_future(s.post(guarded.url + "/generate",
                                                   json={"text": "A", "sampling_params": LONG}))
            await _wait_info(s, guarded.url, "num_running_reqs", 1)
            os.kill(scheduler, signal.SIGKILL)
            resp = await asyncio.wait_for(pending, timeout=30)
            return resp.status, await resp.json()

    start = time.monotonic()
    status, body = asyncio.run(scenario())
    assert status == 503 and "scheduler process died" in body["error"]["message"]
    code = guarded.wait_exit(timeout=60)
    assert code == 1
    assert "error: the scheduler process died" in guarded.logs()
    assert time.monotonic() - start < 30
    assert not guarded.children()
