"""`SequenceDriver`: runs sequences through a `ModelRunner` directly, without a scheduler.

It allocates request rows and KV slots, builds `ForwardBatch`es for any mix of prefill, chunk and decode
steps, and frees everything on `release`. The one-shot `generate` command and the forward-path tests use it;
the scheduler has its own, batched bookkeeping.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tokenloom.executor.model_runner import ModelRunner
from tokenloom.forward_batch import ForwardBatch, ForwardMode
from tokenloom.layers.sampler import SampleOutput
from tokenloom.sampling.sampling_batch import SamplingBatchInfo
from tokenloom.sampling.sampling_params import SamplingParams


class OutOfKVMemory(RuntimeError):
    """The KV pool or the request table is full."""


@dataclass
class SequenceState:
    row: int
    token_ids: list[int] = field(default_factory=list)  # tokens whose KV is in the pool
    slots: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))


class SequenceDriver:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def start(self) -> SequenceState:
        rows = self.runner.req_to_token_pool.alloc(1)
        if rows is None:
            raise OutOfKVMemory("no free request slot")
        return SequenceState(row=rows[0], slots=torch.empty(0, dtype=torch.int64, device=self.runner.device))

    def release(self, seq: SequenceState) -> None:
        self.runner.token_allocator.free(seq.slots)
        self.runner.req_to_token_pool.free(seq.row)
        seq.slots = seq.slots[:0]
        seq.token_ids = []

    def extend(self, seqs: Sequence[SequenceState], new_tokens: Sequence[Sequence[int]],
               return_all_logits: bool = False, as_decode: bool | None = None,
               pp_proxy: dict[str, torch.Tensor] | None = None) -> torch.Tensor | dict[str, torch.Tensor]:
        """Append `new_tokens[i]` to `seqs[i]` and run them; returns logits (last token or all tokens), or on
        a runner that holds a pipeline stage other than the last, that stage's hidden states and residual.

        Uses decode mode when every sequence adds exactly one token on top of a non-empty cache (unless
        `as_decode` says otherwise), extend mode otherwise. `pp_proxy`: the previous stage's output, the
        input of a stage other than the first (whose `new_tokens` then only give the lengths).
        """
        device = self.runner.device
        prefix = torch.tensor([len(s.token_ids) for s in seqs], dtype=torch.int64, device=device)
        new_lens = torch.tensor([len(t) for t in new_tokens], dtype=torch.int64, device=device)
        seq_lens = prefix + new_lens
        if int(seq_lens.max()) > self.runner.context_len:
            raise ValueError(f"sequence longer than the context length {self.runner.context_len}")
        last = torch.tensor([int(s.slots[-1]) if s.token_ids else 0 for s in seqs], device=device)
        if as_decode is None:
            as_decode = bool((new_lens == 1).all() and (prefix > 0).all())
        alloc = self.runner.token_allocator
        slots = alloc.alloc_decode(seq_lens, last) if as_decode else alloc.alloc_extend(prefix, seq_lens, last)
        if slots is None:
            raise OutOfKVMemory("KV pool is full")
        ids = torch.tensor([t for tokens in new_tokens for t in tokens], dtype=torch.int64, device=device)
        rows = torch.tensor([s.row for s in seqs], dtype=torch.int64, device=device)
        mode = ForwardMode.DECODE if as_decode else ForwardMode.EXTEND
        batch = ForwardBatch.build(mode, ids, rows, prefix, seq_lens, slots, return_all_logits)
        batch.pp_proxy = pp_proxy
        logits = self.runner.forward(batch)
        for seq, part, tokens in zip(seqs, torch.split(slots, new_lens.tolist()), new_tokens, strict=True):
            seq.slots = torch.cat((seq.slots, part))
            seq.token_ids.extend(tokens)
        return logits

    def generate(self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams],
                 eos_token_ids: Sequence[int]) -> list[list[int]]:
        """Prefill all prompts together, then decode them as one batch until each stops (EOS, stop token
        ids or max_new_tokens). Returns the generated ids per prompt; frees all memory."""
        seqs = [self.start() for _ in prompts]
        outputs: list[list[int]] = [[] for _ in prompts]
        try:
            logits = self.extend(seqs, prompts)
            active = list(range(len(prompts)))
            while active:
                sample = self._sample(logits, [params[i] for i in active], [prompts[i] for i in active],
                                      [outputs[i] for i in active], eos_token_ids)
                still = []
                for j, i in enumerate(active):
                    token = int(sample.next_token_ids[j])
                    outputs[i].append(token)
                    if not _finished(token, outputs[i], params[i], eos_token_ids):
                        still.append(i)
                active = still
                if active:
                    logits = self.extend([seqs[i] for i in active], [[outputs[i][-1]] for i in active])
        finally:
            for seq in seqs:
                self.release(seq)
        return outputs

    def _sample(self, logits: torch.Tensor, params: list[SamplingParams], prompts: list, outputs: list,
                eos_token_ids: Sequence[int]) -> SampleOutput:
        info = SamplingBatchInfo.from_requests(params, prompts, outputs, self.runner.vocab_size,
                                               eos_token_ids, self.runner.device)
        return self.runner.sample(logits, info)


def _finished(token: int, output: list[int], params: SamplingParams, eos_token_ids: Sequence[int]) -> bool:
    limit = params.max_new_tokens
    if limit is not None and len(output) >= limit:
        return True
    if len(output) < params.min_new_tokens:
        return False
    if not params.ignore_eos and token in eos_token_ids:
        return True
    return token in (params.stop_token_ids or [])
