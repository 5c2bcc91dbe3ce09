"""The real default model (SmolLM2-135M-Instruct, no --model-path) over HTTP: greedy output through
/generate, /v1/completions and /v1/chat/completions equals `Engine.generate` on the same model and flags;
SIGINT stops the server and its children."""

from __future__ import annotations

import signal

import openai
import pytest

from tests.e2e.server_process import ServerProcess, http
from tokenloom import Engine

FLAGS = {"dtype": "float32", "max_total_tokens": 4096, "max_running_requests": 8, "num_threads": 1}
PROMPTS = ["The capital city of France is", "Write a short poem about the sea:", "def fibonacci(n):"]
GREEDY = {"temperature": 0, "max_new_tokens": 16}
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
CHAT_GREEDY = {"temperature": 0, "max_new_tokens": 24}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    """(server, expected): the in-process Engine computes the expected outputs while the server subprocess
    loads, then shuts down so the HTTP requests have the CPU to themselves."""
    cli = [arg for k, v in FLAGS.items() for arg in (f"--{k.replace('_', '-')}", str(v))]
    server = ServerProcess(*cli)
    try:
        with Engine(log_level="warning", **FLAGS) as engine:
            tok = engine.tokenizer
            chat_ids = tok(tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True),
                           add_special_tokens=False).input_ids
            outs = engine.generate(input_ids=[tok(p).input_ids for p in PROMPTS] + [chat_ids],
                                   sampling_params=[GREEDY] * len(PROMPTS) + [CHAT_GREEDY])
        expected = {"prompts": outs[:-1], "chat": outs[-1], "chat_prompt_tokens": len(chat_ids)}
        server.wait_healthy()
        yield server, expected
    finally:
        code = server.stop(signal.SIGINT)
        assert code == 0, f"exit status {code}:\n{server.logs()}"
        assert not server.children()


def test_generate_equals_engine(smollm2):
    server, expected = smollm2
    status, batch = http("POST", server.url + "/generate", {"text": PROMPTS, "sampling_params": GREEDY})
    assert status == 200
    for got, want in zip(batch, expected["prompts"], strict=True):
        assert got["output_ids"] == want["output_ids"]
        assert got["text"] == want["text"]
        assert got["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"]
    assert "Paris" in batch[0]["text"]


def test_openai_routes_equal_engine(smollm2):
    server, expected = smollm2
    with openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0) as client:
        model = client.models.list().data[0].id
        assert model == "smollm2"
        want = expected["prompts"][0]["text"]
        out = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=16, temperature=0)
        assert out.choices[0].text == want
        streamed = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=16, temperature=0,
                                             stream=True)
        assert "".join(c.choices[0].text for c in streamed if c.choices) == want
        chat = client.chat.completions.create(model=model, messages=CHAT, max_tokens=24, temperature=0)
    assert chat.choices[0].message.content == expected["chat"]["text"]
    assert chat.usage.prompt_tokens == expected["chat_prompt_tokens"]
    assert "Paris" in chat.choices[0].message.content
