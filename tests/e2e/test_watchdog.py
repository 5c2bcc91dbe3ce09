"""--watchdog-timeout: a forward step that never returns (the test hook TOKENLOOM_TEST_HANG_FORWARD_AFTER makes
the scheduler's 41st forward block forever, as a hung kernel would) trips the scheduler's watchdog. The
in-flight request, which was streaming tokens, gets an error naming the watchdog no earlier than the timeout
after its last token and within a few seconds of it; /health is no longer 200; the server exits non-zero within
a bound and its log names the watchdog; none of its processes (/get_server_info `process_ids`) is left."""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from unittest import mock

import pytest

from tests.e2e.conftest import TINY_FLAGS
from tests.e2e.server_process import ServerProcess, http
from tokenloom.executor.forward_thread import HANG_AFTER_ENV

WATCHDOG_S = 3.0
# Warm-up (8 tokens) and the first health probe take about 9 forwards, the test's request 2000: the hang comes
# in the middle of the request, after it has streamed a few tokens.
HANG_AFTER = 40
REASON = f"watchdog: a forward step has not returned for {WATCHDOG_S:g} s"


@pytest.fixture(scope="module")
def hanging_server(tiny_runtime_model):
    with mock.patch.dict(os.environ, {HANG_AFTER_ENV: str(HANG_AFTER)}):
        server = ServerProcess("--model-path", tiny_runtime_model, *TINY_FLAGS, "--watchdog-timeout", f"{WATCHDOG_S}")
    try:
        yield server.wait_healthy()
    finally:
        server.stop()


def _stream_until_error(url: str) -> list[tuple[float, dict]]:
    """(arrival time, event) of every SSE event of one long streaming /generate, up to its error event."""
    body = {"text": "A", "stream": True, "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}
    request = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    events: list[tuple[float, dict]] = []
    with urllib.request.urlopen(request, timeout=60) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            events.append((time.monotonic(), json.loads(line[len("data:"):])))
            if "error" in events[-1][1]:
                break
    return events


def _health_status(url: str) -> int | None:
    """/health's status, None once the server no longer accepts connections."""
    try:
        return http("GET", url + "/health", timeout=30)[0]
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def test_a_hung_forward_fails_the_request_and_the_server(hanging_server):
    server = hanging_server
    pids = list(server.server_info()["process_ids"].values())
    assert pids and all(_running(pid) for pid in pids)

    events = _stream_until_error(server.url)
    tokens, (error_at, error) = events[:-1], events[-1]
    assert tokens, "the request should have streamed tokens before the forward hung"
    assert "error" in error and REASON in error["error"]["message"], error
    stalled_for = error_at - tokens[-1][0]
    assert WATCHDOG_S - 0.5 <= stalled_for < WATCHDOG_S + 5, stalled_for

    assert _health_status(server.url) != 200
    assert server.wait_exit(timeout=30) not in (0, None)
    logs = server.logs()
    assert REASON in logs, logs
    deadline = time.monotonic() + 10
    while any(_running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_running(pid) for pid in pids), [pid for pid in pids if _running(pid)]
