"""`ForwardSteps`: runs forward steps a test chooses (a prefill, chunks on a cached prefix, decode steps, any
mix of sequences) through the real `ModelWorker`, returning each step's float32 logits.

For the forward-path tests that compare logits (against transformers, TP=1, the unsplit model, one feeding
order against another), which a scheduler cannot express: it decides itself how to chunk and batch. The
memory bookkeeping is the scheduler's own (`BatchMemory`: request rows, KV slots, page continuation) and the
step runs as the scheduler's does (`ModelWorker.prepare` then `forward`: the request table written, the
attention metadata built, a decode step's input ids read from the worker's token table), with no sampling
state: a forward-only step. Nothing here decides when a sequence stops; generation goes through the
scheduler (`tests/scheduler_harness.generate_in_process`).

A sequence is a `Req` whose `origin_input_ids` are the tokens fed so far (their KV is in the pool at
`req_to_token[row, :kv_len]`); between steps all of it counts as the cached prefix, which is what the
scheduler's `cache_progress` makes of a running request.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import count

import torch

from tokenloom.executor.model_runner import ModelRunner
from tokenloom.executor.worker import ModelWorker
from tokenloom.sampling.sampling_params import SamplingParams
from tokenloom.scheduler.req import Req
from tokenloom.scheduler.schedule_batch import BatchMemory

_ids = count()


class ForwardSteps:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.worker = ModelWorker(runner, eos_token_ids=())
        memory = runner.memory
        self.batches = BatchMemory(memory.req_to_token_pool, memory.token_allocator, memory.tree_cache,
                                   runner.device)

    def start(self) -> Req:
        """A new, empty sequence (its request row is taken by its first step)."""
        return Req(f"seq{next(_ids)}", [], SamplingParams())

    def slots(self, seq: Req) -> torch.Tensor:
        """The KV slots of the sequence's tokens, in order."""
        if seq.req_pool_idx is None:
            return torch.empty(0, dtype=torch.int64, device=self.runner.device)
        return self.runner.req_to_token_pool.req_to_token[seq.req_pool_idx, : seq.kv_len].to(torch.int64)

    def extend(self, seqs: Sequence[Req], new_tokens: Sequence[Sequence[int]], return_all_logits: bool = False,
               pp_proxy: dict[str, torch.Tensor] | None = None) -> torch.Tensor | dict[str, torch.Tensor]:
        """Append `new_tokens[i]` to `seqs[i]` in one step and run it: logits of each sequence's last token (of
        every new token with `return_all_logits`), or on a pipeline stage other than the last its hidden
        states and residual. A decode step when every sequence adds one token on top of a non-empty cache,
        an extend step otherwise. `pp_proxy`: the previous stage's output (the input of every stage but the
        first, whose `new_tokens` then give only the lengths)."""
        seqs = list(seqs)
        if len({id(s) for s in seqs}) != len(seqs) or len(seqs) != len(new_tokens):
            raise ValueError("one list of new tokens per distinct sequence")
        decode = all(len(t) == 1 for t in new_tokens) and all(s.kv_len > 0 for s in seqs)
        if decode:
            batch = self.batches.prepare_for_decode(seqs)
            self.worker.write_tokens([s.req_pool_idx for s in seqs], [t[0] for t in new_tokens])
        else:
            for seq, tokens in zip(seqs, new_tokens, strict=True):
                seq.prefix_indices = self.slots(seq)
                seq.fill_ids = seq.origin_input_ids + list(tokens)
            batch = self.batches.prepare_for_extend(seqs)
        for seq, tokens in zip(seqs, new_tokens, strict=True):
            seq.origin_input_ids.extend(tokens)
        step = self.worker.prepare(batch, None)  # no lane state: a forward-only step, nothing sampled
        step.forward_batch.return_all_logits = return_all_logits  # read by the model's last layer only
        out = self.worker.forward(step, pp_proxy)
        return out.proxy if out.logits is None else out.logits

    def release(self, seq: Req) -> None:
        """Free the sequence's KV slots and request row."""
        if seq.req_pool_idx is None:
            return
        self.runner.token_allocator.free(self.slots(seq))
        self.runner.req_to_token_pool.free(seq.req_pool_idx)
        seq.reset_for_retract()
        seq.origin_input_ids = []


def all_kv_free(runner: ModelRunner) -> bool:
    """Every KV slot is back: the full pool's and, with a sliding-window pool, every sliding-layer slot too."""
    alloc = runner.token_allocator
    full_free = alloc.full_available_size() if hasattr(alloc, "full_available_size") else alloc.available_size()
    return full_free == runner.max_total_num_tokens and getattr(alloc, "swa_in_use", lambda: 0)() == 0
