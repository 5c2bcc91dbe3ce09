"""What a chat answer's text becomes in the response: reasoning (`--reasoning-parser`), tool calls
(`--tool-call-parser`, when the request offered tools and did not say `tool_choice: "none"`) and content.

The reasoning is split off first; tool calls are read from the rest. `whole` serves the non-streamed
response; `ChoiceStream` serves one streamed choice and emits, per text delta, the `delta` fields OpenAI's
stream carries (`reasoning_content`, `content`, `tool_calls` entries: index, id, type and name first, then
argument fragments). Both run the same parsers (tokenloom/function_call), so the assembled stream equals
the whole response.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenloom.function_call.core import ToolCallDelta, ToolCallStream, parse_whole
from tokenloom.function_call.reasoning import ReasoningStream, reasoning_style, split_reasoning
from tokenloom.function_call.registry import tool_format


@dataclass
class ChatOutputRules:
    """How one request's answers are read."""

    tool_parser: str | None  # None: no tool calls are read
    reasoning_parser: str | None
    tools: list[dict[str, Any]] | None
    max_calls: int | None = None  # parallel_tool_calls false: 1

    @property
    def tool_names(self) -> set[str]:
        return {t["function"]["name"] for t in self.tools or []}

    def whole(self, text: str) -> tuple[str | None, str | None, list[dict[str, Any]]]:
        """(content, reasoning_content, tool_calls) of a finished answer."""
        reasoning = None
        if self.reasoning_parser:
            reasoning, text = split_reasoning(reasoning_style(self.reasoning_parser), text)
        calls: list[dict[str, Any]] = []
        if self.tool_parser:
            text, parsed = parse_whole(tool_format(self.tool_parser, self.tools), text, self.tool_names)
            parsed = parsed[:self.max_calls]
            calls = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                     for c in parsed]
        return (text if text or not calls else None), (reasoning or None), calls


class ChoiceStream:
    """One streamed choice: text deltas in, OpenAI `delta` dicts out."""

    def __init__(self, rules: ChatOutputRules) -> None:
        self.reasoning = ReasoningStream(reasoning_style(rules.reasoning_parser)) if rules.reasoning_parser \
            else None
        self.tools = ToolCallStream(tool_format(rules.tool_parser, rules.tools), rules.tool_names) \
            if rules.tool_parser else None
        self.made_calls = False
        self.max_calls = rules.max_calls

    def feed(self, delta: str, final: bool) -> list[dict[str, Any]]:
        reasoning = ""
        if self.reasoning is not None:
            reasoning, delta = self.reasoning.feed(delta, final)
        out: list[dict[str, Any]] = []
        if reasoning:
            out.append({"reasoning_content": reasoning})
        if self.tools is None:
            if delta:
                out.append({"content": delta})
            return out
        parsed = self.tools.feed(delta, final)
        if parsed.content:
            out.append({"content": parsed.content})
        calls = [d for d in parsed.calls if self.max_calls is None or d.index < self.max_calls]
        if calls:
            self.made_calls = True
            out.append({"tool_calls": [_call_delta(d) for d in calls]})
        return out


def _call_delta(d: ToolCallDelta) -> dict[str, Any]:
    if d.name is not None:
        return {"index": d.index, "id": d.id, "type": "function", "function": {"name": d.name, "arguments": ""}}
    return {"index": d.index, "function": {"arguments": d.arguments}}


def check_tools(tools: list[dict[str, Any]] | None, tool_choice: Any) -> str:
    """Validate `tools` and `tool_choice`; return the choice as "none", "auto", "required" or the name of
    the function it forces. Raises ValueError naming the problem (a 400)."""
    names = []
    for i, tool in enumerate(tools or []):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                             "\"parameters\": {...}}}")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
        names.append(fn["name"])
    if tool_choice is None:
        return "auto" if names else "none"
    if tool_choice in ("none", "auto", "required"):
        if tool_choice == "required" and not names:
            raise ValueError("tool_choice 'required' needs at least one tool in `tools`")
        return tool_choice
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ValueError("tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", "
                         "\"function\": {\"name\": ...}}")
    if fn["name"] not in names:
        raise ValueError(f"tool_choice names function {fn['name']!r}, which is not in `tools` "
                         f"({', '.join(names) or 'none given'})")
    return fn["name"]
