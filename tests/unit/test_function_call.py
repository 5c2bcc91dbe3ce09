"""Tool-call and reasoning parsers: the whole parse of known outputs, and the streamed parse at every split
point (each character boundary, and the boundaries of a real tokenizer's tokens) assembling to the same
content and calls, with each call's name before its arguments and two calls as two indices
(sgl-project/sglang#37634)."""

from __future__ import annotations

import json

import pytest

from tokenloom.function_call.core import ToolCallStream, parse_whole
from tokenloom.function_call.reasoning import ReasoningStream, reasoning_style, split_reasoning
from tokenloom.function_call.registry import TOOL_CALL_PARSERS, tool_format

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}},
]
NAMES = {"get_weather", "add"}
W = '{"city": "Paris, \\"FR\\" {x}", "days": 3}'

# parser -> [(output text, expected content, expected [(name, arguments dict)])]
CASES: dict[str, list[tuple[str, str, list[tuple[str, dict]]]]] = {
    "qwen25": [
        (f'<tool_call>\n{{"name": "get_weather", "arguments": {W}}}\n</tool_call>', "",
         [("get_weather", json.loads(W))]),
        (f'Let me check.\n<tool_call>\n{{"name": "get_weather", "arguments": {W}}}\n</tool_call>\n<tool_call>\n'
         '{"name": "add", "arguments": {"a": 1, "b": 2.5}}\n</tool_call>', "Let me check.\n",
         [("get_weather", json.loads(W)), ("add", {"a": 1, "b": 2.5})]),
        ("No tools needed: 2 < 3 and <tool is not a tag.", "No tools needed: 2 < 3 and <tool is not a tag.", []),
        ('<tool_call>\n{"name": "unknown_fn", "arguments": {}}\n</tool_call>',
         '<tool_call>\n{"name": "unknown_fn", "arguments": {}}\n</tool_call>', []),
    ],
    "llama3": [
        (f'{{"name": "get_weather", "parameters": {W}}}', "", [("get_weather", json.loads(W))]),
        ('<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "get_weather", '
         '"parameters": {"city": "Oslo"}}', "", [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Oslo"})]),
        ("The answer is 4.", "The answer is 4.", []),
        ('{"answer": 4}', '{"answer": 4}', []),
    ],
    "mistral": [
        (f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {W}}}, {{"name": "add", "arguments": '
         '{"a": 1, "b": 2}}]', "", [("get_weather", json.loads(W)), ("add", {"a": 1, "b": 2})]),
        (f'Sure.[TOOL_CALLS]get_weather[ARGS]{W}[TOOL_CALLS]add[ARGS]{{"a": 5, "b": 6}}', "Sure.",
         [("get_weather", json.loads(W)), ("add", {"a": 5, "b": 6})]),
        ("Plain [answer].", "Plain [answer].", []),
    ],
    "deepseekv3": [
        ("Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
         f"{W}\n```<｜tool▁call▁end｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n```json\n"
         '{"a": 1, "b": 2}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>', "Checking.",
         [("get_weather", json.loads(W)), ("add", {"a": 1, "b": 2})]),
    ],
    "pythonic": [
        ('[get_weather(city="Paris, \\"FR\\" (x)", days=3), add(a=1, b=2.5)]', "",
         [("get_weather", {"city": 'Paris, "FR" (x)', "days": 3}), ("add", {"a": 1, "b": 2.5})]),
        ("<|python_start|>[add(a=1, b=2)]<|python_end|>", "", [("add", {"a": 1, "b": 2})]),
        ("It is sunny.", "It is sunny.", []),
    ],
    "qwen3_coder": [
        ("I will call it.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis <b>\n</parameter>\n"
         "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=add>\n"
         "<parameter=a>\n1.5\n</parameter>\n</function>\n</tool_call>", "I will call it.\n",
         [("get_weather", {"city": "Paris <b>", "days": 3}), ("add", {"a": 1.5})]),
    ],
}


def _stream(parser: str, pieces: list[str]) -> tuple[str, list[tuple[str, str]], list]:
    stream = ToolCallStream(tool_format(parser, TOOLS), NAMES)
    content, calls, deltas = "", {}, []
    for k, piece in enumerate(pieces):
        out = stream.feed(piece, final=k == len(pieces) - 1)
        content += out.content
        for d in out.calls:
            deltas.append(d)
            if d.name is not None:
                assert d.index == len(calls) and d.id and d.arguments == "", d
                calls[d.index] = [d.name, ""]
            else:
                assert d.index in calls, "arguments before the call's name"
                calls[d.index][1] += d.arguments
    return content, [tuple(c) for c in calls.values()], deltas


@pytest.mark.parametrize("parser", sorted(CASES))
def test_whole_parse(parser):
    for text, content, expected in CASES[parser]:
        got_content, calls = parse_whole(tool_format(parser, TOOLS), text, NAMES)
        assert got_content == content, (parser, text)
        assert [(c.name, json.loads(c.arguments)) for c in calls] == expected, (parser, text)
        assert len({c.id for c in calls}) == len(calls)


@pytest.mark.parametrize("parser", sorted(CASES))
def test_streamed_equals_whole_at_every_split(parser):
    for text, _, _ in CASES[parser]:
        whole_content, whole_calls = parse_whole(tool_format(parser, TOOLS), text, NAMES)
        whole = [(c.name, c.arguments) for c in whole_calls]
        for cut in range(len(text) + 1):  # two pieces, every boundary
            assert _stream(parser, [text[:cut], text[cut:]])[:2] == (whole_content, whole), (parser, cut)
        content, calls, deltas = _stream(parser, list(text))  # one character at a time
        assert (content, calls) == (whole_content, whole)
        if len(whole) == 2:
            assert sorted({d.index for d in deltas}) == [0, 1]


@pytest.mark.parametrize("parser", sorted(CASES))
def test_streamed_by_real_tokens(parser):
    from tokenloom.config import ServerArgs
    from tokenloom.models.loader import resolve_model_source
    from tokenloom.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model_source(ServerArgs()))
    for text, _, _ in CASES[parser]:
        ids = tok(text, add_special_tokens=False).input_ids
        pieces, prev = [], ""
        for k in range(1, len(ids) + 1):  # the detokenizer's incremental text
            now = tok.decode(ids[:k])
            if now.endswith("\ufffd") and k < len(ids):
                continue  # an incomplete UTF-8 character: the detokenizer waits for the rest
            pieces.append(now[len(prev):])
            prev = now
        assert prev == text
        whole_content, whole_calls = parse_whole(tool_format(parser, TOOLS), prev, NAMES)
        assert _stream(parser, pieces)[:2] == (whole_content, [(c.name, c.arguments) for c in whole_calls])


def test_json_arguments_stream_before_the_call_ends():
    """JSON formats send argument fragments as they are written, not one blob at the end."""
    text = f'<tool_call>\n{{"name": "get_weather", "arguments": {W}}}\n</tool_call>'
    _, _, deltas = _stream("qwen25", list(text))
    fragments = [d for d in deltas if d.name is None and d.arguments]
    assert len(fragments) > 5


def test_unknown_parser_named():
    with pytest.raises(ValueError, match="unknown tool-call parser 'nope'.*llama3"):
        tool_format("nope")
    assert {"llama3", "qwen25", "mistral", "pythonic", "deepseekv3", "qwen3_coder"} <= set(TOOL_CALL_PARSERS)


REASONING = [
    ("qwen3", "<think>\nThe user wants 2+2.\n</think>\n\nIt is 4.", "The user wants 2+2.\n", "It is 4."),
    ("qwen3", "It is 4.", "", "It is 4."),
    ("qwen3", "<think>\nStill thinking", "Still thinking", ""),
    ("deepseek-r1", "Compute 2+2.</think>\n4", "Compute 2+2.", "4"),
    ("deepseek-r1", "<think>Compute.</think>4", "Compute.", "4"),
]


@pytest.mark.parametrize("case", REASONING)
def test_reasoning_split_whole_and_streamed(case):
    name, text, reasoning, answer = case
    style = reasoning_style(name)
    assert split_reasoning(style, text) == (reasoning, answer)
    for cut in range(len(text) + 1):
        stream = ReasoningStream(style)
        parts = [stream.feed(text[:cut]), stream.feed(text[cut:], final=True)]
        assert ("".join(p[0] for p in parts), "".join(p[1] for p in parts)) == (reasoning, answer), cut


FORCEABLE = ["llama3", "qwen25", "mistral", "deepseekv3", "qwen3_coder"]
# Per parser: a valid forced answer calling get_weather (city Oslo, days 2) then add, and its parse.
FORCED_ANSWERS = {
    "qwen25": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>\n'
              '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
    "llama3": '{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}}; '
              '{"name": "add", "parameters": {"a": 1, "b": 2}}',
    "mistral": '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo", "days": 2}[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}',
    "deepseekv3": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                  '{"city": "Oslo", "days": 2}\n```<｜tool▁call▁end｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>'
                  'add\n```json\n{"a": 1, "b": 2}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n<parameter=days>\n"
                   "2\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=add>\n<parameter=a>\n1\n"
                   "</parameter>\n<parameter=b>\n2\n</parameter>\n</function>\n</tool_call>",
}


@pytest.mark.parametrize("parser", FORCEABLE)
def test_forced_call_grammar_accepts_calls_and_nothing_else(parser):
    """The tool_choice grammar (xgrammar's own matcher as the judge) takes the format's calls, rejects free
    text, a second call when parallel calls are off, an unoffered function and schema-breaking arguments;
    what it takes, the parser reads back as the same calls."""
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string as accepts

    from tokenloom.function_call.forced import forced_call_tag

    fmt = tool_format(parser, TOOLS)
    schema_tools = [{"type": "function", "function": {**t["function"], "parameters": {
        **t["function"]["parameters"], "required": list(t["function"]["parameters"]["properties"])}}} for t in TOOLS]
    both = FORCED_ANSWERS[parser]
    parallel = xgr.Grammar.from_structural_tag(json.dumps(forced_call_tag(fmt, schema_tools, "required", True)))
    single = xgr.Grammar.from_structural_tag(json.dumps(forced_call_tag(fmt, schema_tools, "required", False)))
    named = xgr.Grammar.from_structural_tag(json.dumps(forced_call_tag(fmt, schema_tools, "add", True)))
    assert accepts(parallel, both)
    assert not accepts(single, both)
    assert not accepts(parallel, "Sure, the weather in Oslo is fine.")
    assert not accepts(named, both)  # get_weather is not the named function
    assert not accepts(parallel, both.replace("Oslo", "").replace('"city": "",', "").replace("<parameter=city>\n\n"
                                                                                             "</parameter>\n", ""))
    content, calls = parse_whole(fmt, both, NAMES)
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo", "days": 2}), ("add", {"a": 1, "b": 2})]


def test_pythonic_cannot_be_forced():
    from tokenloom.function_call.forced import forced_call_tag

    with pytest.raises(ValueError, match="cannot be enforced with --tool-call-parser pythonic"):
        forced_call_tag(tool_format("pythonic"), TOOLS, "required", True)
