"""Jump-forward decoding (`--enable-jump-forward`) through the real scheduler, loops and worker in-process (the
tiny random Llama with SmolLM2's tokenizer): schema answers validate (`jsonschema`, an independent judge), fewer
decode steps run than tokens come out, a language with one string gives the same text as decoding without
jump-forward, max_new_tokens and stop strings inside forced text end requests right, logprob requests are not
jumped, and every pool is full afterwards. Overlap on and off, xgrammar and llguidance.
"""

from __future__ import annotations

import json

import pytest

from tests.forward_steps import all_kv_free
from tests.jump_forward_cases import CONST_SCHEMA, CONST_VALUE, EOS, KEYS_SCHEMA, PROMPTS
from tests.scheduler_harness import Harness
from tokenloom.config import ConfigError, ServerArgs
from tokenloom.tokenizer import load_tokenizer

jsonschema = pytest.importorskip("jsonschema")



@pytest.fixture(scope="module")
def tokenizer(tiny_runtime_model):
    from tokenloom.models.loader import resolve_model_source

    return load_tokenizer(resolve_model_source(ServerArgs(model_path=tiny_runtime_model)))


def _answer(tokenizer, ids: list[int]) -> str:
    """The answer's text: without its EOS (xgrammar ends with it; llguidance stops where only EOS may follow)."""
    return tokenizer.decode(ids[:-1] if ids and ids[-1] == EOS else ids)


def _run(folder, tokenizer, jobs, **flags):
    """(results, scheduler state) of `jobs` [(rid, prompt, sampling dict)] on one harness."""
    h = Harness(folder, tokenizer=tokenizer, eos=(EOS,), **flags)
    for rid, prompt, params in jobs:
        h.submit(rid, prompt, params)
    results = h.run()
    state = h.scheduler.internal_state()
    state["decode_batches"] = h.scheduler.stats.decode_steps
    assert h.scheduler.flush_cache().success and all_kv_free(h.runner)
    return results, state


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
@pytest.mark.parametrize("overlap", ["off", "on"])
def test_schema_answers_validate_with_fewer_decode_steps_than_tokens(tiny_runtime_model, tokenizer, overlap,
                                                                     backend):
    schema = json.dumps(KEYS_SCHEMA)
    greedy = {"temperature": 0, "max_new_tokens": 120, "json_schema": schema}
    jobs = [("solo", PROMPTS[0], greedy)]
    results, state = _run(tiny_runtime_model, tokenizer, jobs, enable_jump_forward=True, overlap_schedule=overlap,
                          grammar_backend=backend)
    out = results["solo"]
    assert out.finish_reason["type"] == "stop", out
    jsonschema.validate(json.loads(_answer(tokenizer, out.output_ids)), KEYS_SCHEMA)
    assert state["num_jump_forward_tokens"] >= 8 and state["num_jump_forward_batches"] >= 3, state
    # one request: every output token comes from the prefill, a decode step whose row is not void (overlap: the
    # step launched before a jump was known), or a jump (forced tokens plus the one token its extend samples);
    # with overlap, the step after the one that finished it may run too (its token discarded)
    sampled = state["decode_batches"] - state["num_jump_forward_void_rows"]
    extra = sampled + 1 + state["num_jump_forward_batches"] + state["num_jump_forward_tokens"] - len(out.output_ids)
    assert 0 <= extra <= (overlap == "on"), (state, len(out.output_ids))
    assert state["decode_batches"] < len(out.output_ids) - 8
    assert (state["num_jump_forward_void_rows"] > 0) == (overlap == "on")

    # a batch: greedy, sampled and penalised rows beside an unconstrained one (with overlap: KV pages of 4, so
    # jump extends continue partial pages)
    jobs = [(f"g{i}", p, greedy) for i, p in enumerate(PROMPTS)]
    jobs += [("sampled", PROMPTS[1], {"temperature": 1.0, "sampling_seed": 3, "max_new_tokens": 120,
                                      "json_schema": schema}),
             ("penalised", PROMPTS[2], {"temperature": 0.7, "sampling_seed": 5, "frequency_penalty": 1.0,
                                        "repetition_penalty": 1.2, "max_new_tokens": 120, "json_schema": schema}),
             ("plain", PROMPTS[3], {"temperature": 0, "max_new_tokens": 20, "ignore_eos": True})]
    results, state = _run(tiny_runtime_model, tokenizer, jobs, enable_jump_forward=True, overlap_schedule=overlap,
                          grammar_backend=backend, page_size=4 if overlap == "on" else 1)
    for rid, _, _ in jobs[:-1]:
        out = results[rid]
        assert out.finish_reason["type"] == "stop", (rid, out)
        jsonschema.validate(json.loads(_answer(tokenizer, out.output_ids)), KEYS_SCHEMA)
    assert len(results["plain"].output_ids) == 20
    assert state["num_jump_forward_tokens"] > 6 * 8


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_one_string_language_same_text_as_plain_decoding(tiny_runtime_model, tokenizer, overlap):
    """Without jump-forward the model spells the one allowed string in tokens of its choice; with it the backend
    does: the token ids may differ, the text may not."""
    params = {"temperature": 0, "max_new_tokens": 80, "json_schema": json.dumps(CONST_SCHEMA)}
    jobs = [(f"r{i}", p, params) for i, p in enumerate(PROMPTS[:2])]
    texts = {}
    for jump in (False, True):
        results, state = _run(tiny_runtime_model, tokenizer, jobs, enable_jump_forward=jump,
                              overlap_schedule=overlap)
        for rid, _, _ in jobs:
            out = results[rid]
            assert out.finish_reason["type"] == "stop", out
            texts[jump, rid] = _answer(tokenizer, out.output_ids)
        if jump:
            assert state["decode_batches"] <= 4, state  # the first token, one jump, EOS
    for rid, _, _ in jobs:
        assert texts[True, rid] == texts[False, rid]
        assert json.loads(texts[True, rid]) == CONST_VALUE


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_max_new_tokens_stop_strings_and_logprobs(tiny_runtime_model, tokenizer, overlap):
    schema = json.dumps(CONST_SCHEMA)
    jobs = [("short", PROMPTS[0], {"temperature": 0, "max_new_tokens": 5, "json_schema": schema}),
            ("stop", PROMPTS[1], {"temperature": 0, "max_new_tokens": 80, "json_schema": schema,
                                  "stop": ["version"]}),
            ("full", PROMPTS[0], {"temperature": 0, "max_new_tokens": 80, "json_schema": schema})]
    results, state = _run(tiny_runtime_model, tokenizer, jobs, enable_jump_forward=True, overlap_schedule=overlap)
    short = results["short"]
    assert len(short.output_ids) == 5 and short.finish_reason["type"] == "length", short
    full = _answer(tokenizer, results["full"].output_ids)
    assert json.loads(full) == CONST_VALUE and full.startswith(tokenizer.decode(short.output_ids))
    stop = results["stop"]
    assert stop.finish_reason == {"type": "stop", "matched": "version"}, stop
    assert "version" in tokenizer.decode(stop.output_ids) and "tags" not in tokenizer.decode(stop.output_ids)
    assert state["num_jump_forward_tokens"] > 0

    # logprobs: every output token was sampled (one decode step each after the first) and has its logprob
    h = Harness(tiny_runtime_model, tokenizer=tokenizer, eos=(EOS,), enable_jump_forward=True,
                overlap_schedule=overlap)
    h.submit("lp", PROMPTS[2], {"temperature": 0, "max_new_tokens": 80, "json_schema": schema},
             return_logprob=True)
    out = h.run()["lp"]
    assert json.loads(_answer(tokenizer, out.output_ids)) == CONST_VALUE
    assert len(out.meta["output_token_logprobs"]) == len(out.output_ids)
    assert h.scheduler.stats.decode_steps - (len(out.output_ids) - 1) in ((0, 1) if overlap == "on" else (0,))
    assert h.scheduler.internal_state()["num_jump_forward_tokens"] == 0


def test_refused_where_unsupported():
    for flags, named in [({"pp_size": 2}, "--pp-size 2"), ({"tp_size": 2}, "--tp-size 2"),
                         ({"disaggregation_mode": "prefill"}, "--disaggregation-mode prefill"),
                         ({"grammar_backend": "none"}, "--grammar-backend none")]:
        with pytest.raises(ConfigError, match=f"--enable-jump-forward is not supported with {named}"):
            ServerArgs(enable_jump_forward=True, **flags).validate()


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_abort_while_jumping_and_requeue_for_want_of_kv(tiny_runtime_model, tokenizer, overlap):
    """A request aborted while it waits for its jump extend ends with its KV freed; one whose extend does not fit
    in the KV pool is re-queued (recomputed) and still answers the one allowed string."""
    params = {"temperature": 0, "max_new_tokens": 80, "json_schema": json.dumps(CONST_SCHEMA)}
    h = Harness(tiny_runtime_model, tokenizer=tokenizer, eos=(EOS,), enable_jump_forward=True,
                overlap_schedule=overlap)

    def jumping(harness) -> bool:
        return any(lane.jumping for lane in harness.scheduler.lanes)

    h.submit("aborted", PROMPTS[0], params)
    h.run(until=jumping)
    h.abort("aborted")
    assert h.run()["aborted"].finish_reason["type"] == "abort"

    h.submit("requeued", PROMPTS[1], params)
    h.run(until=jumping)
    memory = h.scheduler.jump.memory
    real, asked = memory.available_tokens, []

    def full_once() -> int:  # the pool looks full to the next question, the jump extend's
        asked.append(1)
        return 0 if len(asked) == 1 else real()

    memory.available_tokens = full_once
    out = h.run()["requeued"]
    assert out.finish_reason["type"] == "stop" and json.loads(_answer(tokenizer, out.output_ids)) == CONST_VALUE
    state = h.scheduler.internal_state()
    assert state["num_jump_forward_requeued"] == 1 and state["num_retracted_reqs"] == 1, state
    assert h.scheduler.flush_cache().success and all_kv_free(h.runner)
