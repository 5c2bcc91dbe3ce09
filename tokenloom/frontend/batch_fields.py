"""The per-prompt fields of a request that may carry a batch of prompts (/generate's lists, the OpenAI
`n`): request ids, the common `n`, `logprob_start_len` and `token_ids_logprob`, checked and spread over the
prompts; each raises ValueError with the client-facing message (a 400)."""

from __future__ import annotations

from typing import Any

MAX_N = 128  # OpenAI's bound on n


def batch_rids(rid: Any, count: int, is_batch: bool) -> list[str | None]:
    """One request id per prompt (None: the server makes them): a string for one prompt, a list for a batch."""
    if rid is None:
        return [None] * count
    rids = rid if isinstance(rid, list) else [rid]
    if isinstance(rid, list) and not is_batch:
        raise ValueError("rid must be a string for a single prompt")
    if len(rids) != count:
        raise ValueError(f"rid must be a list with one id per prompt ({count}) for a batch")
    if not all(isinstance(r, str) and r for r in rids):
        raise ValueError("rid must be a non-empty string")
    return rids


def common_n(params: list[dict[str, Any]]) -> int:
    """The `n` every prompt's sampling params share (1 to MAX_N)."""
    ns = [p.get("n", 1) for p in params]
    for n in ns:
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"n must be a positive integer, got {n!r}")
        if n > MAX_N:
            raise ValueError(f"n must be at most {MAX_N}, got {n}")
    if len(set(ns)) > 1:
        raise ValueError(f"All requests in a batch must use the same n; got n values {sorted(set(ns))}")
    return ns[0]


def check_logprob_start_len(value: Any) -> None:
    """-1 (output logprobs only) or a prompt position."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"logprob_start_len must be an integer, got {value!r}")
    if value < -1:
        raise ValueError(f"logprob_start_len must be -1 (output logprobs only) or a prompt position >= 0, "
                         f"got {value}")


def per_prompt_token_ids(token_ids: Any, count: int, is_batch: bool) -> list[Any]:
    """`token_ids_logprob` for each of `count` prompts: a list of ids is shared, a list of lists (batch
    only) gives each prompt its own; checked per prompt by the tokenizer manager."""
    if token_ids is None or not isinstance(token_ids, list) or not token_ids or not isinstance(token_ids[0], list):
        return [token_ids] * count
    if not is_batch:
        raise ValueError("token_ids_logprob must be a list of token ids for a single prompt")
    if len(token_ids) != count:
        raise ValueError(f"token_ids_logprob has {len(token_ids)} lists for {count} prompts")
    return token_ids
