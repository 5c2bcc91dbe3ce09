"""The grammar that makes a model call a tool: `tool_choice: "required"` (one or more calls of the offered
functions) or a named function (calls of that one), in the format `--tool-call-parser` reads, each call's
arguments held to the function's JSON schema.

The grammar is an xgrammar structural tag (JSON): per function a tag `begin(name)` + arguments + `end`,
tags joined by the format's separator (`stop_after_first` unless parallel calls are allowed), wrapped in the
format's opening and closing text. Nothing but calls can be written, and the answer can end only after a
whole call, so the parser always finds at least one valid call. Whitespace inside the arguments is at most
one character per gap: unbounded, a model can pad a call with whitespace until max_tokens. Built here as plain
data; the grammar backend compiles it like any `structural_tag`.
"""

from __future__ import annotations

import json
from typing import Any

from tokenloom.function_call.core import ToolFormat


def forced_call_tag(fmt: ToolFormat, tools: list[dict[str, Any]], choice: str, parallel: bool) -> dict[str, Any]:
    """The structural tag for `choice` ("required", or the name of the function to call)."""
    forced = fmt.forced_calls()
    if forced is None:
        raise ValueError(f"tool_choice {choice!r} cannot be enforced with --tool-call-parser {fmt.name} (its "
                         "arguments are not JSON); use tool_choice 'auto'")
    functions = [t["function"] for t in tools if choice == "required" or t["function"]["name"] == choice]
    tags = []
    for fn in functions:
        schema = fn.get("parameters") or {"type": "object"}
        content = ({"type": "qwen_xml_parameter", "json_schema": schema} if forced.style == "qwen_xml"
                   else {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 1})
        names = {"name": json.dumps(fn["name"], ensure_ascii=False), "raw_name": fn["name"]}
        tags.append({"type": "tag", "begin": forced.begin.format(**names), "content": content,
                     "end": forced.end.format(**names)})
    calls = {"type": "tags_with_separator", "tags": tags, "separator": forced.separator, "at_least_one": True,
             "stop_after_first": not parallel}
    elements = ([{"type": "const_string", "value": forced.before}] if forced.before else []) + [calls] + \
        ([{"type": "const_string", "value": forced.after}] if forced.after else [])
    return {"type": "structural_tag", "format": elements[0] if len(elements) == 1 else
            {"type": "sequence", "elements": elements}}
