"""`SamplingBatchInfo`: the sampling parameters of a batch as device tensors, one row per request.

Built from each request's `SamplingParams`, prompt ids and output ids so far. Holds only what the sampler
reads; penalty state (output token counts, prompt-token mask) is materialised only when some request in the
batch uses a penalty, logit bias only when some request sets one.
Invariant: row i of every tensor belongs to the i-th request of the batch, in batch order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tokenloom.sampling.sampling_params import SamplingParams

# max_new_tokens row of a request without one (the scheduler clamps every request to its context on arrival).
NO_LENGTH_LIMIT = 1 << 62


@dataclass
class SamplingBatchInfo:
    temperatures: torch.Tensor  # [B] float32
    top_ks: torch.Tensor  # [B] int64
    top_ps: torch.Tensor  # [B] float32
    min_ps: torch.Tensor  # [B] float32
    is_greedy: torch.Tensor  # [B] bool
    seeds: torch.Tensor  # [B] int64 (0 where has_seed is False)
    has_seed: torch.Tensor  # [B] bool
    output_lens: torch.Tensor  # [B] int64, tokens generated so far (the seeded stream's position)
    all_greedy: bool
    vocab_size: int
    # Penalties (None when no request in the batch uses them).
    frequency_penalties: torch.Tensor | None = None  # [B]
    presence_penalties: torch.Tensor | None = None  # [B]
    repetition_penalties: torch.Tensor | None = None  # [B]
    output_counts: torch.Tensor | None = None  # [B, V] float32 occurrences in the output
    seen_mask: torch.Tensor | None = None  # [B, V] bool: in the prompt or the output
    logit_bias: torch.Tensor | None = None  # [B, V] float32
    # (rows, token ids) to mask while min_new_tokens is not reached: EOS and each row's own stop ids.
    min_tokens_mask: tuple[torch.Tensor, torch.Tensor] | None = None
    top_logprobs_num: int = 0
    return_logprob: bool = False
    # Stop-condition rows for `finish_candidates` (None only when built by hand, e.g. in sampler tests).
    max_new_tokens: torch.Tensor | None = None  # [B] int64
    min_new_tokens: torch.Tensor | None = None  # [B] int64
    eos_active: torch.Tensor | None = None  # [B] bool: EOS stops the request (not ignore_eos)
    needs_text_check: torch.Tensor | None = None  # [B] bool: stop strings or stop_token_ids to check per token
    # The penalty state was carried from the previous decode step of the same requests, so it already counts
    # every token generated before this step (pending ones included): `add_pending_tokens` is not needed.
    penalties_carried: bool = False
    # Constrained decoding: packed int32 token bitmask of the constrained rows (grammar/mask.py) and which
    # rows they are; filled on the forward side right before sampling (executor/worker.py).
    grammar_bitmask: torch.Tensor | None = None  # [G, ceil(V / 32)] int32
    grammar_rows: torch.Tensor | None = None  # [G] int64

    @classmethod
    def from_requests(cls, params: Sequence[SamplingParams], prompt_ids: Sequence[Sequence[int]],
                      output_ids: Sequence[Sequence[int]], vocab_size: int, eos_token_ids: Sequence[int],
                      device: torch.device, return_logprob: bool = False, top_logprobs_num: int = 0,
                      pending_outputs: Sequence[bool] | None = None) -> SamplingBatchInfo:
        """`pending_outputs[i]` says request i has one more generated token than `output_ids[i]` shows (the
        overlap scheduler has not processed it yet): it counts in `output_lens` and the min-token check, and
        its id is added to the penalty state by `add_pending_tokens` once known."""

        out_lens = [len(o) for o in output_ids]
        if pending_outputs is not None:
            out_lens = [n + int(p) for n, p in zip(out_lens, pending_outputs, strict=True)]
        rows = static_rows(params, vocab_size, device)
        info = cls(temperatures=rows["temperatures"], top_ks=rows["top_ks"], top_ps=rows["top_ps"],
                   min_ps=rows["min_ps"], is_greedy=rows["is_greedy"], seeds=rows["seeds"], has_seed=rows["has_seed"],
                   output_lens=torch.tensor(out_lens, dtype=torch.int64, device=device),
                   all_greedy=all(p.is_greedy for p in params), vocab_size=vocab_size,
                   return_logprob=return_logprob, top_logprobs_num=top_logprobs_num,
                   max_new_tokens=rows["max_new_tokens"], min_new_tokens=rows["min_new_tokens"],
                   eos_active=rows["eos_active"], needs_text_check=rows["needs_text_check"])
        penalty_and_bias_state(info, params, prompt_ids, output_ids, device)
        info.min_tokens_mask = min_tokens_mask(min_token_pairs(params, eos_token_ids, device), rows, info.output_lens)
        return info

    def add_pending_tokens(self, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Count tokens that were generated but not in the output lists this batch was built from (penalty
        state only): pending tokens before sampling, and a decode step's sampled tokens after it, which makes
        the state current for the next step of the same requests."""
        if self.output_counts is None:
            return
        self.output_counts.index_put_((rows, token_ids), torch.ones_like(token_ids, dtype=torch.float32),
                                      accumulate=True)
        self.seen_mask[rows, token_ids] = True

    def finish_candidates(self, next_token_ids: torch.Tensor, eos_token_ids: torch.Tensor) -> list[int] | None:
        """Rows whose new token may finish their request, found with tensor ops over the whole batch. Only a
        filter in front of the stop rule (`sampling.stopping.finish_reason`), never a second rule: every other
        row certainly keeps running (the rule would return None for it), so output processing runs the rule on
        these only, and it decides. The new token is output number `output_lens + 1`. A row is a candidate when
        that reaches max_new_tokens, when it is an EOS id that counts (not ignore_eos, min_new_tokens reached),
        or when the request has stop_token_ids or stop strings (checked by the rule). None: check every row.
        tests/unit/test_finish_candidates.py holds it against the rule on random batches."""
        if self.max_new_tokens is None:
            return None
        count = self.output_lens + 1
        eos_hit = self.eos_active & (count >= self.min_new_tokens) & torch.isin(next_token_ids, eos_token_ids)
        may_finish = (count >= self.max_new_tokens) | eos_hit | self.needs_text_check
        return may_finish.nonzero().flatten().tolist()


def static_rows(params: Sequence[SamplingParams], vocab_size: int, device: torch.device) -> dict[str, torch.Tensor]:
    """The per-request tensors that never change while a request runs."""
    def t(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    return {
        "temperatures": t([p.temperature for p in params], torch.float32),
        "top_ks": t([min(p.top_k if p.top_k > 0 else vocab_size, vocab_size) for p in params], torch.int64),
        "top_ps": t([p.top_p for p in params], torch.float32),
        "min_ps": t([p.min_p for p in params], torch.float32),
        "is_greedy": t([p.is_greedy for p in params], torch.bool),
        "seeds": t([p.sampling_seed % (1 << 63) if p.sampling_seed is not None else 0 for p in params], torch.int64),
        "has_seed": t([p.sampling_seed is not None for p in params], torch.bool),
        "min_new_tokens": t([p.min_new_tokens for p in params], torch.int64),
        "min_tokens_active": t([not p.ignore_eos and p.min_new_tokens > 0 for p in params], torch.bool),
        "max_new_tokens": t([NO_LENGTH_LIMIT if p.max_new_tokens is None else p.max_new_tokens for p in params],
                            torch.int64),
        "eos_active": t([not p.ignore_eos for p in params], torch.bool),
        "needs_text_check": t([bool(p.stop_token_ids) or bool(p.stop) for p in params], torch.bool),
    }


def min_token_pairs(params: Sequence[SamplingParams], eos_token_ids: Sequence[int], device: torch.device
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token) of every token masked while a row is below its min_new_tokens: EOS and its stop ids."""
    rows, tokens = [], []
    for row, p in enumerate(params):
        if not p.ignore_eos and p.min_new_tokens > 0:
            masked = sorted(set(eos_token_ids) | set(p.stop_token_ids or []))
            rows += [row] * len(masked)
            tokens += masked
    return (torch.tensor(rows, dtype=torch.int64, device=device),
            torch.tensor(tokens, dtype=torch.int64, device=device))


def min_tokens_mask(pairs: tuple[torch.Tensor, torch.Tensor], rows: dict[str, torch.Tensor],
                    output_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The (row, token) pairs of `min_token_pairs` whose row is still below its min_new_tokens."""
    row_ids, tokens = pairs
    if not row_ids.numel():
        return None
    below = rows["min_tokens_active"] & (output_lens < rows["min_new_tokens"])
    keep = below[row_ids]
    return (row_ids[keep], tokens[keep]) if bool(keep.any()) else None


def penalty_and_bias_state(info: SamplingBatchInfo, params: Sequence[SamplingParams],
                           prompt_ids: Sequence[Sequence[int]], output_ids: Sequence[Sequence[int]],
                           device: torch.device) -> None:
    """Fill the penalty tensors (when some request uses a penalty) and the logit bias (when some sets one)."""
    vocab_size = info.vocab_size

    def t(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    if any(p.uses_penalties for p in params):
        info.frequency_penalties = t([p.frequency_penalty for p in params], torch.float32)
        info.presence_penalties = t([p.presence_penalty for p in params], torch.float32)
        info.repetition_penalties = t([p.repetition_penalty for p in params], torch.float32)
        info.output_counts = _token_counts(output_ids, vocab_size, device)
        info.seen_mask = (_token_counts(prompt_ids, vocab_size, device) + info.output_counts) > 0
    if any(p.logit_bias for p in params):
        bias = torch.zeros(len(params), vocab_size, dtype=torch.float32, device=device)
        for row, p in enumerate(params):
            for token, value in (p.logit_bias or {}).items():
                bias[row, int(token)] = float(value)
        info.logit_bias = bias


def _token_counts(ids: Sequence[Sequence[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[B, V] float32 histogram of each row's token ids, built with one scatter-add."""
    counts = torch.zeros(len(ids), vocab_size, dtype=torch.float32, device=device)
    lens = torch.tensor([len(x) for x in ids], dtype=torch.int64)
    if int(lens.sum()) == 0:
        return counts
    flat = torch.tensor([tok for row in ids for tok in row], dtype=torch.int64, device=device)
    rows = torch.repeat_interleave(torch.arange(len(ids)), lens).to(device)
    counts.index_put_((rows, flat), torch.ones_like(flat, dtype=torch.float32), accumulate=True)
    return counts
