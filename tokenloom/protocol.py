"""Messages between the engine/server process, the scheduler and the detokenizer (pickled over ZMQ).

The chain of a request: `GenerateRequest` (HTTP body / Engine arguments, validated in the tokenizer manager)
→ `TokenizedRequest` (engine → scheduler) → `Req` (scheduler state) → `ScheduleBatch` → `ForwardBatch`
→ `ForwardOutput` → `BatchTokenOutput` (scheduler → detokenizer) → `BatchStrOutput` (detokenizer → engine)
→ `ReqState` → response.

Control messages (`AbortRequest`, `FlushCacheRequest`, `GetInternalStateRequest`) travel engine → scheduler;
their replies travel scheduler → detokenizer → engine unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenloom.sampling.sampling_params import SamplingParams


@dataclass
class TokenizedRequest:
    rid: str
    input_text: str | None
    input_ids: list[int]
    sampling_params: SamplingParams
    stream: bool = False
    return_logprob: bool = False
    logprob_start_len: int = -1  # with return_logprob: prompt logprobs from this position on; -1: none
    top_logprobs_num: int = 0
    arrival_time: float = 0.0
    token_ids_logprob: list[int] | None = None  # with return_logprob: logprobs of these ids at every position


@dataclass
class AbortRequest:
    rid: str
    message: str = "Aborted by the client."


@dataclass
class FlushCacheRequest:
    pass


@dataclass
class FlushCacheReply:
    success: bool
    message: str


@dataclass
class GetInternalStateRequest:
    pass


@dataclass
class InternalStateReply:
    state: dict[str, Any]


@dataclass
class BatchTokenOutput:
    """New tokens of some requests since their last output, plus finish information.

    Per request i: `new_token_ids[i]` (may be empty for a finish-only message), `finished_reasons[i]`
    (None while running; a dict shaped like SGLang's finish_reason otherwise), and `meta[i]` with
    prompt_tokens, completion_tokens, cached_tokens, total_retractions (and logprob lists when asked:
    output ones per message for its new tokens, prompt ones once, in the first message after the prefill).
    """

    rids: list[str]
    new_token_ids: list[list[int]]
    finished_reasons: list[dict[str, Any] | None]
    meta: list[dict[str, Any]]
    # Detokenization options per request (the detokenizer has no other copy of the sampling params).
    skip_special_tokens: list[bool] = field(default_factory=list)
    stop_strings: list[list[str]] = field(default_factory=list)
    no_stop_trim: list[bool] = field(default_factory=list)


@dataclass
class BatchStrOutput:
    """Cumulative text and output ids of some requests (what the client sees so far)."""

    rids: list[str]
    texts: list[str]
    output_ids: list[list[int]]
    finished_reasons: list[dict[str, Any] | None]
    meta: list[dict[str, Any]]


@dataclass
class ProcessFailed:
    """A child process hit an unrecoverable error; sent before it exits so callers fail fast."""

    process: str
    error: str


def finish_length(length: int) -> dict[str, Any]:
    return {"type": "length", "length": length}


def finish_stop(matched: int | str) -> dict[str, Any]:
    return {"type": "stop", "matched": matched}


def finish_abort(message: str, status_code: int = 400, err_type: str = "BadRequestError") -> dict[str, Any]:
    return {"type": "abort", "message": message, "status_code": status_code, "err_type": err_type}
