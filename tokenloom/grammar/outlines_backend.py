"""`--grammar-backend outlines`: SGLang's outlines backend, on outlines-core (no dependencies; the `outlines`
package itself is not needed). A JSON schema becomes a regex (`build_regex_from_schema`: one optional space
where JSON allows whitespace, so a small model cannot pad an answer with whitespace until max_new_tokens), a
regex an `Index`: a DFA over the vocabulary's token bytes, built at compile time (off the scheduler's critical
path, cached by the compiler like any compiled grammar), and each request's `Guide` walks it. No EBNF and no
structural tags (so no tool_choice required / named): those are 400s naming the backends that have them; and
no forced-token query, so `--enable-jump-forward` refuses this backend. outlines-core's regex for an integer
ignores its bounds, so a bounded integer is given to it as the enum of its values (`bounded_integers_as_enums`)
and bounds it cannot spell that way are a 400, never an answer outside the schema. `json_object` (any JSON
object) builds a large DFA: ~11 s with SmolLM2's vocabulary, once (cached).

The vocabulary is given as token bytes (`token_bytes`): byte-level BPE spellings (GPT-2's scheme) are read
back to bytes, SentencePiece ones by its rules ("\u2581" a space, "<0xHH>" a byte). outlines-core knows one EOS
id; the matcher allows every server stop token where the language may end.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from tokenloom.grammar.spec import JSON_OBJECT_SCHEMA, GrammarError, GrammarSpec, first_line

MAX_ROLLBACK = 16  # tokens a matcher can take back (the benchmarks' and tests' probes roll back a few)
MAX_ENUMERATED_INTEGERS = 1024  # a bounded integer range up to this size is spelled as an enum
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")


class OutlinesMatcher:
    """A matcher over outlines-core's `Guide` (a DFA over the vocabulary). outlines-core knows one EOS id: the
    others of the server's stop tokens are allowed wherever it allows its own (where the language may end),
    and accepting any of them there terminates the matcher."""

    __slots__ = ("guide", "stop_ids", "terminated", "jump_pending")

    def __init__(self, guide: Any, stop_ids: tuple[int, ...]) -> None:
        self.guide = guide
        self.stop_ids = stop_ids
        self.terminated = False
        self.jump_pending = False

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        words = bitmask[row]
        self.guide.write_mask_into(words.data_ptr(), words.numel(), words.element_size())
        if self.guide.is_finished():
            for t in self.stop_ids:
                if t < 32 * words.numel():
                    words[t // 32] |= _bit(t % 32)

    def accept(self, token: int) -> bool:
        if self.terminated:
            return False
        if token in self.stop_ids:
            self.terminated = self.guide.is_finished()
            return self.terminated
        try:
            self.guide.advance(token)
        except ValueError:  # a token the DFA has no transition for
            return False
        return True

    def is_terminated(self) -> bool:
        return self.terminated

    def rollback(self, n: int) -> None:
        if n and self.terminated:  # the stop token was not a guide step
            self.terminated, n = False, n - 1
        if n:
            self.guide.rollback_state(n)

    def forced_tokens(self) -> list[int]:
        return []  # outlines-core offers no forced-token query (--enable-jump-forward refuses this backend)


def _bit(position: int) -> int:
    """Bit `position` of an int32 word as a Python int of that signed word (bit 31 is the sign)."""
    return 1 << position if position < 31 else -(1 << 31)


def token_bytes(tokenizer: Any) -> tuple[dict[bytes, list[int]], int]:
    """({bytes a token decodes to: its ids}, tokens left out) for every token of `tokenizer` that is not a
    special token. Byte-level BPE vocabularies (GPT-2's scheme: each byte spelled as one printable character)
    are read back through that scheme; otherwise SentencePiece's: "▁" is a space and "<0xHH>" the byte HH. A
    token that fits neither is left out (the grammar can never produce it)."""
    spelled = _byte_level_chars()
    special = set(tokenizer.all_special_ids)
    vocab = {t: i for t, i in tokenizer.get_vocab().items() if i not in special}
    byte_level = all(c in spelled for t in vocab for c in t)
    out: dict[bytes, list[int]] = {}
    skipped = 0
    for text, i in vocab.items():
        if byte_level:
            data = bytes(spelled[c] for c in text)
        elif len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
            data = bytes([int(text[3:5], 16)])
        else:
            data = text.replace("\u2581", " ").encode()
        if not data:
            skipped += 1
            continue
        out.setdefault(data, []).append(i)
    return out, skipped


def _byte_level_chars() -> dict[str, int]:
    """GPT-2's byte-level alphabet: printable Latin-1 bytes stand for themselves, every other byte b for the
    character 256 + (its rank among those bytes)."""
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    table, shifted = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


class OutlinesBackend:
    """outlines-core (SGLang's `outlines` backend is outlines'): JSON schemas become a regex
    (`build_regex_from_schema`, one optional space where JSON allows whitespace), a regex becomes an `Index`
    over the vocabulary (built up front at compile time, cached like any compiled grammar). It has no EBNF and
    no structural tags (tool_choice required / named): those are 400s naming the backends that have them."""

    name = "outlines"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        import outlines_core
        from outlines_core.json_schema import build_regex_from_schema

        self._oc = outlines_core
        self._schema_regex = build_regex_from_schema
        self.stop_ids = tuple(t for t in eos_token_ids if t < vocab_size)
        if not self.stop_ids:
            raise ValueError("the outlines grammar backend needs an EOS token id")
        tokens, _ = token_bytes(tokenizer)
        tokens = {b: [i for i in ids if i < vocab_size and i not in self.stop_ids] for b, ids in tokens.items()}
        self._vocabulary = outlines_core.Vocabulary(self.stop_ids[0], {b: ids for b, ids in tokens.items() if ids})

    def compile(self, spec: GrammarSpec) -> Any:
        if spec.kind in ("ebnf", "structural_tag"):
            raise GrammarError(f"{spec.kind} needs --grammar-backend xgrammar"
                               + (" or llguidance" if spec.kind == "ebnf" else "")
                               + " (outlines compiles JSON schemas and regexes)")
        try:
            text = JSON_OBJECT_SCHEMA if spec.kind == "json_object" else spec.text
            if spec.kind == "json_schema":
                text = json.dumps(bounded_integers_as_enums(json.loads(text)))
            regex = text if spec.kind == "regex" else self._schema_regex(text)
            return self._oc.Index(regex, self._vocabulary)
        except GrammarError:
            raise
        except Exception as e:  # noqa: BLE001 - the reason goes back to the client
            raise GrammarError(f"invalid {spec.kind}: {first_line(str(e))}") from None

    def new_matcher(self, compiled: Any) -> OutlinesMatcher:
        return OutlinesMatcher(self._oc.Guide(compiled, max_rollback=MAX_ROLLBACK), self.stop_ids)


def bounded_integers_as_enums(schema: Any, where: str = "schema") -> Any:
    """`schema` with every bounded integer ({"type": "integer", "minimum": 0, "maximum": 120}) replaced by the
    enum of its values: outlines-core's regex for an integer ignores the bounds (an answer of -6199 for that
    one), an enum is exact. A range of more than MAX_ENUMERATED_INTEGERS values, a half-open one, or bounds on a
    non-integer number cannot be spelled so: a GrammarError naming where (a 400), never an unchecked answer."""
    if isinstance(schema, list):
        return [bounded_integers_as_enums(s, f"{where}[{i}]") for i, s in enumerate(schema)]
    if not isinstance(schema, dict):
        return schema
    out = {k: bounded_integers_as_enums(v, f"{where}.{k}") for k, v in schema.items()}
    bounds = {k: out.pop(k) for k in _BOUNDS if k in out}
    if not bounds:
        return out
    if out.get("type") != "integer":
        raise GrammarError(f"--grammar-backend outlines cannot enforce {', '.join(bounds)} at {where} (only on "
                           "integers, as an enum of at most 1024 values): use xgrammar or llguidance")
    lo = bounds.get("minimum", bounds["exclusiveMinimum"] + 1 if "exclusiveMinimum" in bounds else None)
    hi = bounds.get("maximum", bounds["exclusiveMaximum"] - 1 if "exclusiveMaximum" in bounds else None)
    if lo is None or hi is None or hi - lo + 1 > MAX_ENUMERATED_INTEGERS:
        raise GrammarError(f"--grammar-backend outlines cannot enforce the integer range at {where} (it spells a "
                           f"bounded range of at most {MAX_ENUMERATED_INTEGERS} values as an enum): use xgrammar "
                           "or llguidance")
    step = bounds.get("multipleOf", 1)
    values = [v for v in range(int(lo), int(hi) + 1) if v % step == 0]
    if not values:
        raise GrammarError(f"the integer range at {where} holds no value")
    out.pop("type")
    out["enum"] = values
    return out
