"""The request-field rule (`request_fields`) on the /generate and OpenAI schemas, without a server: every
field SGLang's and vLLM's request schemas declare is classified, the bodies their clients and SGLang's router
send pass, a feature tokenloom lacks is refused naming the field, hints and unknown fields are ignored."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from tests.client_payloads import (
    ACCEPTED,
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    IGNORED_CASES,
    SGLANG_GENERATE_FIELDS,
    UNSUPPORTED_CASES,
    USER,
)
from tokenloom.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from tokenloom.entrypoints.openai.serving_base import check_common
from tokenloom.entrypoints.openai.serving_chat import ChatServing
from tokenloom.entrypoints.request_fields import LenientRequest, asks_for_something
from tokenloom.entrypoints.serving_generate import GenerateReqInput, batch_rid

SCHEMAS: dict[str, type[LenientRequest]] = {
    "/generate": GenerateReqInput, "/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest}


def parse_and_check(route: str, body: dict[str, Any]) -> LenientRequest:
    req = SCHEMAS[route].model_validate(body)
    req.check_supported()
    if route != "/generate":
        check_common(req)
    return req


def classified(schema: type[LenientRequest]) -> set[str]:
    return set(schema.model_fields) | set(schema.IGNORED) | set(schema.UNSUPPORTED)


@pytest.mark.parametrize("schema, fields", [(GenerateReqInput, SGLANG_GENERATE_FIELDS),
                                            (CompletionRequest, COMPLETION_FIELDS),
                                            (ChatCompletionRequest, CHAT_FIELDS)],
                         ids=["generate", "completions", "chat"])
def test_every_client_field_is_classified(schema, fields):
    assert fields - classified(schema) == set()
    # a field is in one class only
    used, ignored, unsupported = set(schema.model_fields), set(schema.IGNORED), set(schema.UNSUPPORTED)
    assert not used & ignored and not used & unsupported and not ignored & unsupported


@pytest.mark.parametrize("value, default, asks", [
    (None, None, False), (False, None, False), ("", None, False), ([], None, False), ([None, None], None, False),
    ({}, None, False), ("x", None, True), (["a", None], None, True), (True, False, True), (False, False, False),
    ("last", False, True), (0, 0, False), (None, 0, False), (2, 0, True), (False, 0, True), (1, 1.0, False),
    (0.5, 1.0, True), (["text"], ["text"], False), (["text", "audio"], ["text"], True), (True, True, False),
    (False, True, True), (1, True, True),
])
def test_asks_for_something(value, default, asks):
    assert asks_for_something(value, default) is asks


@pytest.mark.parametrize("route, body", ACCEPTED + IGNORED_CASES,
                         ids=[f"{r}-{i}" for i, (r, _) in enumerate(ACCEPTED + IGNORED_CASES)])
def test_client_bodies_pass(route, body):
    parse_and_check(route, body)


@pytest.mark.parametrize("route, body, field", [c for c in UNSUPPORTED_CASES if c[2] != "chat_template_kwargs"],
                         ids=[f"{c[0]}-{c[2]}" for c in UNSUPPORTED_CASES if c[2] != "chat_template_kwargs"])
def test_unsupported_values_are_refused_naming_the_field(route, body, field):
    with pytest.raises(ValueError, match=field):
        parse_and_check(route, body)


def test_null_means_default_only_where_null_is_not_a_value():
    obj = GenerateReqInput.model_validate({"text": "a", "stream": None, "return_logprob": None,
                                           "logprob_start_len": None, "top_logprobs_num": None})
    assert (obj.stream, obj.return_logprob, obj.logprob_start_len, obj.top_logprobs_num) == (False, False, -1, 0)
    req = CompletionRequest.model_validate({"prompt": "a", "max_tokens": None, "n": None, "echo": None})
    assert (req.max_tokens, req.n, req.echo) == (None, 1, False)  # max_tokens null: until the context limit
    with pytest.raises(ValueError):
        CompletionRequest.model_validate({"prompt": None})  # a required field stays required


def test_unknown_fields_are_logged_at_debug(caplog):
    obj = GenerateReqInput.model_validate({"text": "a", "sampling_param": {}, "priority": 1})
    with caplog.at_level(logging.DEBUG, logger="tokenloom.entrypoints.request_fields"):
        obj.check_supported()
    assert "sampling_param" in caplog.text and "priority" not in caplog.text  # priority is a known hint


class TemplateRecorder:
    def __init__(self) -> None:
        self.calls: list[tuple[list[dict[str, Any]], bool, dict[str, Any]]] = []

    def apply_chat_template(self, messages, add_generation_prompt=True, **options):
        self.calls.append((messages, add_generation_prompt, options))
        return "prompt", [1, 2]


def chat_prompt(body: dict[str, Any]) -> tuple[Any, TemplateRecorder]:
    recorder = TemplateRecorder()
    serving = ChatServing(recorder, "m", {})  # type: ignore[arg-type] - only the template is used
    req = ChatCompletionRequest.model_validate(body)
    return serving._prompt(req, serving._messages(req)), recorder


def test_chat_template_controls_reach_the_template():
    prefill = USER + [{"role": "assistant", "content": "Par"}]
    _, rec = chat_prompt({"messages": prefill, "continue_final_message": True,
                          "chat_template_kwargs": {"enable_thinking": False}, "documents": [{"text": "d"}]})
    assert rec.calls == [([{"role": "user", "content": USER[0]["content"]}, {"role": "assistant", "content": "Par"}],
                          False, {"enable_thinking": False, "continue_final_message": True,
                                  "documents": [{"text": "d"}]})]
    _, rec = chat_prompt({"messages": USER, "add_generation_prompt": False})
    assert rec.calls[0][1:] == (False, {})
    _, rec = chat_prompt({"messages": USER})
    assert rec.calls[0][1:] == (True, {})
    (prompt, ids), rec = chat_prompt({"messages": USER, "input_ids": [5, 6, 7]})
    assert (prompt, ids, rec.calls) == (None, [5, 6, 7], [])  # SGLang's pre-rendered prompt skips the template


@pytest.mark.parametrize("body, fragment", [
    ({"messages": USER, "chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs may not set tokenize"),
    ({"messages": USER, "continue_final_message": True}, "last message to be the assistant's"),
    ({"messages": USER + [{"role": "assistant", "content": "x"}], "continue_final_message": True,
      "add_generation_prompt": True}, "cannot both be true"),
])
def test_chat_template_controls_refused(body, fragment):
    with pytest.raises(ValueError, match=fragment):
        chat_prompt(body)


@pytest.mark.parametrize("body, rid", [
    ({"text": ["a", "b"], "rid": "r"}, ["r_0", "r_1"]),
    ({"input_ids": [[1], [2], [3]], "rid": "r"}, ["r_0", "r_1", "r_2"]),
    ({"text": "a", "rid": "r"}, "r"),
    ({"input_ids": [1, 2], "rid": "r"}, "r"),
    ({"text": ["a", "b"], "rid": ["x", "y"]}, ["x", "y"]),
    ({"text": ["a", "b"]}, None),
])
def test_one_string_rid_names_a_batch(body, rid):
    assert batch_rid(GenerateReqInput.model_validate(body)) == rid
