"""Tool calls in model output, streamed and whole, from one scan of the text.

A `ToolFormat` reads the text a model produced so far and says what it holds (`scan`): the plain content,
and the tool calls begun, each with its name once the name is whole and its arguments as far as they are
known. `ToolCallStream` feeds it the text one delta at a time and emits what is new: content, a call's
name (with `arguments: ""`), then argument fragments, in OpenAI's `delta.tool_calls` shape. The
non-streamed parse is the same stream fed the whole text at once, so a streamed answer's assembled calls
equal the non-streamed parse at every split point, provided each format's scan is *prefix-stable*:
- the content of a prefix of the text is a prefix of the content of the whole text;
- a call's name, once reported, never changes; its arguments of a prefix are a prefix of its arguments of
  the whole text (formats whose arguments are rebuilt, not copied, report them only once the call is whole).
`ToolCallStream` checks both and raises `ScanError` if a format breaks them (a bug, caught by the tests'
split-point sweep). Text that can still turn into a call marker is held back until it cannot.

A call naming a function the request did not offer is not a call: from its start, the rest of the output is
content (what SGLang's detectors do with unknown names).
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field


class ScanError(RuntimeError):
    """A format's scan was not prefix-stable (a programming error, never the model's output)."""


@dataclass
class PartialCall:
    """A call as far as the text shows it. `start`: offset of its marker in the text."""

    start: int
    name: str | None = None
    arguments: str = ""
    complete: bool = False


@dataclass
class Scan:
    content: str  # the plain text, held back where a marker may be starting
    calls: list[PartialCall] = field(default_factory=list)


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object's text, as the model wrote it (or rebuilt as JSON by the format)
    id: str = ""


@dataclass
class ToolCallDelta:
    """One entry of OpenAI's streamed `delta.tool_calls`: the first for an index carries id and name."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class StreamDelta:
    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)


class ToolFormat(ABC):
    """One model family's way of writing tool calls."""

    name: str = ""

    @abstractmethod
    def scan(self, text: str, final: bool) -> Scan:
        """What `text` holds; `final`: no more text will come (nothing needs holding back)."""

    def call_markers(self) -> tuple[str, ...]:
        """Strings whose presence means the model began a call (for a quick `has_tool_call`)."""
        return ()

    def forced_calls(self) -> ForcedCalls | None:
        """How a grammar writes calls in this format (tool_choice required / a named function), or None when
        the format's arguments cannot be described by a JSON schema grammar."""
        return None


@dataclass(frozen=True)
class ForcedCalls:
    """A format's calls as text around each call's arguments: `before` + begin(name) + <arguments as JSON,
    or as the format's XML parameters when `style` is "qwen_xml"> + end(name), calls joined by
    `separator`, all of it + `after`. `{name}` in begin/end is the function's name (JSON-escaped where
    the format writes it inside a JSON string)."""

    begin: str
    end: str
    separator: str = ""
    before: str = ""
    after: str = ""
    style: str = "json"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallStream:
    """Feeds a format the output text delta by delta and emits what each delta adds."""

    def __init__(self, fmt: ToolFormat, tool_names: set[str] | None = None) -> None:
        self.fmt = fmt
        self.tool_names = tool_names
        self.text = ""
        self.content_sent = ""
        self.ids: list[str] = []
        self.names: list[str] = []
        self.args_sent: list[str] = []

    def feed(self, delta: str, final: bool = False) -> StreamDelta:
        self.text += delta
        scan = self._accept_known(self.fmt.scan(self.text, final))
        out = StreamDelta()
        if not scan.content.startswith(self.content_sent):
            raise ScanError(f"{self.fmt.name}: content {scan.content!r} does not extend {self.content_sent!r}")
        out.content, self.content_sent = scan.content[len(self.content_sent):], scan.content
        for index, call in enumerate(scan.calls):
            if call.name is None:
                break  # later calls cannot be reported before this one has its name
            if index == len(self.names):
                self.ids.append(new_call_id())
                self.names.append(call.name)
                self.args_sent.append("")
                out.calls.append(ToolCallDelta(index, self.ids[index], call.name, ""))
            elif call.name != self.names[index]:
                raise ScanError(f"{self.fmt.name}: call {index} renamed {self.names[index]!r} -> {call.name!r}")
            sent = self.args_sent[index]
            if not call.arguments.startswith(sent):
                raise ScanError(f"{self.fmt.name}: arguments {call.arguments!r} do not extend {sent!r}")
            if len(call.arguments) > len(sent):
                out.calls.append(ToolCallDelta(index, arguments=call.arguments[len(sent):]))
                self.args_sent[index] = call.arguments
        return out

    def _accept_known(self, scan: Scan) -> Scan:
        """Turn the first call naming an unknown function, and all after it, into content."""
        if self.tool_names is None:
            return scan
        for i, call in enumerate(scan.calls):
            if call.name is not None and call.name not in self.tool_names:
                return Scan(scan.content + self.text[call.start:], scan.calls[:i])
        return scan

    def calls(self) -> list[ToolCall]:
        return [ToolCall(name, args or "{}", call_id)
                for name, args, call_id in zip(self.names, self.args_sent, self.ids, strict=True)]


def parse_whole(fmt: ToolFormat, text: str, tool_names: set[str] | None = None) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a finished output: the stream fed everything at once."""
    stream = ToolCallStream(fmt, tool_names)
    delta = stream.feed(text, final=True)
    return delta.content, stream.calls()


# --- helpers the formats share -------------------------------------------------------------------------

def held_back(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a marker (it may yet become one)."""
    best = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:k]):
                best = k
                break
    return best


def json_value_end(text: str, start: int) -> int | None:
    """End offset of the JSON object, array or string starting at `start` (after its closing character), or
    None when the text ends first. Other values (numbers, literals) end at the next delimiter seen."""
    if start >= len(text):
        return None
    opener = text[start]
    if opener == '"':
        i = start + 1
        while i < len(text):
            if text[i] == "\\":
                i += 2
                continue
            if text[i] == '"':
                return i + 1
            i += 1
        return None
    if opener not in "{[":
        for i in range(start, len(text)):
            if text[i] in ",}] \n\t\r":
                return i
        return None
    depth, i, in_string = 0, start, False
    while i < len(text):
        ch = text[i]
        if in_string:
            if ch == "\\":
                i += 1
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


def skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


@dataclass
class ObjectScan:
    """A JSON object's members as far as the text goes: raw value text per key, and which are whole."""

    values: dict[str, str]
    whole: set[str]
    end: int | None  # offset after the closing brace, None while open


def scan_object(text: str, start: int) -> ObjectScan:
    """Read the members of the object whose `{` is at `start`, tolerating a text that stops anywhere."""
    values: dict[str, str] = {}
    whole: set[str] = set()
    i = skip_space(text, start + 1)
    while i < len(text):
        if text[i] == "}":
            return ObjectScan(values, whole, i + 1)
        if text[i] == ",":
            i = skip_space(text, i + 1)
            continue
        if text[i] != '"':
            return ObjectScan(values, whole, None)  # not JSON as expected: stop reading
        key_end = json_value_end(text, i)
        if key_end is None:
            break
        try:
            key = json.loads(text[i:key_end])
        except ValueError:
            break
        i = skip_space(text, key_end)
        if i >= len(text) or text[i] != ":":
            break
        i = skip_space(text, i + 1)
        if i >= len(text):
            break
        end = json_value_end(text, i)
        if end is None:
            values[key] = text[i:]
            break
        values[key], i = text[i:end], skip_space(text, end)
        whole.add(key)
    return ObjectScan(values, whole, None)


def call_from_object(text: str, start: int, name_keys: tuple[str, ...] = ("name",),
                     args_keys: tuple[str, ...] = ("arguments", "parameters")) -> tuple[PartialCall, int | None]:
    """A call written as one JSON object {"name": ..., "arguments": {...}}: (the call so far, end offset)."""
    obj = scan_object(text, start)
    call = PartialCall(start)
    for key in name_keys:
        if key in obj.whole:
            try:
                name = json.loads(obj.values[key])
            except ValueError:
                name = None
            call.name = name if isinstance(name, str) else None
            break
    for key in args_keys:
        if key in obj.values:
            raw = obj.values[key]
            if raw.startswith('"'):  # arguments given as a JSON string: known only once whole
                if key in obj.whole:
                    try:
                        call.arguments = str(json.loads(raw))
                    except ValueError:
                        call.arguments = raw
            else:
                call.arguments = raw
            break
    call.complete = obj.end is not None
    if call.complete and not any(k in obj.values for k in args_keys):
        call.arguments = "{}"
    return call, obj.end
