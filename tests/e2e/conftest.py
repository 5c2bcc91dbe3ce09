"""The shared end-to-end server: the tiny random Llama with SmolLM2's tokenizer (fast), started once per
session as a real `python -m tokenloom.launch_server` subprocess. Stopping it with SIGTERM at the end
checks that the server exits cleanly and takes its child processes with it."""

from __future__ import annotations

import signal

import pytest

from tests.e2e.server_process import ServerProcess

# A context far beyond the model's 2048 positions (RoPE is sized from it) so that a request "until the context
# limit" runs for many seconds: the abort and disconnect tests need it still running when they act.
TINY_FLAGS = ("--dtype", "float32", "--context-length", "8192", "--max-total-tokens", "16384",
              "--max-running-requests", "16",
              "--chunked-prefill-size", "64", "--num-threads", "1", "--enable-metrics")


@pytest.fixture(scope="session")
def tiny_server(tiny_runtime_model):
    server = ServerProcess("--model-path", tiny_runtime_model, *TINY_FLAGS).wait_healthy()
    yield server
    children = server.children()
    assert children, "the server should have child processes while running"
    code = server.stop(signal.SIGTERM)
    assert code in (0, -signal.SIGTERM), f"exit status {code}:\n{server.logs()}"
    assert not server.children(), "child processes survived the server"
    assert "Traceback" not in server.logs(), server.logs()


@pytest.fixture(scope="module")
def client(tiny_server):
    """The `openai` client on the tiny server (no retries: a failure shows as itself)."""
    import openai

    with openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id
