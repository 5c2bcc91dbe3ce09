"""Prefill/decode disaggregation end to end: a tokenloom prefill server and a tokenloom decode server behind
SGLang's own router (`sglang_router.launch_router --pd-disaggregation`), real processes, a real transfer
engine. Greedy answers through the router equal the unified server's (tiny fp32 model, chunked prefill at 64
tokens so long prompts stream their KV in chunks), for /generate (batch, logprobs with prompt logprobs,
streaming) and the OpenAI chat route; both servers' pools are full afterwards."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import openai
import pytest

from tests.e2e.conftest import TINY_FLAGS
from tests.e2e.server_process import REPO, ServerProcess, free_port, http

PROMPTS = ["The capital city of France is", "1, 2, 3, 4, 5,", "Once upon a time " * 12, "def fibonacci(n):"]
GREEDY = {"sampling_params": {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}}


class Router:
    """SGLang's router in PD mode in front of one prefill and one decode server."""

    def __init__(self, prefill: ServerProcess, bootstrap_port: int, decode: ServerProcess, mini_lb: bool = False,
                 extra: tuple[str, ...] = ()) -> None:
        """`mini_lb`: the router's Python load balancer (`--mini-lb`), which also takes /generate batches;
        `extra`: more router flags."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="sglang-router-", suffix=".log", delete=False)  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation", "--host", "127.0.0.1",
             "--port", str(self.port), "--prefill", prefill.url, str(bootstrap_port), "--decode", decode.url,
             "--policy", "random" if mini_lb else "round_robin", "--prometheus-port", str(free_port()),
             *(["--mini-lb"] if mini_lb else []), *extra],
            cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 60) -> Router:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise AssertionError(f"the router exited: {self.log.read()[-3000:]}")
            try:
                if http("POST", self.url + "/generate", {"text": "hi", **GREEDY}, timeout=30)[0] == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.3)
        raise TimeoutError("the router did not serve a request")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def start_pair(model: str, backend: str, *extra: str) -> tuple[ServerProcess, ServerProcess, int]:
    bootstrap = free_port()
    prefill = ServerProcess("--model-path", model, *TINY_FLAGS, "--disaggregation-mode", "prefill",
                            "--disaggregation-bootstrap-port", str(bootstrap),
                            "--disaggregation-transfer-backend", backend, *extra)
    decode = ServerProcess("--model-path", model, *TINY_FLAGS, "--disaggregation-mode", "decode",
                           "--disaggregation-transfer-backend", backend, *extra)
    prefill.wait_healthy()
    decode.wait_healthy()
    return prefill, decode, bootstrap


def _stream_text(url: str, body: dict) -> str:
    request = urllib.request.Request(url + "/generate", data=json.dumps({**body, "stream": True}).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    text = ""
    with urllib.request.urlopen(request, timeout=120) as resp:
        for line in resp:
            line = line.decode().strip()
            if line.startswith("data:") and line != "data: [DONE]":
                text = json.loads(line[5:])["text"]
    return text


def _chat(url: str) -> str:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    return client.chat.completions.create(model="default", messages=[{"role": "user", "content": "Say hi"}],
                                          max_tokens=10, temperature=0).choices[0].message.content


def _assert_idle_and_full(server: ServerProcess, timeout_s: float = 30) -> None:
    """Wait until no queue of the PD server holds a request and its transfer agent no room (`timeout_s`), then
    its pool must be full."""
    deadline = time.monotonic() + timeout_s
    while True:
        info = server.server_info()
        queues = [info.get(k, 0) for k in ("num_running_reqs", "num_waiting_reqs", "num_bootstrap_reqs",
                                           "num_inflight_transfer_reqs", "num_prealloc_queue_reqs",
                                           "num_transfer_queue_reqs", "num_decode_retracted_reqs",
                                           "num_draining_reqs", "transfer_room_records")]
        if not any(queues):
            break
        if time.monotonic() > deadline:
            raise AssertionError(f"{server.url} not idle after {timeout_s} s: {[q for q in queues]} "
                                 f"(running, waiting, bootstrap, inflight, prealloc, transfer, retracted, draining, "
                                 f"the transfer agent's room records)")
        time.sleep(0.1)
    assert info["available_kv_tokens"] + info["evictable_kv_tokens"] == info["max_total_num_tokens"], info


def test_router_pd_pair_matches_the_unified_server(tiny_server, tiny_runtime_model):
    """Mooncake; NIXL's answers are compared in the injected-failures test below."""
    prefill, decode, bootstrap = start_pair(tiny_runtime_model, "mooncake")
    routers = []
    try:
        router = Router(prefill, bootstrap, decode).wait_ready()
        routers.append(router)
        mini = Router(prefill, bootstrap, decode, mini_lb=True).wait_ready()
        routers.append(mini)
        logprobs = {**GREEDY, "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2}
        status, want = http("POST", tiny_server.url + "/generate", {"text": PROMPTS, **logprobs})
        assert status == 200, want
        got = []
        for text in PROMPTS:  # the Rust router takes one prompt per /generate
            status, out = http("POST", router.url + "/generate", {"text": text, **logprobs}, timeout=120)
            assert status == 200, out
            got.append(out)
        status, got_batch = http("POST", mini.url + "/generate", {"text": PROMPTS, **logprobs}, timeout=120)
        assert status == 200, got_batch
        # (the mini-lb merges the prefill's prompt logprobs into single answers only, not into a batch's)
        for g, w in [*zip(got, want, strict=True), *zip(got_batch, want, strict=True)]:
            assert g["text"] == w["text"]
            assert [t for _, t, *_ in g["meta_info"]["output_token_logprobs"]] == \
                [t for _, t, *_ in w["meta_info"]["output_token_logprobs"]]
            for (lg, _, *_), (lw, _, *_) in zip(g["meta_info"]["output_token_logprobs"],
                                                w["meta_info"]["output_token_logprobs"], strict=True):
                assert lg == pytest.approx(lw, abs=1e-3)
            if g in got:
                assert [t for _, t, *_ in g["meta_info"]["input_token_logprobs"]] == \
                    [t for _, t, *_ in w["meta_info"]["input_token_logprobs"]]
                assert [lp for lp, *_ in g["meta_info"]["input_token_logprobs"][1:]] == pytest.approx(
                    [lp for lp, *_ in w["meta_info"]["input_token_logprobs"][1:]], abs=1e-3)
            assert g["meta_info"]["completion_tokens"] == w["meta_info"]["completion_tokens"]
        single = {"text": PROMPTS[2], **GREEDY}
        assert _stream_text(router.url, single) == _stream_text(tiny_server.url, single)
        assert _chat(router.url) == _chat(tiny_server.url)
        _assert_idle_and_full(prefill)
        _assert_idle_and_full(decode)
        # a request that bypasses the router: a clear 400, and both servers keep serving
        status, body = http("POST", decode.url + "/generate", {"text": "hi", **GREEDY})
        assert status == 400 and "bootstrap_room" in json.dumps(body), body
        assert http("POST", router.url + "/generate", {"text": "hi", **GREEDY})[0] == 200
    finally:
        for r in routers:
            r.stop()
        for server in (prefill, decode):
            server.stop()


def _start_stream(url: str, body: dict) -> tuple[threading.Thread, dict]:
    """A streamed /generate on its own thread; the dict gets "chunks" (texts seen), "error" (an abort or an
    exception) and "completed" (a finish reason or [DONE] arrived: the stream ended normally)."""
    result: dict = {"chunks": [], "completed": False}

    def run() -> None:
        request = urllib.request.Request(url + "/generate", data=json.dumps({**body, "stream": True}).encode(),
                                         headers={"Content-Type": "application/json"}, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=120) as resp:
                for line in resp:
                    line = line.decode().strip()
                    if line == "data: [DONE]":
                        result["completed"] = True
                    elif line.startswith("data:"):
                        chunk = json.loads(line[5:])
                        result["chunks"].append(chunk)
                        finish = (chunk.get("meta_info") or {}).get("finish_reason") or {}
                        result["completed"] |= bool(finish) and finish.get("type") != "abort"
                        if "error" in chunk or finish.get("type") == "abort":
                            result["error"] = chunk.get("error") or finish
                    elif line.startswith("{"):
                        result["error"] = line
        except Exception as e:  # noqa: BLE001 - a broken stream is the expected outcome here
            result["error"] = repr(e)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, result


def _wait(predicate, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_injected_transfer_failures_then_a_killed_decode(tiny_server, tiny_runtime_model, monkeypatch):
    """NIXL. Half the transfers fail (SGLang's DISAGGREGATION_TEST_FAILURE_PROB hook on the prefill server): each
    such request ends with a 5xx naming the transfer, the others equal the unified server, both servers stay
    healthy with full pools. Then the decode server is killed mid-stream: the client's stream breaks off and
    the prefill server ends idle with a full pool, still healthy."""
    bootstrap = free_port()
    monkeypatch.setenv("TOKENLOOM_DISAGGREGATION_TEST_FAILURE_PROB", "0.5")
    backend = ("--disaggregation-transfer-backend", "nixl")
    prefill = ServerProcess("--model-path", tiny_runtime_model, *TINY_FLAGS, "--disaggregation-mode", "prefill",
                            "--disaggregation-bootstrap-port", str(bootstrap), *backend)
    monkeypatch.delenv("TOKENLOOM_DISAGGREGATION_TEST_FAILURE_PROB")
    decode = ServerProcess("--model-path", tiny_runtime_model, *TINY_FLAGS, "--disaggregation-mode", "decode",
                           *backend)
    router = None
    try:
        prefill.wait_healthy()
        decode.wait_healthy()
        router = Router(prefill, bootstrap, decode, extra=("--disable-retries",))  # it retries failures otherwise
        texts = [f"Request number {i} asks" for i in range(11)] + ["Once upon a time " * 12]  # chunked
        want = http("POST", tiny_server.url + "/generate", {"text": texts, **GREEDY})[1]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # the router may still be starting or finding its workers
            try:  # one probe (a 500 from an injected failure means the workers are found)
                status, body = http("POST", router.url + "/generate", {"text": "probe", **GREEDY}, timeout=60)
                if not (status == 503 and "available" in json.dumps(body)):
                    break
            except OSError:
                pass
            time.sleep(0.3)
        outcomes = [http("POST", router.url + "/generate", {"text": t, **GREEDY}, timeout=60) for t in texts]
        failed = [(s, body) for s, body in outcomes if s != 200]
        assert 0 < len(failed) < len(texts), outcomes
        assert all(s >= 500 and "transfer" in json.dumps(body).lower() for s, body in failed), failed
        for (status, body), w in zip(outcomes, want, strict=True):
            if status == 200:
                assert body["text"] == w["text"]
        assert http("GET", prefill.url + "/health")[0] == 200 and http("GET", decode.url + "/health")[0] == 200
        assert prefill.server_info()["num_failed_transfer_reqs"] >= len(failed)
        _assert_idle_and_full(prefill)
        _assert_idle_and_full(decode)
        # then the decode server dies mid-stream (of a request whose transfer went through: it streams tokens)
        for _ in range(40):  # each try fails with p 0.5: 40 misses in a row is 1e-12
            thread, result = _start_stream(router.url, {"text": "Tell me a story",
                                                        "sampling_params": {"max_new_tokens": 4000,
                                                                            "ignore_eos": True}})
            _wait(lambda r=result, t=thread: len(r["chunks"]) > 3 or "error" in r or not t.is_alive(),
                  "the stream neither started nor failed")
            if len(result["chunks"]) > 3:
                break
            thread.join(timeout=60)  # an injected failure: try again
        assert len(result["chunks"]) > 3, result
        decode.stop(signal.SIGKILL)
        thread.join(timeout=60)
        assert not thread.is_alive() and not result["completed"], result  # the client's stream broke off
        _assert_idle_and_full(prefill)
        assert http("GET", prefill.url + "/health")[0] == 200
    finally:
        if router is not None:
            router.stop()
        for server in (prefill, decode):
            server.stop()


def test_a_prefill_killed_mid_transfer_fails_its_request_on_the_decode_side(tiny_runtime_model, monkeypatch):
    """The prefill server is killed while a long prompt's KV streams (many 64-token chunks): the decode server
    notices within its heartbeat bound, the client gets an error naming the prefill server, the decode pool
    is full and it serves on."""
    monkeypatch.setenv("TOKENLOOM_DISAGGREGATION_HEARTBEAT_INTERVAL", "0.5")
    prefill, decode, bootstrap = start_pair(tiny_runtime_model, "mooncake")
    monkeypatch.delenv("TOKENLOOM_DISAGGREGATION_HEARTBEAT_INTERVAL")
    routers = []
    try:
        routers.append(Router(prefill, bootstrap, decode).wait_ready())
        scheduler = prefill.server_info()["process_ids"]["scheduler"]
        thread, result = _start_stream(routers[-1].url, {"text": "word " * 7000, **GREEDY})
        _wait(lambda: decode.server_info().get("num_transfer_queue_reqs", 0) > 0, "the KV transfer did not start",
              timeout=60)
        os.kill(scheduler, signal.SIGSTOP)  # freeze it mid-transfer (110 chunks), then kill the whole server
        assert decode.server_info()["num_transfer_queue_reqs"] == 1, "the transfer finished before the kill"
        os.kill(scheduler, signal.SIGKILL)
        prefill.stop(signal.SIGKILL)
        thread.join(timeout=60)
        assert not thread.is_alive() and "error" in result, result
        assert "prefill server" in json.dumps(result["error"]), result  # the heartbeat named the lost prefill
        _assert_idle_and_full(decode)
        status, out = http("POST", decode.url + "/generate", {"text": "hi", **GREEDY, "bootstrap_host": "2.2.2.2",
                                                               "bootstrap_room": 1})
        assert status == 200, out  # it serves on (a local request: no prefill server left)
    finally:
        for r in routers:
            r.stop()
        for server in (prefill, decode):
            server.stop()
