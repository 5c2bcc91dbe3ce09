"""The real default model (SmolLM2-135M-Instruct) in the default configuration (bf16, native kernels) split
over a prefill and a decode server behind SGLang's router: greedy /generate and chat answers equal a unified
server's with the same flags."""

from __future__ import annotations

import openai
import pytest

from tests.e2e.server_process import ServerProcess, free_port, http
from tests.e2e.test_disaggregation import Router

PROMPTS = ["The capital city of France is", "Write a short poem about the sea:", "def fibonacci(n):"]
GREEDY = {"sampling_params": {"temperature": 0, "max_new_tokens": 24}}
FLAGS = ("--max-total-tokens", "8192", "--max-running-requests", "8")

pytestmark = pytest.mark.slow


def _chat(url: str) -> str:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    return client.chat.completions.create(model="default", max_tokens=24, temperature=0, messages=[
        {"role": "user", "content": "What is the capital of France?"}]).choices[0].message.content


def test_smollm2_bf16_pd_pair_matches_the_unified_server():
    bootstrap = free_port()
    servers = [ServerProcess(*FLAGS),
               ServerProcess(*FLAGS, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port",
                             str(bootstrap)),
               ServerProcess(*FLAGS, "--disaggregation-mode", "decode")]
    router = None
    try:
        unified, prefill, decode = (s.wait_healthy() for s in servers)
        router = Router(prefill, bootstrap, decode).wait_ready()
        for text in PROMPTS:
            want = http("POST", unified.url + "/generate", {"text": text, **GREEDY})[1]
            status, got = http("POST", router.url + "/generate", {"text": text, **GREEDY}, timeout=120)
            assert status == 200, got
            assert got["text"] == want["text"], text
            assert got["output_ids"] == want["output_ids"]
        assert _chat(router.url) == _chat(unified.url)
    finally:
        if router is not None:
            router.stop()
        for server in servers:
            server.stop()
