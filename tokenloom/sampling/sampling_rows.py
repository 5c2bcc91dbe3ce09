"""`SamplingRows`: a batch's sampling tensors kept across steps and updated only when the batch changes.

`SamplingBatchInfo.from_requests` rebuilds every tensor from Python lists; at thousands of running requests
that is a per-step loop over requests. `SamplingRows` keeps one row per request of the previous batch:
- a decode batch with exactly the previous decode batch's requests (the steady state) reuses every static
  tensor and advances `output_lens` by one — no Python loop over requests;
- otherwise rows of requests that stay are gathered with one `index_select`, rows of new requests are built
  once from their `SamplingParams`, and rows of requests that left are dropped.
The min-new-tokens mask is derived each step from `output_lens` with tensor ops (rows whose count is below
their minimum keep their (row, token) pairs). Penalty state (output-token counts, seen-token mask) and logit
bias exist only for batches that use them: built from the requests' token lists when the batch changes,
and in the steady state carried from the previous step (`penalties_carried`), whose sampled tokens the
forward side counted into it right after sampling (`ModelWorker.execute`). Every mutation of carried state
happens on the forward side, in step order; the scheduler side only hands the tensors on.

Invariant: the result equals `SamplingBatchInfo.from_requests` for the same requests once the forward side
has counted the tokens it is responsible for (tested).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tokenloom.sampling.sampling_batch import (
    SamplingBatchInfo,
    min_token_pairs,
    min_tokens_mask,
    penalty_and_bias_state,
    static_rows,
)

_STATIC = ("temperatures", "top_ks", "top_ps", "min_ps", "is_greedy", "seeds", "has_seed", "min_new_tokens",
           "min_tokens_active", "max_new_tokens", "eos_active", "needs_text_check")

# Penalty and bias tensors handed from one steady-state decode step to the next.
_CARRIED = ("frequency_penalties", "presence_penalties", "repetition_penalties", "output_counts", "seen_mask",
            "logit_bias")


class SamplingRows:
    def __init__(self, vocab_size: int, eos_token_ids: Sequence[int], device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.device = device
        self._reqs: list = []
        self._static: dict[str, torch.Tensor] = {}
        self._min_pairs = (torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64))
        self._output_lens = torch.empty(0, dtype=torch.int64)
        self._last_was_decode = False
        self._any_penalty = self._any_bias = self._all_greedy = False
        self._carried: SamplingBatchInfo | None = None  # the last decode step's info, for its penalty state
        self.rebuilds = 0  # how often the rows were (partly) rebuilt, for tests and profiling

    def info_for(self, reqs: Sequence, is_decode: bool, return_logprob: bool = False, top_logprobs_num: int = 0
                 ) -> SamplingBatchInfo:
        """Sampling tensors for `reqs` (objects with `sampling_params`, `origin_input_ids`, `output_ids` and
        `pending_tokens`, the generated tokens not in `output_ids` yet)."""
        steady = is_decode and self._last_was_decode and list(reqs) == self._reqs
        if steady:
            self._output_lens = self._output_lens + 1
        else:
            self._rebuild(reqs)
        self._last_was_decode = is_decode
        s = self._static
        info = SamplingBatchInfo(
            temperatures=s["temperatures"], top_ks=s["top_ks"], top_ps=s["top_ps"], min_ps=s["min_ps"],
            is_greedy=s["is_greedy"], seeds=s["seeds"], has_seed=s["has_seed"], output_lens=self._output_lens,
            all_greedy=self._all_greedy, vocab_size=self.vocab_size, return_logprob=return_logprob,
            top_logprobs_num=top_logprobs_num, max_new_tokens=s["max_new_tokens"],
            min_new_tokens=s["min_new_tokens"], eos_active=s["eos_active"], needs_text_check=s["needs_text_check"])
        info.min_tokens_mask = min_tokens_mask(self._min_pairs, s, self._output_lens)
        if self._any_penalty or self._any_bias:
            if steady and self._carried is not None:
                carried = self._carried
                for name in _CARRIED:
                    setattr(info, name, getattr(carried, name))
                info.penalties_carried = True
            else:
                params = [r.sampling_params for r in reqs]
                outputs = [r.output_ids for r in reqs]
                penalty_and_bias_state(info, params, [r.origin_input_ids for r in reqs], outputs, self.device)
        self._carried = info if is_decode else None
        return info

    def _rebuild(self, reqs: Sequence) -> None:
        self.rebuilds += 1
        old_row = {id(r): i for i, r in enumerate(self._reqs)}
        positions = [old_row.get(id(r), -1) for r in reqs]
        new_idx = [i for i, p in enumerate(positions) if p < 0]
        fresh = static_rows([reqs[i].sampling_params for i in new_idx], self.vocab_size, self.device)
        if len(new_idx) == len(reqs):
            self._static = fresh
        else:
            kept_idx = [i for i, p in enumerate(positions) if p >= 0]
            take = torch.tensor([positions[i] for i in kept_idx], dtype=torch.int64, device=self.device)
            kept_at = torch.tensor(kept_idx, dtype=torch.int64, device=self.device)
            new_at = torch.tensor(new_idx, dtype=torch.int64, device=self.device)
            merged = {}
            for name in _STATIC:
                old = self._static[name]
                out = torch.empty(len(reqs), dtype=old.dtype, device=self.device)
                out[kept_at] = old.index_select(0, take)
                if new_idx:
                    out[new_at] = fresh[name]
                merged[name] = out
            self._static = merged
        self._reqs = list(reqs)
        lens = [len(r.output_ids) + r.pending_tokens for r in reqs]
        self._output_lens = torch.tensor(lens, dtype=torch.int64, device=self.device)
        params = [r.sampling_params for r in reqs]
        self._all_greedy = all(p.is_greedy for p in params)
        self._any_penalty = any(p.uses_penalties for p in params)
        self._any_bias = any(p.logit_bias for p in params)
        self._min_pairs = min_token_pairs(params, self.eos_token_ids, self.device)
