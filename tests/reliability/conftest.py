"""The reliability tests' servers: the tiny random model behind a deliberately small KV pool, as the operator
who filed issue 20 ran it (`--max-total-tokens 3000 --max-running-requests 24 --max-queued-requests 48`), so that
overload, retraction and refusals happen with few requests."""

from __future__ import annotations

import signal

import pytest

from tests.e2e.server_process import ServerProcess

SMALL_POOL_FLAGS = ("--dtype", "float32", "--context-length", "4096", "--max-total-tokens", "3000",
                    "--max-running-requests", "24", "--max-queued-requests", "48", "--chunked-prefill-size", "512",
                    "--num-threads", "1")


@pytest.fixture(scope="module")
def small_pool_server(tiny_runtime_model):
    server = ServerProcess("--model-path", tiny_runtime_model, *SMALL_POOL_FLAGS).wait_healthy()
    yield server
    code = server.stop(signal.SIGTERM)
    assert code in (0, -signal.SIGTERM), f"exit status {code}:\n{server.logs()}"
    assert not server.children(), "child processes survived the server"
    assert "Traceback" not in server.logs(), server.logs()
