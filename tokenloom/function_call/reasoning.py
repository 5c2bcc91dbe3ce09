"""`--reasoning-parser`: the model's thinking, `<think>` ... `</think>`, split from its answer, whole or
streamed (SGLang's `reasoning_content`).

- `qwen3`: the answer is reasoning only if it opens with `<think>` (a template that renders thinking off
  writes an empty think block into the prompt, so the answer opens with the reply).
- `deepseek-r1`: the template opens the think block in the prompt, so the answer starts as reasoning
  whether or not it repeats `<think>`; everything before `</think>` is reasoning.
An answer that never closes its think block is all reasoning. Streaming holds back text that may be the
start of a tag, so the streamed pieces concatenate to the whole split at every split point.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenloom.function_call.core import held_back

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningStyle:
    name: str
    starts_in_reasoning: bool


REASONING_PARSERS = {
    "qwen3": ReasoningStyle("qwen3", False),
    "deepseek-r1": ReasoningStyle("deepseek-r1", True),
}


def reasoning_style(name: str) -> ReasoningStyle:
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of {', '.join(REASONING_PARSERS)}") \
            from None


def split_reasoning(style: ReasoningStyle, text: str, final: bool = True) -> tuple[str, str]:
    """(reasoning, answer) of `text`; with `final` false, what may still be a tag's beginning is held back."""
    body = text.lstrip()
    opened = body.startswith(START)
    if not final and START.startswith(body):
        return "", ""  # the answer may still open a think block
    if not opened and not style.starts_in_reasoning:
        return "", text if final else text[:len(text) - held_back(text, (START,))]
    if opened:
        body = body[len(START):]
    close = body.find(END)
    if close < 0:
        return (body if final else body[:len(body) - held_back(body, (END,))]).lstrip(), ""
    answer = body[close + len(END):].lstrip()
    return body[:close].lstrip(), answer


class ReasoningStream:
    """Feeds the answer delta by delta; `feed` returns the (reasoning, answer) text each delta adds."""

    def __init__(self, style: ReasoningStyle) -> None:
        self.style = style
        self.text = ""
        self.sent = ("", "")

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        self.text += delta
        reasoning, answer = split_reasoning(self.style, self.text, final)
        # Both parts only grow (a tag is held back until it is whole), so the new text is what follows.
        if not (reasoning.startswith(self.sent[0]) and answer.startswith(self.sent[1])):
            raise RuntimeError(f"{self.style.name}: split of a longer answer does not extend the shorter's")
        new = (reasoning[len(self.sent[0]):], answer[len(self.sent[1]):])
        self.sent = (reasoning, answer)
        return new
