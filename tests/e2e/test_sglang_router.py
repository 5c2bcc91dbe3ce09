"""SGLang's router (the `sglang-router` wheel, a test dependency) in front of two tokenloom servers on the tiny
model: it registers both (GET /health, /server_info, /model_info), and the native /generate (single, batch,
stream) and OpenAI routes it forwards, with the fields it adds, are served and answer as the same request sent
straight to a worker does (greedy); round-robin routing sends requests to both. Its load and flush fan-outs
read tokenloom's /get_load and /flush_cache. The bodies of SGLang's bench_serving and vLLM's benchmark client
pass through it too.

Noted from sglang-router 0.3.2: its /generate schema takes `text` and `rid` as one string (a batch goes as
lists of input_ids) and one sampling_params object; its /v1/completions takes only text prompts; it answers
/v1/models itself from the workers' metadata.
"""

from __future__ import annotations

import importlib.util
import json
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
from collections.abc import Iterator
from typing import Any

import pytest

from tests.client_payloads import (
    SGLANG_BENCH_CHAT,
    SGLANG_BENCH_COMPLETIONS,
    SGLANG_BENCH_GENERATE,
    VLLM_BENCH_CHAT,
    VLLM_BENCH_COMPLETIONS,
)
from tests.e2e.conftest import TINY_FLAGS
from tests.e2e.server_process import REPO, ServerProcess, free_port, http

if importlib.util.find_spec("sglang_router") is None:
    pytest.skip("sglang-router is not installed (a test extra: pip install -e '.[test]'; it ships binary wheels "
                "only, so a platform without one cannot run this test)", allow_module_level=True)

ROUTER_READY_TIMEOUT_S = 120
REQUEST_TIMEOUT_S = 120
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
PROMPT = "The capital city of France is"


class RouterProcess:
    """`python -m sglang_router.launch_router` on free ports (its own and its Prometheus exporter's)."""

    def __init__(self, worker_urls: list[str], policy: str = "round_robin") -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - lives as long as the router
            "w+", prefix="sglang-router-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *worker_urls,
               "--host", "127.0.0.1", "--port", str(self.port), "--policy", policy,
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
               "--worker-startup-check-interval", "1", "--shutdown-grace-period-secs", "5",
               "--disable-retries", "--log-level", "warn"]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT)

    def logs(self) -> str:
        with open(self.log.name) as f:
            return f.read()

    def wait_ready(self, workers: int, timeout: float = ROUTER_READY_TIMEOUT_S) -> RouterProcess:
        """Until /readiness counts `workers` healthy workers (its /health is 200 before any registers)."""
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited with {self.proc.returncode}:\n{self.logs()}")
            try:
                status, last = http("GET", self.url + "/readiness", timeout=10)
                if status == 200 and isinstance(last, dict) and last.get("healthy_workers") == workers:
                    return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        raise TimeoutError(f"router not ready after {timeout} s (last /readiness: {last}):\n{self.logs()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def cluster(tiny_runtime_model) -> Iterator[tuple[RouterProcess, list[ServerProcess]]]:
    workers: list[ServerProcess] = []
    router = None
    try:
        workers = [ServerProcess("--model-path", tiny_runtime_model, *TINY_FLAGS) for _ in range(2)]
        for w in workers:
            w.wait_healthy()
        router = RouterProcess([w.url for w in workers]).wait_ready(len(workers))
        yield router, workers
    finally:
        if router is not None:
            router.stop()
        for w in workers:
            code = w.stop(signal.SIGTERM)
            assert code in (0, -signal.SIGTERM), f"worker exit status {code}:\n{w.logs()}"
            assert "Traceback" not in w.logs(), w.logs()


def post(url: str, body: dict[str, Any]) -> Any:
    status, out = http("POST", url, body, timeout=REQUEST_TIMEOUT_S)
    assert status == 200, out
    return out


def sse_events(text: str) -> list[Any]:
    assert isinstance(text, str), text
    events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", text
    return [json.loads(e) for e in events[:-1]]


def text_of(out: dict[str, Any]) -> str:
    choice = out["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def delta_of(chunk: dict[str, Any]) -> str:
    choice = chunk["choices"][0]
    return choice["delta"].get("content") or "" if "delta" in choice else choice["text"]


def requests_served(worker: ServerProcess) -> float:
    status, text = http("GET", worker.url + "/metrics")
    assert status == 200, text
    match = re.search(r"^sglang:num_requests_total\{[^}]*\} ([0-9.e+]+)$", text, re.MULTILINE)
    assert match, text
    return float(match.group(1))


def test_router_registered_both_workers(cluster):
    router, workers = cluster
    status, listing = http("GET", router.url + "/workers")
    assert status == 200 and sorted(w["url"] for w in listing["workers"]) == sorted(w.url for w in workers)
    assert all(w["is_healthy"] for w in listing["workers"])
    status, models = http("GET", router.url + "/v1/models")  # answered by the router from worker metadata
    served = http("GET", workers[0].url + "/v1/models")[1]["data"][0]["id"]
    assert status == 200 and [m["id"] for m in models["data"]] == [served]
    status, info = http("GET", router.url + "/get_model_info")  # forwarded to a worker
    assert status == 200 and info["model_path"] == served


def test_generate_single_matches_a_worker(cluster):
    router, workers = cluster
    body = {"text": PROMPT, "sampling_params": GREEDY}
    via_router = post(router.url + "/generate", body)
    direct = post(workers[0].url + "/generate", body)
    assert via_router["output_ids"] == direct["output_ids"] and via_router["text"] == direct["text"]
    assert via_router["meta_info"]["completion_tokens"] == 8


def test_generate_batch_matches_a_worker(cluster):
    router, workers = cluster
    body = {"input_ids": [[1, 2, 3, 4], [5, 6, 7]], "sampling_params": GREEDY}
    via_router = post(router.url + "/generate", {**body, "rid": "batch"})  # the router takes one string rid
    direct = post(workers[1].url + "/generate", body)
    assert isinstance(via_router, list) and len(via_router) == 2
    assert [o["output_ids"] for o in via_router] == [o["output_ids"] for o in direct]
    assert [o["meta_info"]["id"] for o in via_router] == ["batch_0", "batch_1"]  # SGLang's naming


def test_generate_stream_matches_a_worker(cluster):
    router, workers = cluster
    body = {"text": PROMPT, "sampling_params": GREEDY}
    status, text = http("POST", router.url + "/generate", {**body, "stream": True}, timeout=REQUEST_TIMEOUT_S)
    assert status == 200, text
    events = sse_events(text)
    direct = post(workers[0].url + "/generate", body)
    assert len(events) > 1 and events[-1]["text"] == direct["text"] and events[-1]["output_ids"] == direct["output_ids"]
    assert events[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 8}


def test_openai_routes_match_a_worker(cluster):
    router, workers = cluster
    model = http("GET", workers[0].url + "/v1/models")[1]["data"][0]["id"]
    completion = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    chat = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8, "temperature": 0,
            "ignore_eos": True}
    for route, body in (("/v1/completions", completion), ("/v1/chat/completions", chat)):
        via_router = post(router.url + route, body)
        direct = post(workers[1].url + route, body)
        assert text_of(via_router) == text_of(direct) and via_router["usage"] == direct["usage"], route
        status, text = http("POST", router.url + route, {**body, "stream": True,
                                                         "stream_options": {"include_usage": True}},
                            timeout=REQUEST_TIMEOUT_S)
        assert status == 200, text
        chunks = sse_events(text)
        assert "".join(delta_of(c) for c in chunks if c["choices"]) == text_of(direct), route
        assert chunks[-1]["usage"] == direct["usage"], route


def test_round_robin_uses_both_workers(cluster):
    router, workers = cluster
    before = [requests_served(w) for w in workers]
    for i in range(4):
        post(router.url + "/generate", {"text": f"{PROMPT} {i}", "sampling_params": GREEDY})
    after = [requests_served(w) for w in workers]
    # round robin gives each two of the four (the router's periodic health checks are not counted)
    assert all(a - b == 2 for a, b in zip(after, before, strict=True)), (before, after)


def test_router_reads_worker_loads_and_flushes(cluster):
    router, workers = cluster
    status, loads = http("GET", router.url + "/get_loads")  # the router polls each worker's /get_load
    assert status == 200, loads
    assert sorted(entry["worker"] for entry in loads["workers"]) == sorted(w.url for w in workers)
    assert all(entry["load"] >= 0 for entry in loads["workers"]), loads  # -1: the router could not read it
    for w in workers:
        w.wait_idle_and_pool_full()
    status, text = http("POST", router.url + "/flush_cache")
    assert status == 200 and "all 2 HTTP workers" in json.dumps(text), text
    for w in workers:
        assert w.server_info()["evictable_kv_tokens"] == 0


# the router's completions schema takes only text prompts, so vLLM's token-id prompt stays out
CLIENT_BODIES = ([("/generate", b) for b in SGLANG_BENCH_GENERATE]
                 + [("/v1/completions", b) for b in SGLANG_BENCH_COMPLETIONS + VLLM_BENCH_COMPLETIONS
                    if isinstance(b["prompt"], str)]
                 + [("/v1/chat/completions", b) for b in SGLANG_BENCH_CHAT + VLLM_BENCH_CHAT])


@pytest.mark.parametrize("route, body", CLIENT_BODIES, ids=[f"{r}-{i}" for i, (r, _) in enumerate(CLIENT_BODIES)])
def test_benchmark_clients_through_the_router(cluster, route, body):
    router, workers = cluster
    if "model" in body:  # the router routes by model id
        body = {**body, "model": http("GET", workers[0].url + "/v1/models")[1]["data"][0]["id"]}
    status, out = http("POST", router.url + route, body, timeout=REQUEST_TIMEOUT_S)
    assert status == 200, out
    if body.get("stream"):
        assert sse_events(out), out
    else:
        assert (out["meta_info"]["completion_tokens"] if route == "/generate" else
                out["usage"]["completion_tokens"]) == 4, out
