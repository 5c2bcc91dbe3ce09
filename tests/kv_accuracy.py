"""Teacher-forced comparison of two runners' next-token distributions (the fp8 KV cache against the model-dtype
one): both are fed the same tokens (a prompt, then the reference's own greedy continuation, one decode step
at a time), so every step compares the two distributions over the same context instead of two diverging
generations."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tests.forward_steps import ForwardSteps
from tokenloom.executor.model_runner import ModelRunner


@dataclass
class Agreement:
    steps: int
    argmax_equal: int  # steps where both pick the same greedy token
    max_logprob_diff: float  # max over steps of |logprob_a - logprob_b| of the reference's greedy token
    mean_logprob_diff: float
    max_abs_logprob_diff_top: float  # max over steps of |delta| over the reference's top-5 tokens

    @property
    def agreement(self) -> float:
        return self.argmax_equal / self.steps


def teacher_forced(reference: ModelRunner, other: ModelRunner, prompts: list[list[int]], new_tokens: int) -> Agreement:
    """Prefill each prompt, then decode `new_tokens` steps fed with the reference's greedy tokens (all prompts
    in one batch per step) on both runners; compare the float32 log-softmax of every step."""
    ref_steps, other_steps = ForwardSteps(reference), ForwardSteps(other)
    ref_seqs = [ref_steps.start() for _ in prompts]
    other_seqs = [other_steps.start() for _ in prompts]
    diffs, tops, equal = [], [], 0
    try:
        a = ref_steps.extend(ref_seqs, prompts)
        b = other_steps.extend(other_seqs, prompts)
        for step in range(new_tokens + 1):
            la, lb = torch.log_softmax(a.float(), -1), torch.log_softmax(b.float(), -1)
            greedy = la.argmax(-1)
            equal += int((lb.argmax(-1) == greedy).sum())
            diffs.append((la.gather(1, greedy[:, None]) - lb.gather(1, greedy[:, None])).abs().squeeze(1))
            top = la.topk(5, -1).indices
            tops.append((la.gather(1, top) - lb.gather(1, top)).abs().amax(1))
            if step == new_tokens:
                break
            feed = [[t] for t in greedy.tolist()]
            a = ref_steps.extend(ref_seqs, feed)
            b = other_steps.extend(other_seqs, feed)
    finally:
        for s in ref_seqs:
            ref_steps.release(s)
        for s in other_seqs:
            other_steps.release(s)
    d = torch.cat(diffs)
    return Agreement(int(d.numel()), equal, float(d.max()), float(d.mean()), float(torch.cat(tops).max()))
