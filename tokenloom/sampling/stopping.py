"""When a request stops generating: its new-token budget and the stop rule, each decided here only.

Budget. A prompt of n tokens leaves `new_token_room(n, window)` = window - n - 1 new tokens in a window of
`window` tokens: prompt plus new tokens stay below it (SGLang's rule). Two checks use that one sum:
- the frontend refuses (HTTP 400) a request whose max_new_tokens exceeds the room left in the model's context
  (`TokenizerManager._check_length`);
- the scheduler clamps max_new_tokens to the room left in the context and the KV pool on arrival
  (`Scheduler._validate`), so a request alone always fits; the prefill side of a disaggregated server caps
  it at one token (`PrefillDisaggregation.add`).
`cap_new_tokens` is the only code that rewrites max_new_tokens (and min_new_tokens with it) after
`SamplingParams.verify` accepted them.

Stop rule (`finish_reason`), after each new output token, in this order:
- reaching max_new_tokens finishes with "length", unless the same token also stops the request (a stop on the
  last allowed token is reported as a stop);
- below min_new_tokens nothing else stops it;
- an EOS id (unless ignore_eos), then a stop token id, then a stop string in the tail of the decoded output
  finish with "stop".
With no output yet only the length part applies: max_new_tokens 0 (prompt scoring) finishes right after the
prefill, before any token is taken. `SamplingBatchInfo.finish_candidates` is a vectorized filter in front of
this rule, never a second rule: every request it leaves out gets None here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from tokenloom.finish_reason import finish_length, finish_stop
from tokenloom.sampling.sampling_params import SamplingParams

# Output tokens decoded to look for stop strings: as many as the longest stop string has characters (every
# token decodes to at least one), plus a margin for a token whose text changes once its neighbours decode with it.
STOP_TAIL_EXTRA_TOKENS = 2


def new_token_room(prompt_len: int, window: int) -> int:
    """How many new tokens a prompt of `prompt_len` tokens leaves in a window of `window` tokens (the model's
    context, or the smaller of the context and the KV pool): prompt + new tokens < window."""
    return window - prompt_len - 1


def cap_new_tokens(params: SamplingParams, limit: int) -> None:
    """At most `limit` new tokens (exactly `limit` when max_new_tokens is unset), with min_new_tokens within
    the new maximum."""
    params.max_new_tokens = limit if params.max_new_tokens is None else min(params.max_new_tokens, limit)
    params.min_new_tokens = min(params.min_new_tokens, params.max_new_tokens)


def finish_reason(params: SamplingParams, output_ids: Sequence[int], eos_token_ids: Sequence[int],
                  tail_text: Callable[[int], str] | None = None) -> dict[str, Any] | None:
    """The finish reason of a request with these outputs so far, or None while it runs on. `tail_text(k)`
    decodes the last k output tokens; without it stop strings are not checked (the caller has none)."""
    n = len(output_ids)
    limit = params.max_new_tokens
    length = finish_length(limit) if limit is not None and n >= limit else None
    if n == 0 or n < params.min_new_tokens:
        return length
    token = output_ids[-1]
    if not params.ignore_eos and token in eos_token_ids:
        return finish_stop(token)
    if params.stop_token_ids and token in params.stop_token_ids:
        return finish_stop(token)
    if params.stop and tail_text is not None:
        longest = max(len(s) for s in params.stop)
        text = tail_text(min(n, longest + STOP_TAIL_EXTRA_TOKENS))
        for stop in params.stop:
            if stop in text:
                return finish_stop(stop)
    return length
