"""`StepPlan`: what the worker reads of a scheduler's plan for one step, as a protocol.

The scheduler's `ScheduleBatch` (a list of its `Req`s, a mode and the step's lengths and KV slots) satisfies
it; so does any test double. The worker reads the plan on the scheduler's thread in `prepare` and never keeps
it: what the forward side needs is copied into the `PreparedStep`. Nothing here is written by the worker.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from tokenloom.forward_batch import ForwardBatch
from tokenloom.sampling.sampling_params import SamplingParams


class PlannedRequest(Protocol):
    """One request of a step, as the worker and its sampling state read it."""

    sampling_params: SamplingParams
    origin_input_ids: list[int]
    output_ids: list[int]
    # tokens sampled by launched steps whose results are not processed yet (the overlap scheduler)
    pending_tokens: int
    return_logprob: bool
    top_logprobs_num: int
    logprob_start_len: int
    token_ids_logprob: list[int] | None

    @property
    def wants_input_logprobs(self) -> bool:
        """Whether this step must compute logprobs of prompt tokens for it."""
        ...


class StepPlan(Protocol):
    """A planned step: its requests in order, and the device tensors built from its lengths and slots."""

    @property
    def reqs(self) -> Sequence[PlannedRequest]: ...

    # a decode step of exactly the previous decode step's requests, in order (the vectorized path)
    same_reqs_as_last_decode: bool

    def to_forward_batch(self, return_all_logits: bool = False) -> ForwardBatch: ...
