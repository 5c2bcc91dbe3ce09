"""`LogprobAccumulator`: one request's logprobs as the caller sees them, built from the scheduler's messages.

The scheduler sends output logprobs per message for that message's new tokens, and prompt logprobs once (in
the first message after the prefill). The accumulator keeps both and puts the whole lists into every output,
in SGLang's meta_info shape: entries are [logprob, token_id, text] triples (text null here; the /generate
route fills it for `return_text_in_logprobs`), top-k and token_ids_logprob positions are lists of triples.

- `output_token_logprobs`, `output_top_logprobs` (top_logprobs_num > 0), `output_token_ids_logprobs`
  (token_ids_logprob given): one entry per output token;
- with `logprob_start_len` k >= 0: `input_token_logprobs` for prompt positions k..n-1, whose first logprob
  is null (SGLang: nothing computed scores position k), and `input_top_logprobs` / `input_token_ids_logprobs`
  whose first position is null. They are empty lists until the prompt logprobs arrive.
A logprob of -inf (a token that cannot be produced) becomes LOGPROB_FLOOR so the response stays valid JSON.
"""

from __future__ import annotations

import math
from typing import Any

LOGPROB_FLOOR = -9999.0


def triple(logprob: float | None, token_id: int) -> list[Any]:
    """SGLang's [logprob, token_id, text] entry; -inf or NaN becomes a finite floor, None stays None."""
    if logprob is None:
        return [None, int(token_id), None]
    value = float(logprob)
    return [value if math.isfinite(value) else LOGPROB_FLOOR, int(token_id), None]


class LogprobAccumulator:
    def __init__(self, input_logprobs: bool = False, top_logprobs: bool = False,
                 token_ids_logprob: list[int] | None = None) -> None:
        self.token_ids = token_ids_logprob
        self.output: dict[str, list[Any]] = {}
        self.input: dict[str, list[Any]] | None = None
        if input_logprobs:
            self.input = {"input_token_logprobs": []}
            if top_logprobs:
                self.input["input_top_logprobs"] = []
            if token_ids_logprob is not None:
                self.input["input_token_ids_logprobs"] = []

    def apply(self, meta: dict[str, Any]) -> None:
        """Fold one message's logprobs in and replace them in `meta` by the lists so far."""
        for key, convert in (("output_token_logprobs", self._pairs), ("output_top_logprobs", self._top),
                             ("output_token_ids_logprobs", self._token_ids)):
            if key in meta:
                kept = self.output.setdefault(key, [])
                kept.extend(convert(meta[key]))
                meta[key] = list(kept)
        if self.input is None:
            return
        if "input_token_logprobs" in meta:  # the one message that carries them
            self.input["input_token_logprobs"] = self._pairs(meta["input_token_logprobs"])
            if "input_top_logprobs" in self.input:
                self.input["input_top_logprobs"] = self._top(meta["input_top_logprobs"])
            if "input_token_ids_logprobs" in self.input:
                self.input["input_token_ids_logprobs"] = self._token_ids(meta["input_token_ids_logprobs"])
        for key, value in self.input.items():
            meta[key] = list(value)

    @staticmethod
    def _pairs(pairs: list[tuple[float | None, int]]) -> list[list[Any]]:
        return [triple(lp, tid) for lp, tid in pairs]

    @staticmethod
    def _top(positions: list[list[tuple[float, int]] | None]) -> list[list[list[Any]] | None]:
        return [None if pos is None else [triple(lp, tid) for lp, tid in pos] for pos in positions]

    def _token_ids(self, positions: list[list[float] | None]) -> list[list[list[Any]] | None]:
        ids = self.token_ids or []
        return [None if pos is None else [triple(lp, tid) for lp, tid in zip(pos, ids, strict=True)]
                for pos in positions]
