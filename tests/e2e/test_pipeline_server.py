"""`tokenloom serve --pp-size 2` end to end over HTTP: /generate (batch, seeded) and the OpenAI chat route
streamed through the `openai` client equal the PP=1 server's (same flags); every stage's pools end full;
then a hung stage (SIGSTOP) is named within a bound and the server exits 1 with no child left."""

from __future__ import annotations

import openai

from tests.e2e.conftest import TINY_FLAGS
from tests.e2e.server_process import ServerProcess, assert_a_hung_rank_is_named, assert_same_answers

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
        assert_same_answers(server.url, tiny_server.url, [BATCH, SEEDED], texts=True)
        assert _streamed_chat(server.url) == _streamed_chat(tiny_server.url)
        info = server.wait_idle_and_pool_full()
        assert info["pp_size"] == 2 and len(info["pp_stages"]) == 2
        assert all(s["available_kv_tokens"] + s["evictable_kv_tokens"] == s["max_total_num_tokens"]
                   for s in info["pp_stages"])
        stage1 = info["process_ids"]["scheduler1"]
    except BaseException:
        server.stop()
        raise
    assert_a_hung_rank_is_named(server, stage1, "scheduler rank 1 (tp 0, pp 1)", timeout_s)
