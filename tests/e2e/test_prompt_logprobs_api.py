"""Prompt logprobs over HTTP on the shared tiny server: /generate's `logprob_start_len`, `token_ids_logprob` and
`return_text_in_logprobs` (SGLang's meta_info keys, JSON and SSE), and /v1/completions' `echo` with `logprobs`
through the official `openai` client (the prompt's tokens, then the completion's), including `max_tokens: 0`."""

from __future__ import annotations

import json
import urllib.request

import pytest
import torch

from tests.e2e.server_process import http

PROMPT = "The capital city of France is Paris, and the capital of Italy is"
GREEDY = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}


@pytest.fixture(scope="module")
def reference(tiny_runtime_model):
    """float32 log_softmax of transformers' logits on the server's weights: row p scores token p+1."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_runtime_model, dtype=torch.float32).eval()

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)

    return logprobs


def generate(url: str, **body) -> dict:
    status, out = http("POST", url + "/generate", body)
    assert status == 200, out
    return out


def stream(url: str, body: dict) -> list[dict]:
    request = urllib.request.Request(url + "/generate", data=json.dumps({**body, "stream": True}).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    events = []
    with urllib.request.urlopen(request, timeout=60) as resp:
        for line in resp:
            line = line.strip()
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                events.append(json.loads(line[len(b"data: "):]))
    return events


def prompt_ids(url: str) -> list[int]:
    out = generate(url, text=PROMPT, sampling_params={"max_new_tokens": 1}, return_logprob=True,
                   logprob_start_len=0)
    return [t[1] for t in out["meta_info"]["input_token_logprobs"]]


def test_generate_prompt_logprobs_with_text(tiny_server, reference):
    url, k, ids = tiny_server.url, 3, [5, 6]
    body = dict(text=PROMPT, sampling_params=GREEDY, return_logprob=True, logprob_start_len=k, top_logprobs_num=2,
                token_ids_logprob=ids, return_text_in_logprobs=True)
    out = generate(url, **body)
    meta = out["meta_info"]
    tokens = prompt_ids(url)
    assert meta["prompt_tokens"] == len(tokens) == k + len(meta["input_token_logprobs"])
    entries = meta["input_token_logprobs"]
    assert entries[0][0] is None and [t[1] for t in entries] == tokens[k:]
    assert PROMPT.endswith("".join(t[2] for t in entries))  # the text slot holds each token's text
    ref = reference(tokens)
    got = torch.tensor([t[0] for t in entries[1:]])
    assert torch.allclose(got, ref[range(k, len(tokens) - 1), tokens[k + 1:]], atol=1e-4)
    tops = meta["input_top_logprobs"]
    assert tops[0] is None and all(len(pos) == 2 and all(isinstance(t[2], str) for t in pos) for pos in tops[1:])
    by_id = meta["input_token_ids_logprobs"]
    assert by_id[0] is None and all([t[1] for t in pos] == ids for pos in by_id[1:])
    assert len(meta["output_token_ids_logprobs"]) == len(out["output_ids"]) == 4
    events = stream(url, body)  # every event carries the prompt logprobs, once they are known
    assert len(events) >= 2 and all(e["meta_info"]["input_token_logprobs"] == entries for e in events)
    assert events[-1]["meta_info"]["output_token_ids_logprobs"] == meta["output_token_ids_logprobs"]


def test_completions_echo_with_logprobs(client, model, tiny_server):
    tokens = prompt_ids(tiny_server.url)
    native = generate(tiny_server.url, text=PROMPT, sampling_params=GREEDY, return_logprob=True, logprob_start_len=0,
                      top_logprobs_num=2)["meta_info"]
    plain = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, logprobs=2, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0]
    echo = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, logprobs=2, echo=True, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0]
    n = len(tokens)
    assert echo.text == PROMPT + plain.text
    lp = echo.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n + 4
    assert "".join(lp.tokens) == echo.text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:n] == pytest.approx([t[0] for t in native["input_token_logprobs"][1:]], abs=1e-5)
    assert lp.token_logprobs[n:] == pytest.approx(plain.logprobs.token_logprobs, abs=1e-5)
    assert lp.tokens[n:] == plain.logprobs.tokens
    assert all(len(t) <= 2 for t in lp.top_logprobs[1:])
    assert lp.text_offset[0] == 0 and lp.text_offset[n] == len(PROMPT)
    assert lp.text_offset == sorted(lp.text_offset)
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=4, logprobs=2, echo=True,
                                            temperature=0, stream=True, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].text == PROMPT and len(chunks[0].choices[0].logprobs.tokens) == n
    assert "".join(c.choices[0].text for c in chunks) == echo.text
    streamed = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)
    zero = client.completions.create(model=model, prompt=PROMPT, max_tokens=0, logprobs=1, echo=True)
    assert zero.choices[0].text == PROMPT and zero.choices[0].finish_reason == "length"
    assert zero.usage.completion_tokens == 0 and zero.usage.prompt_tokens == n
    assert zero.choices[0].logprobs.tokens == lp.tokens[:n]
    assert zero.choices[0].logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:n], abs=1e-5)
    batch = client.completions.create(model=model, prompt=[PROMPT, "Hello world"], max_tokens=2, logprobs=0,
                                      echo=True, temperature=0, extra_body={"ignore_eos": True})
    assert [c.text.startswith(p) for c, p in zip(batch.choices, [PROMPT, "Hello world"], strict=True)] == [True] * 2
    assert len(batch.choices[0].logprobs.token_logprobs) == n + 2
