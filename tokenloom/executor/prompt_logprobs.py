"""Which logits rows an extend step computes, and the prompt logprobs read from them.

By default an extend step computes one row of logits per request: its last token's, for sampling. A request
that wants prompt logprobs (`logprob_start_len` k >= 0, prompt of n tokens) also needs the rows of the prompt
positions p in [k, n-1) that this step computes, since the logits at p score token p+1. `plan_logits` lists,
request by request in batch order, those rows and then the request's last row (one row serves both when the
last row is itself scored, as in a non-final chunk). Requests that do not ask add no rows, and a batch in which
nobody asks gets no plan at all (the model's default last-token rows). `read_logits` splits the rows back into
the sampling logits (one per request) and per-request `InputLogprobChunk`s.

Logprobs are log_softmax in float32 of the raw logits (no temperature, penalties or bias), like the output
logprobs (layers/sampler.py). The plan is built when the step is prepared, from the positions the step computes
(not from state its results will change), so the overlap scheduler may plan a chunk before the previous chunk's
results are processed; chunks are processed in order and each says where it starts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class InputLogprobChunk:
    """Prompt logprobs of one request from one step: entry j scores token `start + j + 1` with the logits at
    position `start + j`."""

    start: int
    values: list[float]
    top: list[list[tuple[float, int]]] | None  # per entry, the top-k (logprob, token id), when asked
    token_ids: list[list[float]] | None  # per entry, the logprobs of the request's token_ids_logprob


@dataclass
class _Span:
    batch_index: int
    start: int  # position of the first scored row
    first: int  # its index among the scored rows of the step
    count: int
    top_k: int
    token_ids: torch.Tensor | None


@dataclass
class LogitPlan:
    rows: torch.Tensor  # [R] indices into the step's tokens whose logits are computed, in order
    sample_index: torch.Tensor  # [B] index into `rows` of each request's last token
    scored_index: torch.Tensor  # [S] indices into `rows` that score a prompt token
    targets: torch.Tensor  # [S] the token each of them scores
    spans: list[_Span]
    batch_size: int


def plan_logits(reqs: Sequence[Any], prefix_lens: Sequence[int], seq_lens: Sequence[int],
                device: torch.device) -> LogitPlan | None:
    """Rows for an extend step in which request i computes positions [prefix_lens[i], seq_lens[i]).

    `reqs[i]` has `wants_input_logprobs`, `logprob_start_len`, `origin_input_ids`, `top_logprobs_num` and
    `token_ids_logprob`. None when no request wants prompt logprobs."""
    if not any(r.wants_input_logprobs for r in reqs):
        return None
    rows: list[int] = []
    sample_index: list[int] = []
    scored: list[int] = []
    targets: list[int] = []
    spans: list[_Span] = []
    token_start = 0
    for i, (req, s, e) in enumerate(zip(reqs, prefix_lens, seq_lens, strict=True)):
        last = token_start + e - s - 1
        if req.wants_input_logprobs:
            prompt = req.origin_input_ids
            a, b = max(s, req.logprob_start_len), min(e, len(prompt) - 1)
            if b > a:
                ids = None if req.token_ids_logprob is None else torch.tensor(
                    req.token_ids_logprob, dtype=torch.int64, device=device)
                spans.append(_Span(i, a, len(scored), b - a, req.top_logprobs_num, ids))
                scored.extend(range(len(rows), len(rows) + b - a))
                rows.extend(range(token_start + a - s, token_start + b - s))
                targets.extend(prompt[a + 1: b + 1])
        if not rows or rows[-1] != last:
            rows.append(last)
        sample_index.append(len(rows) - 1)
        token_start += e - s

    def t(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    return LogitPlan(t(rows), t(sample_index), t(scored), t(targets), spans, len(reqs))


def read_logits(plan: LogitPlan, logits: torch.Tensor) -> tuple[torch.Tensor, list[InputLogprobChunk | None]]:
    """(sampling logits [B, V], per request its prompt logprobs from this step or None) from the plan's rows."""
    sample = logits.index_select(0, plan.sample_index)
    chunks: list[InputLogprobChunk | None] = [None] * plan.batch_size
    if not plan.spans:
        return sample, chunks
    logprobs = torch.log_softmax(logits.index_select(0, plan.scored_index).float(), dim=-1)
    values = logprobs.gather(1, plan.targets[:, None]).squeeze(1).tolist()
    k = max(span.top_k for span in plan.spans)
    top_values = top_ids = None
    if k:
        top = logprobs.topk(k, dim=-1)
        top_values, top_ids = top.values.tolist(), top.indices.tolist()
    for span in plan.spans:
        lo, hi = span.first, span.first + span.count
        top_lists = None
        if span.top_k:
            top_lists = [list(zip(v[: span.top_k], i[: span.top_k], strict=True))
                         for v, i in zip(top_values[lo:hi], top_ids[lo:hi], strict=True)]
        token_ids = None
        if span.token_ids is not None:
            token_ids = logprobs[lo:hi].index_select(1, span.token_ids).tolist()
        chunks[span.batch_index] = InputLogprobChunk(span.start, values[lo:hi], top_lists, token_ids)
    return sample, chunks


def token_ids_logprobs(logits: torch.Tensor, token_ids: Sequence[list[int] | None]) -> list[list[float] | None]:
    """Per row of sampling logits [B, V], the logprobs of that request's `token_ids_logprob` (None: not asked)."""
    rows = [i for i, ids in enumerate(token_ids) if ids is not None]
    out: list[list[float] | None] = [None] * len(token_ids)
    if not rows:
        return out
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    logprobs = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)
    for j, i in enumerate(rows):
        ids = torch.tensor(token_ids[i], dtype=torch.int64, device=logits.device)
        out[i] = logprobs[j].index_select(0, ids).tolist()
    return out
