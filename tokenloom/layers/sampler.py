"""Sampler: logits -> next token per request, vectorized over the batch.

Order per row: logit bias, repetition penalty (HF rule, over prompt and output tokens), frequency and
presence penalties (over output tokens, OpenAI rule), EOS masking while min_new_tokens is not reached; then
greedy rows take the argmax, the others are divided by their temperature and sampled from the distribution
left by top-k, top-p and min-p.

Sampling is by inverse CDF with one uniform number per row. A row with `sampling_seed` draws that number
from a counter-based hash of (seed, number of tokens generated so far), so its samples do not depend on
which other requests share the batch or on the batch order; other rows draw from the sampler's generator
(`--random-seed`).

Logprobs are those of the model's raw distribution (log_softmax of the logits before any processing),
as vLLM reports them by default; for a constrained row (a grammar's token mask, `info.grammar_bitmask`) the
raw distribution is the masked one, as SGLang reports it: the mask is applied to the logits first, in place
(disallowed tokens -inf), and every mode (greedy, temperature, top-k/p, min-p, penalties, bias) then works
on what the grammar allows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenloom.grammar.mask import apply_bitmask
from tokenloom.kernels import cpu_ops
from tokenloom.sampling.sampling_batch import SamplingBatchInfo

_MASK32 = 0xFFFFFFFF
# top-k values at or below this use torch.topk instead of a full sort of the vocabulary.
_TOPK_FAST_LIMIT = 1024


@dataclass
class SampleOutput:
    next_token_ids: torch.Tensor  # [B] int64
    next_token_logprobs: torch.Tensor | None = None  # [B] float32
    top_logprobs: torch.Tensor | None = None  # [B, K] float32
    top_logprob_ids: torch.Tensor | None = None  # [B, K] int64


def apply_grammar_mask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """-inf into the float32 logits the grammar bitmask disallows (grammar/mask.py), in place; the native
    kernel on the CPU, the torch expression elsewhere."""
    if not cpu_ops.apply_token_bitmask(logits, bitmask, rows):
        apply_bitmask(logits, bitmask, rows)


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax(logits, dim=-1) of [B, V] float32 logits; the native kernel on the CPU gives the same index."""
    if logits.dim() == 2 and logits.dtype == torch.float32 and logits.shape[1] > 0 and cpu_ops.available(logits):
        return cpu_ops.argmax(logits)
    return torch.argmax(logits, dim=-1)


class Sampler:
    def __init__(self, seed: int = 0, device: torch.device | None = None) -> None:
        self.generator = torch.Generator(device=device or "cpu").manual_seed(seed)

    def __call__(self, logits: torch.Tensor, info: SamplingBatchInfo) -> SampleOutput:
        if info.grammar_bitmask is not None:
            if logits.dtype != torch.float32:
                logits = logits.float()
            apply_grammar_mask(logits, info.grammar_bitmask, info.grammar_rows)
        raw = logits
        logits = apply_logit_processors(logits if logits.dtype == torch.float32 else logits.float(), info)
        next_ids = greedy_argmax(logits) if info.all_greedy else self._sample(logits, info)
        out = SampleOutput(next_token_ids=next_ids)
        if info.return_logprob or info.top_logprobs_num:
            logprobs = torch.log_softmax(raw.float(), dim=-1)
            out.next_token_logprobs = logprobs.gather(1, next_ids[:, None]).squeeze(1)
            if info.top_logprobs_num:
                out.top_logprobs, out.top_logprob_ids = logprobs.topk(info.top_logprobs_num, dim=-1)
        return out

    def _sample(self, logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        greedy_ids = greedy_argmax(logits)
        probs = torch.softmax(logits / info.temperatures[:, None], dim=-1)
        sampled = _sample_filtered(probs, info, self._uniforms(info))
        return torch.where(info.is_greedy, greedy_ids, sampled)

    def _uniforms(self, info: SamplingBatchInfo) -> torch.Tensor:
        batch = info.temperatures.shape[0]
        u = torch.rand(batch, generator=self.generator, dtype=torch.float64,
                       device=self.generator.device).to(info.temperatures.device)
        if bool(info.has_seed.any()):
            u = torch.where(info.has_seed, seeded_uniform(info.seeds, info.output_lens), u)
        return u


def apply_logit_processors(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """Bias, penalties and min_new_tokens masking. Never modifies `logits` in place (returns it unchanged when
    no processor applies)."""
    if info.logit_bias is not None:
        logits = logits + info.logit_bias
    if info.repetition_penalties is not None:
        p = info.repetition_penalties[:, None]
        penalized = torch.where(logits > 0, logits / p, logits * p)
        logits = torch.where(info.seen_mask, penalized, logits)
        logits = logits - info.frequency_penalties[:, None] * info.output_counts
        logits = logits - info.presence_penalties[:, None] * (info.output_counts > 0).float()
    if info.min_tokens_mask is not None:
        logits = logits.clone()  # may still alias the caller's raw logits
        rows, tokens = info.min_tokens_mask
        logits[rows, tokens] = float("-inf")
    return logits


def _sample_filtered(probs: torch.Tensor, info: SamplingBatchInfo, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sample from `probs` restricted by top-k, top-p and min-p, one uniform per row.

    Rows with a rank-based filter (top-k below the vocabulary or top-p below 1) walk their distribution in
    descending order; the others walk it in vocabulary order, without sorting. The choice depends only on
    the row's own parameters, so a seeded row samples the same token whatever shares its batch.
    """
    vocab = probs.shape[1]
    ranked = (info.top_ks < vocab) | (info.top_ps < 1)
    out = torch.empty(probs.shape[0], dtype=torch.int64, device=probs.device)
    plain = (~ranked).nonzero().squeeze(1)
    if plain.numel():
        out[plain] = _sample_vocab_order(probs[plain], info.min_ps[plain], u[plain])
    rows = ranked.nonzero().squeeze(1)
    if rows.numel():
        out[rows] = _sample_ranked(probs[rows], info.top_ks[rows], info.top_ps[rows], info.min_ps[rows], u[rows])
    return out


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index of the first position whose cumulative weight exceeds u * total (zero weights never chosen)."""
    cdf = torch.cumsum(weights.double(), dim=-1)
    target = (u.double() * cdf[:, -1])[:, None]
    return torch.searchsorted(cdf, target, right=True).clamp(max=weights.shape[1] - 1).squeeze(1)


def _sample_vocab_order(probs: torch.Tensor, min_ps: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    keep = probs >= min_ps[:, None] * probs.max(dim=-1, keepdim=True).values
    return _inverse_cdf(torch.where(keep, probs, torch.zeros_like(probs)), u)


def _sample_ranked(probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor, min_ps: torch.Tensor,
                   u: torch.Tensor) -> torch.Tensor:
    k_max = int(top_ks.max()) if bool((top_ps >= 1).all()) else probs.shape[1]
    if k_max <= _TOPK_FAST_LIMIT:
        sorted_probs, sorted_ids = probs.topk(k_max, dim=-1)
    else:
        sorted_probs, sorted_ids = probs.sort(dim=-1, descending=True, stable=True)
    ranks = torch.arange(sorted_probs.shape[1], device=probs.device)[None, :]
    keep = ranks < top_ks[:, None]
    before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass strictly ahead of each token
    keep &= before < top_ps[:, None]
    keep &= sorted_probs >= min_ps[:, None] * sorted_probs[:, :1]
    keep[:, 0] = True  # the most likely token always survives
    pick = _inverse_cdf(torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs)), u)
    return sorted_ids.gather(1, pick[:, None]).squeeze(1)


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 integer hash on values held in int64 (kept to 32 bits after every multiply)."""
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def seeded_uniform(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """A uniform number in (0, 1) determined only by (seed, position): float64 [B]."""
    seeds = seeds.to(torch.int64)
    h = _hash32(_hash32(seeds & _MASK32) ^ _hash32((seeds >> 32) & _MASK32) * 3 + 0x9E3779B9)
    h = _hash32(h ^ _hash32(positions.to(torch.int64) + 0x85EBCA6B))
    h2 = _hash32(h + 0x632BE5AB)
    value = (h.double() * 4294967296.0 + h2.double() + 0.5) / 18446744073709551616.0
    return value
