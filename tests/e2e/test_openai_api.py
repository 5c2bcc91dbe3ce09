"""The OpenAI-compatible routes through the official `openai` client: completions, chat, streaming,
usage, n, stop, seed, logprobs, echo, and /v1/models."""

from __future__ import annotations

import openai
import pytest

from tests.e2e.server_process import http

PROMPT = "The capital city of France is"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


def generate(tiny_server, **body):
    status, out = http("POST", tiny_server.url + "/generate", body)
    assert status == 200, out
    return out


def test_models(client, tiny_server, tiny_runtime_model):
    models = client.models.list().data
    assert [m.id for m in models] == [tiny_runtime_model]
    assert models[0].owned_by == "tokenloom" and models[0].max_model_len == 8192
    assert client.models.retrieve(tiny_runtime_model).id == tiny_runtime_model
    status, body = http("GET", tiny_server.url + "/v1/models/no-such-model")
    assert status == 404
    assert body == {"error": {"message": "The model 'no-such-model' does not exist", "type": "invalid_request_error",
                              "param": "model", "code": "model_not_found"}}


def test_completion_matches_generate_and_reports_usage(client, model, tiny_server):
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=10, **GREEDY)
    ref = generate(tiny_server, text=PROMPT, sampling_params={"temperature": 0, "max_new_tokens": 10,
                                                              "ignore_eos": True})
    assert out.object == "text_completion" and out.id.startswith("cmpl-")
    assert out.choices[0].text == ref["text"] and out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == ref["meta_info"]["prompt_tokens"]
    assert out.usage.completion_tokens == 10 and out.usage.total_tokens == out.usage.prompt_tokens + 10


def test_completion_default_max_tokens_token_prompts_and_batches(client, model):
    out = client.completions.create(model=model, prompt=PROMPT, **GREEDY)
    assert out.usage.completion_tokens == 16  # OpenAI's default max_tokens
    by_ids = client.completions.create(model=model, prompt=[1, 504, 3458], max_tokens=4, **GREEDY)
    assert by_ids.usage.prompt_tokens == 3
    batch = client.completions.create(model=model, prompt=[PROMPT, "Hello"], max_tokens=4, n=2,
                                      temperature=0.9, extra_body={"ignore_eos": True})
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    single = [client.completions.create(model=model, prompt=p, max_tokens=1, **GREEDY).usage.prompt_tokens
              for p in (PROMPT, "Hello")]
    assert batch.usage.prompt_tokens == sum(single)  # each prompt counted once despite n=2
    assert batch.usage.completion_tokens == 16


def test_completion_stop_seed_echo_logprobs(client, model):
    base = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, **GREEDY).choices[0].text
    stop = base[len(base) // 2: len(base) // 2 + 3]
    stopped = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, stop=[stop], **GREEDY).choices[0]
    assert stopped.finish_reason == "stop" and stopped.matched_stop == stop
    assert stopped.text == base[: base.find(stop)]
    a, b = (client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=11)
            for _ in range(2))
    assert a.choices[0].text == b.choices[0].text
    echo = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, echo=True, **GREEDY)
    assert echo.choices[0].text.startswith(PROMPT)
    lp = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, logprobs=2, **GREEDY).choices[0]
    assert len(lp.logprobs.tokens) == len(lp.logprobs.token_logprobs) == 4
    assert "".join(lp.logprobs.tokens) == lp.text
    assert all(len(t) <= 2 for t in lp.logprobs.top_logprobs) and lp.logprobs.text_offset[0] == 0


def test_completion_stream_with_usage(client, model):
    full = client.completions.create(model=model, prompt=PROMPT, max_tokens=10, **GREEDY)
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=10, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])
    continuous = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=10, stream=True,
                                                stream_options={"continuous_usage_stats": True}, **GREEDY))
    counts = [c.usage.completion_tokens for c in continuous]
    assert counts == sorted(counts) and counts[-1] == 10


def test_chat_matches_template_and_generate(client, model, tiny_server):
    out = client.chat.completions.create(model=model, messages=MESSAGES, max_completion_tokens=8, **GREEDY)
    assert out.object == "chat.completion" and out.choices[0].message.role == "assistant"
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 8
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    ids = tok(tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True),
              add_special_tokens=False).input_ids
    ref = generate(tiny_server, input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": 8,
                                                                "ignore_eos": True})
    assert out.choices[0].message.content == ref["text"]
    assert out.usage.prompt_tokens == len(ids)
    legacy = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, **GREEDY)
    assert legacy.choices[0].message.content == ref["text"]


def test_chat_stream_n_and_logprobs(client, model):
    full = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=6, **GREEDY)
    chunks = list(client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=6, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.total_tokens == full.usage.total_tokens
    many = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4, n=3, temperature=1.0)
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert many.usage.prompt_tokens == full.usage.prompt_tokens
    lp = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4, logprobs=True,
                                        top_logprobs=2, **GREEDY).choices[0]
    assert len(lp.logprobs.content) == 4
    assert "".join(t.token for t in lp.logprobs.content) == lp.message.content
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].token == t.token for t in lp.logprobs.content)


def test_chat_with_text_parts_and_errors_raise_client_errors(client, model):
    parts = client.chat.completions.create(model=model, max_tokens=2, messages=[
        {"role": "user", "content": [{"type": "text", "text": "Name a colour."}]}], **GREEDY)
    assert parts.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError, match="Messages cannot be empty"):
        client.chat.completions.create(model=model, messages=[], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=model, prompt=PROMPT, temperature=-0.5)
