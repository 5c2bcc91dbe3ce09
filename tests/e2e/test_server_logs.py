"""What a real server writes to its log (every process's output, captured by `ServerProcess`): without
--log-requests no prompt, output or API key appears, even at --log-level debug and on every error path (a
refused sampling parameter, malformed JSON, bodies over --max-request-body-bytes, declared or chunked); with
it, each request's input and output do. Also the start-up summary, prefill and decode step lines, and an
access log without health probes and metric scrapes. Two tiny-model servers, started side by side."""

from __future__ import annotations

import json
import re
import time

import pytest

from tests.e2e.server_process import ServerProcess, http

KEY = "log-test-key-9f3a"
AUTH = {"Authorization": f"Bearer {KEY}"}
LIMIT = 64 * 1024
MARKER = "Zanzibar-quokka-7731"  # a prompt no log line could contain by chance
FLAGS = ("--dtype", "float32", "--num-threads", "1", "--max-total-tokens", "4096", "--max-running-requests", "8",
         "--api-key", KEY, "--enable-metrics", "--decode-log-interval", "4", "--max-request-body-bytes", str(LIMIT))


@pytest.fixture(scope="module")
def servers(tiny_runtime_model):
    """(quiet, logging): the same server without and with --log-requests, each after `exercise`."""
    quiet = ServerProcess("--model-path", tiny_runtime_model, *FLAGS, "--log-level", "debug")
    logging_ = ServerProcess("--model-path", tiny_runtime_model, *FLAGS, "--log-level", "info", "--log-requests")
    try:
        results = [exercise(server.wait_healthy()) for server in (quiet, logging_)]
        for server in (quiet, logging_):
            server.stop()
        yield (quiet, results[0]), (logging_, results[1])
    finally:
        quiet.stop()
        logging_.stop()


def exercise(server: ServerProcess) -> dict:
    """Every kind of request carrying MARKER; returns the outputs and statuses seen."""
    url, out = server.url, {}
    sampling = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    status, body = http("POST", url + "/generate", {"text": f"{MARKER} native", "sampling_params": sampling},
                        headers=AUTH)
    assert status == 200, body
    out["texts"] = [body["text"]]
    status, body = http("POST", url + "/generate", {"text": f"{MARKER} stream", "sampling_params": sampling,
                                                    "stream": True}, headers=AUTH)
    assert status == 200 and "data: [DONE]" in body, body
    status, body = http("POST", url + "/v1/completions", {"model": "m", "prompt": f"{MARKER} completion",
                                                          "max_tokens": 16, "temperature": 0}, headers=AUTH)
    assert status == 200, body
    out["texts"].append(body["choices"][0]["text"])
    status, body = http("POST", url + "/v1/chat/completions", {"model": "m", "max_tokens": 16, "temperature": 0,
                                                               "messages": [{"role": "user", "content": MARKER}]},
                        headers=AUTH)
    assert status == 200, body
    out["texts"].append(body["choices"][0]["message"]["content"])
    out["bad_param"] = http("POST", url + "/generate", {"text": MARKER, "sampling_params": {"temperature": -1}},
                            headers=AUTH)[0]
    out["bad_json"] = http("POST", url + "/generate", raw=f'{{"text": "{MARKER}", '.encode(), headers=AUTH)[0]
    big = json.dumps({"text": MARKER + " x" * LIMIT}).encode()
    out["too_large"] = http("POST", url + "/generate", raw=big, headers=AUTH)
    out["too_large_chunked"] = http("POST", url + "/generate", raw=iter([big[:40000], big[40000:]]), headers=AUTH)
    out["after"] = http("POST", url + "/generate", {"text": "still serving", "sampling_params": sampling},
                        headers=AUTH)[0]
    out["unauthorized"] = http("POST", url + "/generate", {"text": MARKER})[0]
    for path in ("/health", "/health_generate", "/metrics"):
        assert http("GET", url + path, headers=AUTH)[0] == 200
    assert http("GET", url + "/v1/models", headers=AUTH)[0] == 200
    time.sleep(0.5)  # let the last lines reach the log
    return out


def test_no_prompt_output_or_key_in_the_log_without_log_requests(servers):
    (server, out), _ = servers
    logs = server.logs()
    assert (out["bad_param"], out["bad_json"], out["unauthorized"], out["after"]) == (400, 400, 401, 200)
    assert MARKER not in logs
    assert KEY not in logs
    texts = [text for text in out["texts"] if len(text.strip()) >= 8]  # long enough not to occur by chance
    assert texts
    for text in texts:
        assert text not in logs, text
    assert "DEBUG" in logs  # the strictest level was really on


@pytest.mark.parametrize("case, size", [("too_large", "bytes"), ("too_large_chunked", f"more than {LIMIT} bytes")])
def test_bodies_over_the_limit_get_413_and_the_server_keeps_serving(servers, case, size):
    (_, out), _ = servers
    status, body = out[case]
    assert status == 413 and body["error"]["code"] == 413
    assert body["error"]["message"].endswith(f"; the limit is {LIMIT} bytes (--max-request-body-bytes).")
    assert size in body["error"]["message"]
    assert out["after"] == 200


def test_with_log_requests_inputs_and_outputs_are_logged(servers):
    _, (server, out) = servers
    logs = server.logs()
    receives = [line for line in logs.splitlines() if "Receive: rid=" in line]
    finishes = [line for line in logs.splitlines() if "Finish: rid=" in line]
    for kind in ("native", "stream", "completion"):
        assert sum(f"text='{MARKER} {kind}'" in line for line in receives) == 1, kind
    assert not any(f"text='{MARKER}'" in line for line in receives)  # the refused requests never got this far
    chat = [line for line in receives if "WARMUP_" not in line and ("<|im_start|>" in line or "input_ids=[" in line)]
    assert len(chat) == 1  # the chat request: its templated prompt (text or token ids)
    for text in out["texts"]:
        assert any(repr(text)[1:-1] in line for line in finishes), text
    assert KEY not in logs and not any("HEALTH_CHECK" in line for line in receives)


def test_startup_summary_and_step_lines(servers):
    for (server, _) in servers:
        logs = server.logs()
        assert re.search(r"INFO Model: \S+ \(LlamaForCausalLM\), float32, [\d.]+M parameters, weights loaded in ",
                         logs)
        assert re.search(r"INFO Memory: weights [\d.]+ GiB, KV pool [\d.]+ GiB \(4096 tokens\), 8 request slots", logs)
        assert re.search(r"INFO Device: cpu \(AVX512-BF16: (yes|no), AMX: (yes|no)\), 1 threads per rank, TP 1 x PP 1",
                         logs)
        assert "api_key='<redacted>'" in logs and "max_request_body_bytes=65536" in logs
        assert "host='127.0.0.1'" in logs and "Uvicorn running on http://127.0.0.1:" in logs  # loopback by default
        assert re.search(r"INFO Loaded weights: 2/2 layers, ", logs)
        assert re.search(r"INFO Prefill batch\. #new-seq: 1, #new-token: \d+, #cached-token: \d+, token usage: "
                         r"\d\.\d\d, #running-req: \d+, #queue-req: 0", logs)
        assert "INFO Decode batch. #running-req: 1" in logs


def test_access_log_without_health_and_metrics(servers):
    for (server, _) in servers:
        logs = server.logs()
        assert '"GET /v1/models HTTP/1.1" 200' in logs and '"POST /generate HTTP/1.1" 413' in logs
        for path in ("/health", "/health_generate", "/metrics"):
            assert f'"GET {path} HTTP/1.1"' not in logs, path
