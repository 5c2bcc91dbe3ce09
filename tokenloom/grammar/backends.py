"""The grammar backends behind `--grammar-backend`: one interface, `GrammarBackend.compile(spec)` -> a
compiled grammar, `new_matcher(compiled)` -> a per-request `Matcher`.

A `Matcher` follows one request's output: `fill(bitmask, row)` writes the tokens allowed next into row `row`
of a packed int32 bitmask (bit t of word t // 32 set: token t allowed), `accept(token)` advances it,
`is_terminated()` says the grammar accepted its end (the stop token was accepted), `rollback(n)` undoes the
last n accepted tokens, `forced_tokens()` lists the tokens the grammar forces next (jump-forward decoding,
`--enable-jump-forward`: scheduler/jump_forward.py) without changing the matcher. A matcher is used by one
thread at a time (the forward side; see executor/worker.py). `jump_pending` is the forward side's mark of a
matcher that accepted forced tokens whose extend has not run yet (executor/worker.py).

Forced tokens: both backends tokenize the forced text themselves (greedy longest match over the vocabulary,
never a stop or special token) and hold back a last token that is a strict prefix of a longer token (the
model may still pick the longer one: mlc-ai/mlc-llm#2551), so the tokens may differ from what the tokenizer's
own encoding or the model would have chosen; xgrammar: `find_jump_forward_tokens` (0.2.9), llguidance:
`compute_ff_tokens`; outlines (grammar/outlines_backend.py) has no such query.

The stop tokens are the server's EOS ids (the model's generation config, not only the tokenizer's): a
grammar allows them exactly where its language may end, so EOS can only end a complete answer.

xgrammar (the default): measured on this project's CPU with SmolLM2's 49k vocabulary, its mask fill takes
2-8 us per request and step against llguidance's 25-60 us, and its compile (1-25 ms, off the critical path and
cached) is the slower of the two; the fill is what every decode step pays. JSON schemas compile without
free whitespace between tokens (`any_whitespace=False`): a small model otherwise may emit whitespace until
max_new_tokens; compact JSON also costs fewer tokens.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

import torch

from tokenloom.grammar.outlines_backend import OutlinesBackend
from tokenloom.grammar.spec import GrammarError, GrammarSpec, first_line

BACKENDS = ("xgrammar", "llguidance", "outlines", "none")
DEFAULT_BACKEND = "xgrammar"


class Matcher(Protocol):
    def fill(self, bitmask: torch.Tensor, row: int) -> None: ...

    def accept(self, token: int) -> bool: ...

    def is_terminated(self) -> bool: ...

    def rollback(self, n: int) -> None: ...

    def forced_tokens(self) -> list[int]: ...

    jump_pending: bool


class GrammarBackend(Protocol):
    name: str

    def compile(self, spec: GrammarSpec) -> Any: ...

    def new_matcher(self, compiled: Any) -> Matcher: ...


class XGrammarMatcher:
    __slots__ = ("m", "jump_pending")

    def __init__(self, matcher: Any) -> None:
        self.m = matcher
        self.jump_pending = False

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.m.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        return self.m.accept_token(token)

    def is_terminated(self) -> bool:
        return self.m.is_terminated()

    def rollback(self, n: int) -> None:
        self.m.rollback(n)

    def forced_tokens(self) -> list[int]:
        return list(self.m.find_jump_forward_tokens())


class XGrammarBackend:
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=list(eos_token_ids))
        # one compile thread: compilation runs on the compiler's worker thread, beside the model's OpenMP team
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)

    def compile(self, spec: GrammarSpec) -> Any:
        c = self._compiler
        try:
            if spec.kind in ("json_schema", "json_object"):  # json_object: the schema {"type": "object"}
                return c.compile_json_schema(spec.text, any_whitespace=False)
            if spec.kind == "regex":
                return c.compile_regex(spec.text)
            if spec.kind == "ebnf":
                return c.compile_grammar(spec.text)
            return c.compile_structural_tag(spec.text)
        except Exception as e:  # noqa: BLE001 - the reason goes back to the client
            raise GrammarError(f"invalid {spec.kind}: {first_line(str(e))}") from None

    def new_matcher(self, compiled: Any) -> Matcher:
        return XGrammarMatcher(self._xgr.GrammarMatcher(compiled))


class LLGuidanceMatcher:
    __slots__ = ("m", "_fill", "jump_pending")

    def __init__(self, matcher: Any) -> None:
        from llguidance.torch import fill_next_token_bitmask

        self.m = matcher
        self.jump_pending = False
        self._fill = fill_next_token_bitmask

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self._fill(self.m, bitmask, row)

    def accept(self, token: int) -> bool:
        return self.m.consume_token(token)

    def is_terminated(self) -> bool:
        return self.m.is_stopped()

    def rollback(self, n: int) -> None:
        self.m.rollback(n)

    def forced_tokens(self) -> list[int]:
        return list(self.m.compute_ff_tokens())


class LLGuidanceBackend:
    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        import llguidance
        import llguidance.hf

        self._ll = llguidance
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size,
                                                       eos_token=eos_token_ids[0] if eos_token_ids else None)

    def compile(self, spec: GrammarSpec) -> Any:
        ll = self._ll.LLMatcher
        try:
            if spec.kind == "json_schema":
                grammar = ll.grammar_from_json_schema(spec.text, defaults={"whitespace_flexible": False})
            elif spec.kind == "json_object":
                grammar = ll.grammar_from_json_schema(json.dumps({"type": "object"}),
                                                      defaults={"whitespace_flexible": False})
            elif spec.kind == "regex":
                grammar = ll.grammar_from_regex(spec.text)
            elif spec.kind == "ebnf":
                grammar = ll.grammar_from_lark(self._ll.gbnf_to_lark(spec.text))
            else:
                raise GrammarError("structural_tag needs --grammar-backend xgrammar")
        except GrammarError:
            raise
        except Exception as e:  # noqa: BLE001
            raise GrammarError(f"invalid {spec.kind}: {first_line(str(e))}") from None
        error = ll.validate_grammar(grammar, self._tokenizer)
        if error:
            raise GrammarError(f"invalid {spec.kind}: {first_line(error)}")
        return grammar

    def new_matcher(self, compiled: Any) -> Matcher:
        matcher = self._ll.LLMatcher(self._tokenizer, compiled)
        if matcher.is_error():
            raise GrammarError(f"grammar failed to start: {matcher.get_error()}")
        return LLGuidanceMatcher(matcher)


def make_backend(name: str, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]) -> GrammarBackend | None:
    """The backend `--grammar-backend name` selects (None for "none": grammars are refused)."""
    if name == "none":
        return None
    cls = {"xgrammar": XGrammarBackend, "llguidance": LLGuidanceBackend, "outlines": OutlinesBackend}.get(name)
    if cls is not None:
        try:
            return cls(tokenizer, vocab_size, eos_token_ids)
        except ImportError as e:
            hint = {"xgrammar": " --no-deps xgrammar==0.2.9", "outlines": " outlines-core"}.get(name, f" {name}")
            raise ValueError(f"--grammar-backend {name} needs the {name} package (pip install{hint}; "
                             f"scripts/setup.sh installs it): {e}") from None
    raise ValueError(f"--grammar-backend must be one of {', '.join(BACKENDS)}, got {name!r}")
