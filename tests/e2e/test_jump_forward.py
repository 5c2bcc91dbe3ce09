"""Jump-forward decoding (`--enable-jump-forward`) over HTTP: a real server (the tiny random Llama with SmolLM2's
tokenizer, float32), overlap on and off, one module-scoped server per mode.

The reference is plain decoding (jump-forward off) of the same requests on the same weights, computed in-process
through the real scheduler (tests/scheduler_harness.py) while the server loads. Compared:
- a schema of one string: the text is identical (the token ids may differ: the backend spells forced text);
- a schema of four fixed keys and free values: the token ids are identical up to the first position where the
  reference's greedy token differs from the forced tokenization, and there the two tokens are one's text a
  prefix of the other's (the same forced text, split differently); every answer validates (`jsonschema`).
The server's counters show fewer decode steps than output tokens, max_new_tokens bounds forced tokens, and the
KV pool is full afterwards.
"""

from __future__ import annotations

import json

import pytest

from tests.e2e.server_process import ServerProcess, http
from tests.jump_forward_cases import CONST_SCHEMA, CONST_VALUE, EOS, KEYS_SCHEMA
from tests.jump_forward_cases import PROMPTS as ALL_PROMPTS
from tests.scheduler_harness import Harness

jsonschema = pytest.importorskip("jsonschema")

PROMPTS = ALL_PROMPTS[:3]
FLAGS = ("--dtype", "float32", "--max-total-tokens", "4096", "--num-threads", "1", "--enable-jump-forward")


def _params(schema: dict, max_new_tokens: int = 100) -> dict:
    return {"temperature": 0, "max_new_tokens": max_new_tokens, "json_schema": json.dumps(schema)}


def _reference(folder: str, tokenizer) -> dict[str, list[int]]:
    """Plain decoding (no jump-forward) of every request, in-process."""
    h = Harness(folder, tokenizer=tokenizer, eos=(EOS,), max_total_tokens=4096)
    for i, prompt in enumerate(PROMPTS):
        h.submit(f"keys{i}", prompt, _params(KEYS_SCHEMA))
        h.submit(f"const{i}", prompt, _params(CONST_SCHEMA))
    results = h.run()
    assert sorted(results) == sorted(f"{kind}{i}" for kind in ("keys", "const") for i in range(len(PROMPTS)))
    assert all(r.finish_reason["type"] == "stop" for r in results.values()), results
    return {rid: r.output_ids for rid, r in results.items()}


@pytest.fixture(scope="module", params=["on", "off"], ids=["overlap", "no_overlap"])
def served(request, tiny_runtime_model):
    from tokenloom.config import ServerArgs
    from tokenloom.models.loader import resolve_model_source
    from tokenloom.tokenizer import load_tokenizer

    srv = ServerProcess("--model-path", tiny_runtime_model, "--overlap-schedule", request.param, *FLAGS)
    try:
        tokenizer = load_tokenizer(resolve_model_source(ServerArgs(model_path=tiny_runtime_model)))
        reference = _reference(tiny_runtime_model, tokenizer)
        srv.wait_healthy(timeout=900)
        yield srv, reference, tokenizer
    finally:
        srv.stop()
    assert "Traceback" not in srv.logs(), srv.logs()


def _generate(srv: ServerProcess, prompt: list[int], params: dict) -> dict:
    status, body = http("POST", srv.url + "/generate", {"input_ids": prompt, "sampling_params": params})
    assert status == 200, body
    return body


def _strip_eos(ids: list[int]) -> list[int]:
    return ids[:-1] if ids and ids[-1] == EOS else ids


def test_answers_match_plain_decoding_with_fewer_decode_steps(served):
    srv, reference, tok = served
    before = srv.server_info()
    outputs = 0
    for i, prompt in enumerate(PROMPTS):
        body = _generate(srv, prompt, _params(CONST_SCHEMA))
        assert body["meta_info"]["finish_reason"]["type"] == "stop", body
        assert json.loads(body["text"]) == CONST_VALUE
        assert body["text"] == tok.decode(_strip_eos(reference[f"const{i}"]))
        outputs += len(body["output_ids"])

        body = _generate(srv, prompt, _params(KEYS_SCHEMA))
        assert body["meta_info"]["finish_reason"]["type"] == "stop", body
        jsonschema.validate(json.loads(body["text"]), KEYS_SCHEMA)
        got, want = body["output_ids"], reference[f"keys{i}"]
        outputs += len(got)
        d = next((j for j, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
        if d is None:
            assert got == want
        else:  # the first difference is a tokenization of the same forced text, not another answer
            a, b = tok.decode(got[d:d + 1]), tok.decode(want[d:d + 1])
            assert a.startswith(b) or b.startswith(a), (d, a, b, body["text"], tok.decode(want))
    after = srv.wait_idle_and_pool_full()
    decode_steps = after["decode_steps"] - before["decode_steps"]
    forced = after["num_jump_forward_tokens"] - before["num_jump_forward_tokens"]
    void = after["num_jump_forward_void_rows"] - before["num_jump_forward_void_rows"]
    assert forced >= 3 * 10, after
    # a decode step samples one token, except a void one (overlap: launched before its request's jump was
    # known); the prefill and each jump extend sample the others that are not forced (the counter skips a
    # request's first decode step, and with overlap the step after its last may run: at most one per request)
    assert decode_steps <= outputs - forced + void, (decode_steps, outputs, forced, void)
    assert decode_steps < outputs - 20, (decode_steps, outputs, forced, void)


def test_max_new_tokens_bounds_forced_tokens(served):
    srv, _, tok = served
    for n in (2, 5, 9):
        body = _generate(srv, PROMPTS[0], _params(CONST_SCHEMA, n))
        assert len(body["output_ids"]) == n and body["meta_info"]["completion_tokens"] == n, body
        assert body["meta_info"]["finish_reason"] == {"type": "length", "length": n}, body
    srv.wait_idle_and_pool_full()


def test_streamed_chat_answer_equals_the_whole_one(served):
    import openai

    srv, _, _ = served
    rf = {"type": "json_schema", "json_schema": {"name": "record", "schema": KEYS_SCHEMA, "strict": True}}
    kw = dict(model="tiny", messages=[{"role": "user", "content": "A record please"}], response_format=rf,
              max_tokens=100, temperature=0)
    with openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0) as client:
        whole = client.chat.completions.create(**kw).choices[0].message.content
        parts = [c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
                 if c.choices]
    assert "".join(parts) == whole
    jsonschema.validate(json.loads(whole), KEYS_SCHEMA)
    srv.wait_idle_and_pool_full()
