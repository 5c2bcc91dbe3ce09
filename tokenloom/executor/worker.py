"""`ModelWorker`: runs a `ScheduleBatch` on the `ModelRunner` and returns a `ForwardOutput`.

It is the seam between scheduler (CPU plan, `Req`s) and device: it builds the `ForwardBatch` and the
`SamplingBatchInfo` for the batch's requests, runs forward and sampling, and hands back plain Python results.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenloom.executor.model_runner import ModelRunner
from tokenloom.sampling.sampling_batch import SamplingBatchInfo
from tokenloom.scheduler.schedule_batch import ScheduleBatch


@dataclass
class ForwardOutput:
    next_token_ids: list[int]
    # Per request, only for requests that asked: (logprob of chosen token, top-k [(logprob, id)]).
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[float, int]]] | None = None
    extra: dict = field(default_factory=dict)


class ModelWorker:
    def __init__(self, runner: ModelRunner, eos_token_ids: tuple[int, ...]) -> None:
        self.runner = runner
        self.eos_token_ids = eos_token_ids

    def forward_batch_generation(self, batch: ScheduleBatch) -> ForwardOutput:
        logits = self.runner.forward(batch.to_forward_batch())
        reqs = batch.reqs
        want_logprob = any(r.return_logprob for r in reqs)
        top_k = max((r.top_logprobs_num for r in reqs if r.return_logprob), default=0)
        info = SamplingBatchInfo.from_requests(
            [r.sampling_params for r in reqs], [r.origin_input_ids for r in reqs], [r.output_ids for r in reqs],
            self.runner.vocab_size, self.eos_token_ids, self.runner.device, return_logprob=want_logprob,
            top_logprobs_num=top_k)
        sample = self.runner.sample(logits, info)
        out = ForwardOutput(next_token_ids=sample.next_token_ids.tolist())
        if want_logprob:
            out.logprobs = sample.next_token_logprobs.tolist()
            if top_k:
                values, ids = sample.top_logprobs.tolist(), sample.top_logprob_ids.tolist()
                out.top_logprobs = [list(zip(v, i, strict=True)) for v, i in zip(values, ids, strict=True)]
        return out
