"""Tool-call formats whose arguments are not JSON as written, rebuilt as a JSON object once a call is whole.

- `pythonic` (Llama 3.2/4 pythonic, many small models): `[f(a=1, b="x"), g()]`, optionally inside
  `<|python_start|>` ... `<|python_end|>`; argument values are Python literals.
- `qwen3_coder` (Qwen3-Coder's XML): `<tool_call><function=f><parameter=a>value</parameter>...</function>
  </tool_call>`; a value is typed by the tool's JSON schema (integer, number, boolean, object, array parsed
  as JSON when they parse; anything else, and every string, kept as text).

A call's name is reported as soon as it is whole; its arguments only when the call closes (they are rebuilt,
so no earlier prefix of them would be stable). Scans are prefix-stable as core.py requires.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from tokenloom.function_call.core import ForcedCalls, PartialCall, Scan, ToolFormat, held_back, skip_space

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")


def _paren_end(text: str, start: int) -> int | None:
    """Offset after the `)` closing the `(` at `start`, skipping Python string literals; None if open."""
    depth, i, quote = 0, start, ""
    while i < len(text):
        ch = text[i]
        if quote:
            if ch == "\\":
                i += 1
            elif ch == quote:
                quote = ""
        elif ch in "\"'":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


def _python_call_arguments(source: str) -> str | None:
    """JSON text of the keyword arguments of one call `f(a=1, ...)`, or None if it is not such a call."""
    try:
        node = ast.parse(source, mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(node, ast.Call) or node.args:
        return None
    try:
        args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
    except ValueError:
        return None
    try:
        return json.dumps(args, ensure_ascii=False)
    except TypeError:  # a literal JSON cannot hold (a set, bytes, a complex number)
        return None


class PythonicFormat(ToolFormat):
    name = "pythonic"
    START, END = "<|python_start|>", "<|python_end|>"

    def call_markers(self) -> tuple[str, ...]:
        return ("[", self.START)

    def scan(self, text: str, final: bool) -> Scan:
        s = skip_space(text, 0)
        if text.startswith(self.START, s):
            s = skip_space(text, s + len(self.START))
        elif s >= len(text) or (not final and self.START.startswith(text[s:])):
            return Scan("")
        if s >= len(text):
            return Scan("")
        if text[s] != "[":
            return Scan(text if final else text[:len(text) - held_back(text, (self.START,))])
        calls: list[PartialCall] = []
        i = skip_space(text, s + 1)
        while i < len(text) and text[i] != "]":
            if text[i] == ",":
                i = skip_space(text, i + 1)
                continue
            m = _IDENT.match(text, i)
            if m is None:
                return Scan("" if calls else text, calls)  # not a call list after all
            paren = skip_space(text, m.end())
            if paren >= len(text):
                if final:
                    calls.append(PartialCall(i, m.group(0)))
                else:
                    calls.append(PartialCall(i))
                break
            if text[paren] != "(":
                return Scan("" if calls else text, calls)
            call = PartialCall(i, m.group(0))
            end = _paren_end(text, paren)
            calls.append(call)
            if end is None:
                break
            # A call whose arguments are not literals keeps its (already reported) name with no arguments.
            call.arguments, call.complete = _python_call_arguments(text[i:end]) or "{}", True
            i = skip_space(text, end)
        return Scan("", calls)


class Qwen3CoderFormat(ToolFormat):
    name = "qwen3_coder"
    START, END = "<tool_call>", "</tool_call>"
    FUNCTION = re.compile(r"<function=([^>\n]+)>")
    PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self.schemas = {t["function"]["name"]: t["function"].get("parameters") or {}
                        for t in tools or [] if isinstance(t, dict) and isinstance(t.get("function"), dict)
                        and "name" in t["function"]}

    def call_markers(self) -> tuple[str, ...]:
        return (self.START,)

    def forced_calls(self) -> ForcedCalls:
        return ForcedCalls("<tool_call>\n<function={raw_name}>\n", "</function>\n</tool_call>", "\n",
                           style="qwen_xml")

    def scan(self, text: str, final: bool) -> Scan:
        j = text.find(self.START)
        if j < 0:
            return Scan(text if final else text[:len(text) - held_back(text, (self.START,))])
        content, calls, i = text[:j], [], j
        while True:
            b = text.find(self.START, i)
            if b < 0:
                return Scan(content, calls)
            m = self.FUNCTION.search(text, b)
            if m is None:
                return Scan(content, calls + [PartialCall(b)])
            call = PartialCall(b, m.group(1).strip())
            close = text.find("</function>", m.end())
            calls.append(call)
            if close < 0:
                if final:
                    call.arguments = self._arguments(call.name or "", text[m.end():])
                return Scan(content, calls)
            call.arguments, call.complete = self._arguments(call.name or "", text[m.end():close]), True
            end = text.find(self.END, close)
            i = end + len(self.END) if end >= 0 else close + len("</function>")

    def _arguments(self, name: str, body: str) -> str:
        props = (self.schemas.get(name) or {}).get("properties") or {}
        args: dict[str, Any] = {}
        for m in self.PARAMETER.finditer(body):
            key, raw = m.group(1).strip(), m.group(2)
            raw = raw[1:] if raw.startswith("\n") else raw
            raw = raw[:-1] if raw.endswith("\n") else raw
            args[key] = _typed(raw, (props.get(key) or {}).get("type"))
        return json.dumps(args, ensure_ascii=False)


def _typed(raw: str, kind: Any) -> Any:
    if kind in ("integer", "number", "boolean", "object", "array", "null"):
        try:
            return json.loads(raw)
        except ValueError:
            return raw
    return raw
