"""Tool-call formats whose arguments are a JSON object the model writes out (streamed as it is written).

- `llama3` (Llama 3.1/3.2 JSON tool calling): `{"name": f, "parameters": {...}}`, optionally after
  `<|python_tag|>`, several separated by `;` or whitespace.
- `qwen25` / `hermes` (Qwen2.5, Qwen3, Hermes): `<tool_call>{"name": f, "arguments": {...}}</tool_call>`.
- `mistral`: `[TOOL_CALLS] [{"name": f, "arguments": {...}}, ...]`, or the newer
  `[TOOL_CALLS]f[ARGS]{...}` per call.
- `deepseekv3`: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f` newline, a ```json fence
  holding the arguments, `<｜tool▁call▁end｜>` ... `<｜tool▁calls▁end｜>`.

Each scan is prefix-stable (see core.py): content grows only at its end, text that may still become a marker is
held back, and a call's arguments are the raw text of its JSON value as far as it goes. An object that turns
out not to be a call (no string name) is content from its start.
"""

from __future__ import annotations

from tokenloom.function_call.core import (
    ForcedCalls,
    PartialCall,
    Scan,
    ToolFormat,
    call_from_object,
    held_back,
    json_value_end,
    skip_space,
)


def _tail(text: str, start: int, final: bool, markers: tuple[str, ...], after_calls: bool) -> str:
    """Plain text from `start` to the end, less what may be a marker's beginning; text after calls loses its
    leading whitespace (the separator the model writes between a call and anything after it)."""
    tail = text[start:]
    if not final:
        tail = tail[:len(tail) - held_back(tail, markers)]
    return tail.lstrip() if after_calls else tail


class HermesFormat(ToolFormat):
    name = "qwen25"
    START, END = "<tool_call>", "</tool_call>"

    def forced_calls(self) -> ForcedCalls:
        return ForcedCalls('<tool_call>\n{{"name": {name}, "arguments": ', "}}\n</tool_call>", "\n")

    def call_markers(self) -> tuple[str, ...]:
        return (self.START,)

    def scan(self, text: str, final: bool) -> Scan:
        content, calls, i = "", [], 0
        while True:
            j = text.find(self.START, i)
            if j < 0:
                return Scan(content + _tail(text, i, final, (self.START,), bool(calls)), calls)
            between = text[i:j]
            content += between.lstrip() if calls else between
            k = skip_space(text, j + len(self.START))
            if k >= len(text):
                if final:
                    return Scan(content + text[j:], calls)
                return Scan(content, calls + [PartialCall(j)])
            if text[k] != "{":
                return Scan(content + text[j:], calls)  # not a call after all
            call, end = call_from_object(text, k)
            call.start = j
            if end is not None and call.name is None:
                return Scan(content + text[j:], calls)
            if end is None:
                call.complete = False
                return Scan(content, calls + [call])
            close = text.find(self.END, end)
            if close < 0:
                call.complete = final
                return Scan(content, calls + [call])
            calls.append(call)
            i = close + len(self.END)


class Llama3Format(ToolFormat):
    name = "llama3"
    TAG = "<|python_tag|>"

    def forced_calls(self) -> ForcedCalls:
        return ForcedCalls('{{"name": {name}, "parameters": ', "}}", "; ")

    def call_markers(self) -> tuple[str, ...]:
        return (self.TAG, "{")

    def scan(self, text: str, final: bool) -> Scan:
        s = skip_space(text, 0)
        if text.startswith(self.TAG, s):
            content, i = "", s + len(self.TAG)
        elif s < len(text) and text[s] == "{":
            content, i = "", s
        else:
            j = text.find(self.TAG)
            if j < 0:
                if not final and self.TAG.startswith(text[s:]):
                    return Scan("")  # nothing but space, or a tag's beginning
                return Scan(_tail(text, 0, final, (self.TAG,), False))
            content, i = text[:j], j + len(self.TAG)
        calls: list[PartialCall] = []
        while True:
            k = skip_space(text, i)
            if k < len(text) and text[k] == ";":
                k = skip_space(text, k + 1)
            if k >= len(text):
                return Scan(content, calls)
            if text[k] != "{":
                return Scan(content + text[k:], calls)
            call, end = call_from_object(text, k)
            if end is not None and call.name is None:
                return Scan(content + text[k:], calls)
            calls.append(call)
            if end is None:
                return Scan(content, calls)
            i = end


class MistralFormat(ToolFormat):
    name = "mistral"
    TAG, ARGS = "[TOOL_CALLS]", "[ARGS]"

    def forced_calls(self) -> ForcedCalls:
        return ForcedCalls("[TOOL_CALLS]{raw_name}[ARGS]", "")

    def call_markers(self) -> tuple[str, ...]:
        return (self.TAG,)

    def scan(self, text: str, final: bool) -> Scan:
        j = text.find(self.TAG)
        if j < 0:
            return Scan(_tail(text, 0, final, (self.TAG,), False))
        content, calls = text[:j], []
        k = skip_space(text, j + len(self.TAG))
        if k < len(text) and text[k] == "[":
            return self._array(text, k, content, final)
        i = j
        while i >= 0:  # [TOOL_CALLS]name[ARGS]{...}, repeated
            k = skip_space(text, i + len(self.TAG))
            a = text.find(self.ARGS, k)
            brace = text.find("{", k)
            if a < 0 and (brace < 0 or not final):
                calls.append(PartialCall(i))
                break
            name_end = a if a >= 0 else brace
            call = PartialCall(i, text[k:name_end].strip())
            v = skip_space(text, name_end + (len(self.ARGS) if a >= 0 else 0))
            end = json_value_end(text, v) if v < len(text) and text[v] == "{" else None
            call.arguments = text[v:end] if end is not None else text[v:]
            call.complete = end is not None
            calls.append(call)
            if end is None:
                break
            i = text.find(self.TAG, end)
        return Scan(content, calls)

    @staticmethod
    def _array(text: str, k: int, content: str, final: bool) -> Scan:
        calls: list[PartialCall] = []
        i = skip_space(text, k + 1)
        while i < len(text) and text[i] != "]":
            if text[i] == ",":
                i = skip_space(text, i + 1)
                continue
            if text[i] != "{":
                break
            call, end = call_from_object(text, i)
            calls.append(call)
            if end is None:
                break
            i = skip_space(text, end)
        return Scan(content, calls)


class DeepSeekV3Format(ToolFormat):
    name = "deepseekv3"
    CALLS_BEGIN, CALL_BEGIN = "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>"
    SEP, CALL_END = "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
    FENCE = "```json"

    def forced_calls(self) -> ForcedCalls:
        return ForcedCalls(self.CALL_BEGIN + "function" + self.SEP + "{raw_name}\n```json\n",
                           "\n```" + self.CALL_END, "", self.CALLS_BEGIN, "<｜tool▁calls▁end｜>")

    def call_markers(self) -> tuple[str, ...]:
        return (self.CALLS_BEGIN, self.CALL_BEGIN)

    def scan(self, text: str, final: bool) -> Scan:
        j = text.find(self.CALLS_BEGIN)
        if j < 0:
            j = text.find(self.CALL_BEGIN)
        if j < 0:
            return Scan(_tail(text, 0, final, (self.CALLS_BEGIN, self.CALL_BEGIN), False))
        content, calls, i = text[:j], [], j
        while True:
            b = text.find(self.CALL_BEGIN, i)
            if b < 0:
                return Scan(content, calls)
            sep = text.find(self.SEP, b)
            if sep < 0:
                return Scan(content, calls + [PartialCall(b)])
            newline = text.find("\n", sep)
            if newline < 0:
                return Scan(content, calls + ([PartialCall(b, text[sep + len(self.SEP):].strip())] if final
                                              else [PartialCall(b)]))
            call = PartialCall(b, text[sep + len(self.SEP):newline].strip())
            brace = text.find("{", newline)
            if brace >= 0:
                end = json_value_end(text, brace)
                call.arguments = text[brace:end] if end is not None else text[brace:]
                call.complete = end is not None
            calls.append(call)
            if not call.complete:
                return Scan(content, calls)
            close = text.find(self.CALL_END, brace)
            if close < 0:
                return Scan(content, calls)
            i = close + len(self.CALL_END)
