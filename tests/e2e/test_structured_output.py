"""Structured output end to end: a real server (the tiny random Llama with SmolLM2's tokenizer) and the real
`openai` client. Every constrained answer is checked against an independent judge: `jsonschema` for JSON
schemas, Python's `re.fullmatch` for regexes, `json.loads` for json_object. The model is random, so nothing
but the grammar makes its answers valid; the schemas bound every string, number and array, so each answer
must end (finish_reason "stop") well within max_tokens.

Three servers: overlap scheduling on in bfloat16 (the default dtype) and overlap off in float32 with the default
xgrammar backend, and overlap on with `--grammar-backend outlines` (no EBNF, no structural tags: those are
400s there, checked as such; its `json_object` grammar takes ~11 s to build, once). Each serves the
schema corpus in greedy, sampled, top-k/top-p and penalised modes at once (one batch, mixed with
unconstrained requests), so masks of rows with different grammars, and of rows with none, share steps.
"""

from __future__ import annotations

import json
import math
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.e2e.server_process import ServerProcess, http

jsonschema = pytest.importorskip("jsonschema")

FLAGS = ("--context-length", "2048", "--max-total-tokens", "8192", "--max-running-requests", "64",
         "--chunked-prefill-size", "64", "--num-threads", "1")

SCHEMAS = {
    "flat": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                              "age": {"type": "integer", "minimum": 0, "maximum": 120}},
             "required": ["name", "age"]},
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 999},
            "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 3}},
            "required": ["id", "tags"]}},
        "required": ["user"]},
    "enum_anyof": {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "value": {"anyOf": [{"type": "integer", "minimum": -5, "maximum": 5}, {"type": "boolean"}]}},
        "required": ["color", "value"]},
    "pattern_optional": {"type": "object", "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}, "ok": {"type": "boolean"}},
        "required": ["code"]},
    "array_of_objects": {"type": "array", "items": {
        "type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                         "label": {"type": "string", "maxLength": 4}},
        "required": ["x"]}, "minItems": 1, "maxItems": 3},
    # a string format the grammar enforces exactly ("date" and "ipv4" only in shape: xgrammar allows 2024-04-31
    # and 10.01.0.1, which jsonschema's format checker refuses)
    "format_uuid": {"type": "object", "properties": {"id": {"type": "string", "format": "uuid"}},
                    "required": ["id"]},
}

MODES = {
    "greedy": {"temperature": 0},
    "sampled": {"temperature": 1.0, "seed": 7},
    "top_k_top_p": {"temperature": 0.8, "top_p": 0.9, "extra_body": {"top_k": 20}, "seed": 3},
    "penalties": {"temperature": 0.7, "frequency_penalty": 1.0, "presence_penalty": 0.5,
                  "extra_body": {"repetition_penalty": 1.3}, "seed": 11},
}


@pytest.fixture(scope="module", params=[("on", "bfloat16", "xgrammar"), ("off", "float32", "xgrammar"),
                                        ("on", "bfloat16", "outlines")],
                ids=["overlap_bf16", "no_overlap_fp32", "outlines_overlap_bf16"])
def server(request, tiny_runtime_model):
    overlap, dtype, backend = request.param
    srv = ServerProcess("--model-path", tiny_runtime_model, "--overlap-schedule", overlap, "--dtype", dtype,
                        "--grammar-backend", backend, *FLAGS).wait_healthy(timeout=900)  # a loaded machine is slow
    srv.grammar_backend = backend
    yield srv
    srv.stop()
    assert "Traceback" not in srv.logs(), srv.logs()


@pytest.fixture(scope="module")
def oai(server):
    import openai

    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def _chat(oai, content: str, **kwargs):
    extra = dict(kwargs.pop("extra_body", {}))
    return oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}],
                                       extra_body=extra or None, **kwargs)


def test_schema_corpus_validates_in_every_mode_with_unconstrained_neighbours(oai):
    jobs = []
    for name, schema in SCHEMAS.items():
        for mode, knobs in MODES.items():
            rf = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
            jobs.append((name, mode, dict(response_format=rf, max_tokens=160, **knobs)))
    plain = [dict(max_tokens=24, temperature=0), dict(max_tokens=24, temperature=1.0, seed=5)]
    with ThreadPoolExecutor(len(jobs) + len(plain)) as pool:
        futures = [pool.submit(_chat, oai, f"Describe item {i}", **kw) for i, (_, _, kw) in enumerate(jobs)]
        others = [pool.submit(_chat, oai, "Say something", **kw) for kw in plain]
        answers = [f.result() for f in futures]
        assert all(o.result().choices[0].message.content is not None for o in others)
    valid = 0
    for (name, mode, _), answer in zip(jobs, answers, strict=True):
        choice = answer.choices[0]
        assert choice.finish_reason == "stop", (name, mode, choice.message.content)
        value = json.loads(choice.message.content)
        jsonschema.validate(value, SCHEMAS[name], format_checker=jsonschema.FormatChecker())
        valid += 1
    assert valid >= 20


def test_json_object_answers_parse(oai, tiny_runtime_model):
    # Any JSON object is an unbounded language (free strings and keys), which a random model would not leave;
    # a logit bias towards the closing tokens (a client's knob, not the grammar's) makes it end. The grammar
    # alone decides where they are allowed: the answer must parse.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_runtime_model)
    closing = {str(tok.convert_tokens_to_ids(t)): 100.0 for t in ('"', "}", '"}', '",', "1")}
    for seed in range(3):
        answer = _chat(oai, "A JSON object please", response_format={"type": "json_object"}, max_tokens=200,
                       temperature=1.0, seed=seed, logit_bias=closing)
        choice = answer.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(json.loads(choice.message.content), dict)


def test_regex_on_generate_and_vllm_aliases(server, oai):
    regex = r"[a-z]{2,5}-[0-9]{3}( ok)?"
    for temperature in (0, 1.0):
        status, body = http("POST", server.url + "/generate", {
            "text": "Code:", "sampling_params": {"regex": regex, "max_new_tokens": 40, "temperature": temperature}})
        assert status == 200, body
        assert re.fullmatch(regex, body["text"]), body["text"]
        assert body["meta_info"]["finish_reason"]["type"] == "stop"
    text = oai.completions.create(model="tiny", prompt="Code:", max_tokens=40,
                                  extra_body={"guided_regex": regex}).choices[0].text
    assert re.fullmatch(regex, text), text
    choices = ["yes", "no", "not sure (maybe)"]
    for seed in range(4):
        text = oai.completions.create(model="tiny", prompt="Answer:", max_tokens=20, temperature=1.0, seed=seed,
                                      extra_body={"guided_choice": choices}).choices[0].text
        assert text in choices, text
    schema = SCHEMAS["flat"]
    out = oai.completions.create(model="tiny", prompt="Person:", max_tokens=120, extra_body={"guided_json": schema})
    jsonschema.validate(json.loads(out.choices[0].text), schema)


def test_a_chunked_prompt_takes_its_first_token_from_the_grammar(server):
    # 300 prompt tokens in 64-token chunks: only the last chunk's token is the answer's first
    regex = r"[0-9]{3}"
    for temperature in (0, 1.0):
        status, body = http("POST", server.url + "/generate", {
            "text": "count " * 300, "sampling_params": {"regex": regex, "max_new_tokens": 10,
                                                        "temperature": temperature}})
        assert status == 200, body
        assert body["meta_info"]["prompt_tokens"] > 256
        assert re.fullmatch(regex, body["text"]), body["text"]


def test_ebnf_grammar(server):
    ebnf = 'root ::= "(" item ("," item)* ")"\nitem ::= [0-9] | "x"'
    if server.grammar_backend == "outlines":  # outlines has no EBNF: refused before anything is queued
        status, body = http("POST", server.url + "/generate", {"text": "List:", "sampling_params": {"ebnf": ebnf}})
        assert status == 400 and "ebnf needs --grammar-backend xgrammar or llguidance" in str(body), body
        return
    status, body = http("POST", server.url + "/generate", {
        "text": "List:", "sampling_params": {"ebnf": ebnf, "max_new_tokens": 60, "temperature": 1.0,
                                              "sampling_seed": 1}})
    assert status == 200, body
    if body["meta_info"]["finish_reason"]["type"] == "stop":
        assert re.fullmatch(r"\(([0-9]|x)(,([0-9]|x))*\)", body["text"]), body["text"]
    else:  # the grammar allows any length; what was produced is still a prefix of the language
        assert re.fullmatch(r"\(([0-9]|x)(,([0-9]|x))*,?", body["text"]), body["text"]


def test_logprobs_are_those_of_the_masked_distribution(server):
    # Few tokens start "yes" or "no": all of them are in the top 20, and their probabilities sum to one.
    status, body = http("POST", server.url + "/generate", {
        "text": "Answer:", "return_logprob": True, "top_logprobs_num": 20,
        "sampling_params": {"regex": "(yes|no)", "max_new_tokens": 8, "temperature": 0}})
    assert status == 200, body
    assert body["text"] in ("yes", "no")
    meta = body["meta_info"]
    first_top = meta["output_top_logprobs"][0]
    finite = [(lp, tok) for lp, tok, *_ in first_top if lp is not None and lp > -1e4 and math.isfinite(lp)]
    assert finite, first_top
    assert abs(sum(math.exp(lp) for lp, _ in finite) - 1.0) < 1e-3, finite
    status, unconstrained = http("POST", server.url + "/generate", {
        "text": "Answer:", "return_logprob": True, "top_logprobs_num": 20,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
    free_first = unconstrained["meta_info"]["output_token_logprobs"][0][0]
    chosen = meta["output_token_logprobs"][0][0]
    assert chosen >= free_first - 1e-4  # renormalised over fewer tokens: never less likely than unconstrained


def test_a_grammar_that_cannot_finish_ends_with_length(server, oai):
    answer = _chat(oai, "Describe", max_tokens=4, temperature=0,
                   response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMAS["nested"]}})
    choice = answer.choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.content.startswith("{")
    assert answer.usage.completion_tokens == 4


BAD = [
    ("/generate", {"text": "x", "sampling_params": {"json_schema": '{"type": "strin"}'}}, 'Unsupported type "strin"'),
    ("/generate", {"text": "x", "sampling_params": {"json_schema": "{not json"}}, "json_schema is not valid JSON"),
    ("/generate", {"text": "x", "sampling_params": {"regex": "a("}}, "invalid regex"),
    ("/generate", {"text": "x", "sampling_params": {"ebnf": 'foo ::= "a"'}}, "root rule"),
    ("/generate", {"text": "x", "sampling_params": {"regex": "a", "ebnf": 'root ::= "a"'}}, "only one of"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_schema", "json_schema": {"name": "n"}}},
     "needs a json_schema object with a schema"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_schema",
                                                  "json_schema": {"name": "n", "schema": {"type": "object",
                                                                                          "required": 5}}}},
     "required must be an array"),
    ("/v1/completions", {"prompt": "x", "guided_regex": "[a-", "guided_choice": None}, "invalid regex"),
    ("/v1/completions", {"prompt": "x", "guided_regex": "a", "guided_json": {"type": "object"}},
     "only one structured-output constraint"),
    ("/v1/completions", {"prompt": "x", "response_format": {"type": "structural_tag"}}, "structural_tag"),
]


@pytest.mark.parametrize("route, body, message", BAD, ids=[f"{i}-{b[0]}" for i, b in enumerate(BAD)])
def test_bad_grammars_are_400s_naming_the_problem(server, route, body, message):
    status, answer = http("POST", server.url + route, body)
    assert status == 400, answer
    assert message in str(answer), answer
    status, ok = http("POST", server.url + "/generate", {"text": "x", "sampling_params": {"max_new_tokens": 2}})
    assert status == 200, ok  # the server keeps serving


def test_structural_tag(server, oai):
    tag = {"type": "structural_tag", "structures": [
        {"begin": "<f>", "schema": SCHEMAS["flat"], "end": "</f>"}], "triggers": ["<f>"]}
    status, body = http("POST", server.url + "/generate", {
        "text": "Call:", "sampling_params": {"structural_tag": json.dumps(tag), "max_new_tokens": 60,
                                              "temperature": 0}})
    if server.grammar_backend == "outlines":
        assert status == 400 and "structural_tag needs --grammar-backend xgrammar" in str(body), body
        return
    assert status == 200, body
    for inner in re.findall(r"<f>(.*?)</f>", body["text"], flags=re.S):
        jsonschema.validate(json.loads(inner), SCHEMAS["flat"])
