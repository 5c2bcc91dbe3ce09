"""`tokenloom serve --pp-size 2` end to end over HTTP: /generate (batch, seeded) and the OpenAI chat route
streamed through the `openai` client equal the PP=1 server's (same flags); every stage's pools end full;
then a hung stage (SIGSTOP) is named within a bound and the server exits 1 with no child left."""

from __future__ import annotations

import contextlib
import os
import signal
import time

import openai

from tests.e2e.conftest import TINY_FLAGS
from tests.e2e.server_process import ServerProcess, http, start_pending_request

PROMPTS = ["The capital city of France is", "1, 2, 3, 4, 5,", "Once upon a time", "def fibonacci(n):"]
BATCH = {"text": PROMPTS, "sampling_params": {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True},
         "return_logprob": True}
SEEDED = {"text": PROMPTS, "sampling_params": {"temperature": 0.8, "top_k": 16, "max_new_tokens": 16,
                                               "ignore_eos": True, "sampling_seed": 5}}


def _streamed_chat(url: str) -> str:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    stream = client.chat.completions.create(model="default", messages=[{"role": "user", "content": "Say hi"}],
                                            max_tokens=12, temperature=0, stream=True)
    return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)


def test_pp2_server_matches_pp1_then_a_hung_stage_is_named(tiny_server, tiny_runtime_model):
    timeout_s = 5
    server = ServerProcess("--model-path", tiny_runtime_model, *TINY_FLAGS, "--pp-size", "2",
                           "--dist-timeout", str(timeout_s)).wait_healthy()
    try:
        for body in (BATCH, SEEDED):
            status1, ref = http("POST", tiny_server.url + "/generate", body)
            status2, out = http("POST", server.url + "/generate", body)
            assert status1 == status2 == 200, (ref, out)
            assert [o["output_ids"] for o in out] == [o["output_ids"] for o in ref]
            assert [o["text"] for o in out] == [o["text"] for o in ref]
        assert _streamed_chat(server.url) == _streamed_chat(tiny_server.url)
        info = server.wait_idle_and_pool_full()
        assert info["pp_size"] == 2 and len(info["pp_stages"]) == 2
        assert all(s["available_kv_tokens"] + s["evictable_kv_tokens"] == s["max_total_num_tokens"]
                   for s in info["pp_stages"])
        stage1 = info["process_ids"]["scheduler1"]

        thread, result = start_pending_request(server)
        time.sleep(0.5)
        start = time.monotonic()
        os.kill(stage1, signal.SIGSTOP)
        thread.join(timeout=60)
        status, body = result["reply"]
        assert status == 503, body
        assert "scheduler rank 1 (tp 0, pp 1) stopped responding" in body["error"]["message"], body
        assert server.wait_exit(timeout=60) == 1
        assert time.monotonic() - start < 4 * timeout_s + 10
    finally:
        with contextlib.suppress(ProcessLookupError, UnboundLocalError):
            os.kill(stage1, signal.SIGCONT)
        server.stop()
    assert not server.children()
