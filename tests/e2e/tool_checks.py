"""Shared pieces of the tool-calling end-to-end tests (test_tool_calls.py, test_tool_calls_families.py): the
offered tools, the conversation with a tool call and its result fed back, and the judges: `jsonschema` on each
call's arguments, the assembly of a streamed answer's `delta.tool_calls` (checking OpenAI's stream shape on the
way), and the messages as transformers' template renderer sees them (arguments as objects, as the server passes
them to the template)."""

from __future__ import annotations

import json
from typing import Any

import pytest

jsonschema = pytest.importorskip("jsonschema")

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                                         "b": {"type": "integer", "minimum": -99, "maximum": 99}},
        "required": ["a", "b"], "additionalProperties": False}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
USER = [{"role": "user", "content": "What is the weather in Oslo, and what is 2 + 3?"}]
# USER, then an assistant call of `add` and its result fed back as a tool turn.
HISTORY = USER + [
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "5"}]


def check_calls(calls: Any, allowed: set[str]) -> None:
    """At least one call, each of an allowed function, with arguments valid under its schema."""
    assert calls, "no tool call"
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in allowed, call.function.name
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def assemble_stream(stream: Any) -> tuple[list[tuple[str, str]], str | None, str, str]:
    """(calls as (name, arguments), finish_reason, content, reasoning_content) of a streamed answer. Checks
    OpenAI's shape: per call index the first delta carries id, type and name with empty arguments, later
    deltas only argument fragments of a call already named."""
    calls: dict[int, list[str]] = {}
    finish, content, reasoning = None, "", ""
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        reasoning += getattr(delta, "reasoning_content", None) or ""
        for d in delta.tool_calls or []:
            if d.id is not None:
                assert d.index == len(calls) and d.function.name and d.function.arguments == "", d
                calls[d.index] = [d.function.name, ""]
            else:
                assert d.index in calls, f"arguments before the name of call {d.index}"
                calls[d.index][1] += d.function.arguments
        finish = chunk.choices[0].finish_reason or finish
    return [(name, args) for name, args in calls.values()], finish, content, reasoning


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` as the server hands them to the chat template: tool-call arguments parsed into objects."""
    return [dict(m, tool_calls=[{**c, "function": {**c["function"], "arguments": json.loads(
        c["function"]["arguments"])}} for c in m["tool_calls"]]) if m.get("tool_calls") else m
        for m in messages]
