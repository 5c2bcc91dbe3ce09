"""`SamplingParams`: one request's sampling and stopping parameters, with SGLang's keys and checks.

Built from a user's dict by `SamplingParams.from_dict`, which rejects unknown keys and out-of-range values
with a `SamplingParamsError` (a ValueError, so the HTTP layer answers 400 with the message): every value is
type-checked here, since the scheduler and detokenizer processes use them as they are and a wrong type there
would take the runtime down. After `normalize`, greedy is explicit (`is_greedy`), `top_k` is a positive count
(vocabulary size for "all") and each logit bias lies in [-100, 100] (OpenAI's range, clamped as vLLM does).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

GREEDY_TEMPERATURE = 1e-6
MAX_LOGIT_BIAS = 100.0  # OpenAI's documented range is [-100, 100]; beyond it float32 logits overflow
FLAGS = ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim")


class SamplingParamsError(ValueError):
    """An invalid sampling parameter; the message names the key and the allowed range."""


@dataclass
class SamplingParams:
    max_new_tokens: int | None = 128
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    n: int = 1
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    stream_interval: int | None = None
    logit_bias: dict[str, float] | None = None
    sampling_seed: int | None = None
    # Constrained decoding (tokenloom/grammar/): at most one of these four; stop_regex is refused.
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    stop_regex: str | list[str] | None = None
    structural_tag: str | None = None
    custom_params: dict[str, Any] | None = None
    is_greedy: bool = field(default=False, init=False)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None, vocab_size: int | None = None) -> SamplingParams:
        d = dict(d or {})
        names = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(d) - names)
        if unknown:
            raise SamplingParamsError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        params = cls(**d)
        params.verify(vocab_size)
        params.normalize(vocab_size)
        return params

    def verify(self, vocab_size: int | None = None) -> None:
        def num(name: str, value: Any, integer: bool = False) -> None:
            ok = isinstance(value, int) if integer else isinstance(value, int | float) and _is_finite(value)
            if not ok or isinstance(value, bool):
                kind = "an integer" if integer else "a finite number"
                raise SamplingParamsError(f"{name} must be {kind}, got {value!r}")

        for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty",
                     "repetition_penalty"):
            num(name, getattr(self, name))
        for name in ("top_k", "min_new_tokens", "n"):
            num(name, getattr(self, name), integer=True)
        if self.temperature < 0:
            raise SamplingParamsError(f"temperature must be non-negative, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise SamplingParamsError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise SamplingParamsError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.top_k < 1 and self.top_k != -1:
            raise SamplingParamsError(f"top_k must be -1 (disable) or at least 1, got {self.top_k}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise SamplingParamsError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0 < self.repetition_penalty <= 2:
            raise SamplingParamsError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if self.max_new_tokens is not None:
            num("max_new_tokens", self.max_new_tokens, integer=True)
            if self.max_new_tokens < 0:
                raise SamplingParamsError(f"max_new_tokens must be at least 0, got {self.max_new_tokens}")
        if self.min_new_tokens < 0 or (self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens):
            raise SamplingParamsError(
                f"min_new_tokens must be in [0, max_new_tokens], got {self.min_new_tokens}")
        if self.n < 1:
            raise SamplingParamsError(f"n must be at least 1, got {self.n}")
        if self.stream_interval is not None and (not isinstance(self.stream_interval, int) or isinstance(
                self.stream_interval, bool) or self.stream_interval < 1):
            raise SamplingParamsError(f"stream_interval must be a positive integer, got {self.stream_interval!r}")
        if self.sampling_seed is not None and (not isinstance(self.sampling_seed, int)
                                               or isinstance(self.sampling_seed, bool)):
            raise SamplingParamsError(f"sampling_seed must be an integer, got {self.sampling_seed!r}")
        for name in FLAGS:
            if not isinstance(getattr(self, name), bool):
                raise SamplingParamsError(f"{name} must be a boolean, got {getattr(self, name)!r}")
        if self.custom_params is not None and not isinstance(self.custom_params, dict):
            raise SamplingParamsError(f"custom_params must be an object, got {type(self.custom_params).__name__}")
        self._verify_stops(vocab_size)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise SamplingParamsError("logit_bias must be an object mapping token ids to biases")
            for key, bias in self.logit_bias.items():
                try:
                    token = int(key)
                except (TypeError, ValueError):
                    raise SamplingParamsError(f"logit_bias key {key!r} is not a token id") from None
                if vocab_size is not None and not 0 <= token < vocab_size:
                    raise SamplingParamsError(f"logit_bias token id {token} is outside the vocabulary "
                                              f"(size {vocab_size})")
                num(f"logit_bias[{key}]", bias)
        for name in ("json_schema", "regex", "ebnf", "structural_tag"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise SamplingParamsError(f"{name} must be a string, got {type(getattr(self, name)).__name__}")
        grammars = [k for k in ("json_schema", "regex", "ebnf", "structural_tag") if getattr(self, k) is not None]
        if len(grammars) > 1:
            raise SamplingParamsError(f"only one of json_schema, regex, ebnf and structural_tag may be set, got "
                                      f"{' and '.join(grammars)}")
        if grammars and self.min_new_tokens > 0:
            raise SamplingParamsError(f"min_new_tokens cannot be combined with {grammars[0]}: the grammar decides "
                                      f"where the answer may end")
        if self.stop_regex is not None:
            raise SamplingParamsError("stop_regex is not supported by tokenloom")

    def _verify_stops(self, vocab_size: int | None) -> None:
        if self.stop is not None:
            stops = [self.stop] if isinstance(self.stop, str) else self.stop
            if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
                raise SamplingParamsError("stop must be a string or a list of strings")
            if any(s == "" for s in stops):
                raise SamplingParamsError("stop strings must not be empty")
        if self.stop_token_ids is not None:
            ids = self.stop_token_ids
            if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
                raise SamplingParamsError("stop_token_ids must be a list of integers")
            if vocab_size is not None and any(not 0 <= i < vocab_size for i in ids):
                raise SamplingParamsError(f"stop_token_ids must be token ids in [0, {vocab_size})")

    def normalize(self, vocab_size: int | None = None) -> None:
        if self.temperature < GREEDY_TEMPERATURE:
            self.is_greedy = True
            self.temperature = 1.0
            self.top_k = 1
        if self.top_k == -1 and vocab_size is not None:
            self.top_k = vocab_size
        if self.top_k == 1:
            self.is_greedy = True
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.logit_bias:
            self.logit_bias = {key: min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, float(bias)))
                               for key, bias in self.logit_bias.items()}

    @property
    def stop_strings(self) -> list[str]:
        return list(self.stop or [])

    @property
    def has_grammar(self) -> bool:
        return (self.json_schema is not None or self.regex is not None or self.ebnf is not None
                or self.structural_tag is not None)

    @property
    def uses_penalties(self) -> bool:
        return self.frequency_penalty != 0 or self.presence_penalty != 0 or self.repetition_penalty != 1


def _is_finite(value: int | float) -> bool:
    """math.isfinite, with an int too large for a float (a JSON number of hundreds of digits) not finite."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False
