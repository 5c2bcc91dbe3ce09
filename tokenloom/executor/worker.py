"""`ModelWorker`: runs a scheduler's plan for one step (a `StepPlan`, executor/step_plan.py: the scheduler's
`ScheduleBatch`) on the `ModelRunner` and returns a `ForwardOutput`.

It is the seam between scheduler (CPU plan, `Req`s) and device (the scheduler uses only `prepare`, `execute`,
`eos_token_ids` and `device`: `scheduler.SchedulerWorker`), in two halves so the overlap scheduler can run
them on different threads:
- `prepare(batch)` (scheduler thread): builds the `ForwardBatch`, writes `req_to_token`, snapshots the
  attention metadata and the `SamplingBatchInfo`;
- `execute(step)` (forward thread, or inline) = `sample(step, forward(step))`: `forward` reads a decode
  step's input ids from the token table by request row (executor/token_table.py), counts still-unprocessed
  previous tokens into the penalty state and runs the model (logits, or on a non-last pipeline stage the
  hidden states for the next stage); `sample` samples, writes the tokens to the table for the steps behind
  this one, and hands back plain Python results.

An extend step in which some request wants prompt logprobs computes the extra logits rows its `LogitPlan`
(executor/prompt_logprobs.py) lists, for that request only; sampling reads each request's last row as usual.

Jump-forward (`jump_forward`, --enable-jump-forward; the scheduler's side is scheduler/jump_forward.py): after a
constrained row accepts its sampled token, `sample` asks its matcher for the tokens the grammar forces next
(at most the row's `jump_rooms` entry: what max_new_tokens leaves), accepts them and reports them
(`ForwardOutput.forced`); the matcher is then `jump_pending` until an extend step of that request samples
again (the scheduler's extend of the forced tokens). A decode step that reaches a pending matcher was
launched before the scheduler knew of the jump (overlap): its row is void (no mask, no accept; the scheduler
discards its token, and the KV it wrote is that of the jumping request's last sampled token, kept).

A request whose previous token is not processed yet (`req.pending_tokens` > 0) has that token counted as
generated: its `output_lens` entry includes it and, when penalties apply, it is added to its counts on the
forward side, so overlapped and normal scheduling sample identically. After a decode step's sampling the
sampled tokens are counted into the penalty state too, which `SamplingRows` carries to the next step of the
same requests (then nothing pending needs adding).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from tokenloom.executor.inference import inference
from tokenloom.executor.model_runner import ModelRunner
from tokenloom.executor.prompt_logprobs import (
    InputLogprobChunk,
    LogitPlan,
    plan_logits,
    read_logits,
    token_ids_logprobs,
)
from tokenloom.executor.step_plan import StepPlan
from tokenloom.executor.token_table import TokenTable
from tokenloom.forward_batch import ForwardBatch
from tokenloom.grammar.mask import allocate_bitmask
from tokenloom.sampling.sampling_batch import SamplingBatchInfo
from tokenloom.sampling.sampling_rows import SamplingRows

# Decode steps of at most this many rows skip `SamplingBatchInfo.finish_candidates`: the scheduler runs the stop
# rule on every row (a few Python comparisons each).
CHECK_EVERY_ROW_UP_TO = 8


@dataclass
class ForwardOutput:
    next_token_ids: list[int]
    # Per request, only for requests that asked: (logprob of chosen token, top-k [(logprob, id)]).
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[float, int]]] | None = None
    # Per request, logprobs of its `token_ids_logprob` at the sampled position (None where not asked).
    token_ids_logprobs: list[list[float] | None] | None = None
    # Extend steps: per request, the prompt logprobs this step computed (None where none).
    input_logprobs: list[InputLogprobChunk | None] | None = None
    # Rows whose token may finish their request (`SamplingBatchInfo.finish_candidates`); None: check all rows.
    finish_candidates: list[int] | None = None
    # Rows whose grammar accepted its end with this token (the request stops), when any has a grammar.
    grammar_finished: set[int] | None = None
    # Jump-forward: per row, the tokens the grammar forces after the sampled one (accepted by its matcher).
    forced: dict[int, list[int]] | None = None
    # Rows whose grammar ended with their last forced token (llguidance stops where only EOS may follow).
    forced_finished: set[int] | None = None
    # Seconds spent in the model forward and in sampling (+ copying results out).
    forward_s: float = 0.0
    sample_s: float = 0.0
    extra: dict = field(default_factory=dict)


@dataclass
class ForwardResult:
    """What `ModelWorker.forward` produced: logits on the last stage (float32, the rows sampling reads, and
    the prompt logprobs the step's `LogitPlan` computed), else the hidden states and residual to send to the
    next pipeline stage (`proxy`)."""

    logits: torch.Tensor | None = None
    input_logprobs: list[InputLogprobChunk | None] | None = None
    proxy: dict[str, torch.Tensor] | None = None
    forward_s: float = 0.0


@dataclass
class PreparedStep:
    forward_batch: ForwardBatch
    sampling: SamplingBatchInfo | None  # None on a pipeline stage that does not sample
    pending_rows: torch.Tensor | None  # rows whose last sampled token is not processed yet (in the table only)
    top_logprobs_num: int = 0
    want_logprob: bool = False
    logit_plan: LogitPlan | None = None  # extra logits rows for prompt logprobs
    token_ids: list[list[int] | None] | None = None  # per request its token_ids_logprob, when any asks
    grammars: list | None = None  # per request its grammar matcher (None: unconstrained row), when any has one
    jump_rooms: list[int] | None = None  # jump-forward: per request the most forced tokens it may take


class ModelWorker:
    def __init__(self, runner: ModelRunner, eos_token_ids: tuple[int, ...]) -> None:
        self.runner = runner
        self.eos_token_ids = eos_token_ids
        self.device = runner.device  # where forwards run (the forward thread's stream is made for it)
        self.token_table = TokenTable(runner.memory.req_to_token_pool.req_to_token.shape[0], runner.device)
        self.eos_ids = torch.tensor(eos_token_ids, dtype=torch.int64, device=runner.device)
        self.vocab_size = runner.vocab_size  # the grammar backends index this many token ids
        self.jump_forward = False  # --enable-jump-forward (set by the scheduler)
        # LongRoPE: prompts longer than this are computed with the long factors (the prefix cache keeps them apart)
        self.long_rope_after = runner.model_config.long_rope_after()

    # --- scheduler side ------------------------------------------------------------------------------
    @property
    def samples(self) -> bool:
        """Whether this rank's model holds the last layers (every rank but a non-last pipeline stage)."""
        return self.runner.parallel.is_last_stage

    def new_lane_state(self) -> SamplingRows | None:
        """The sampling state of one micro-batch lane (scheduler/lane.py): its penalty counts carry from one
        of the lane's steps to its next. None on a pipeline stage that does not sample."""
        if not self.samples:
            return None
        return SamplingRows(self.runner.vocab_size, self.eos_token_ids, self.runner.device)

    def prepare(self, batch: StepPlan, lane_state: SamplingRows | None) -> PreparedStep:
        """`lane_state` None (a non-last pipeline stage): a forward-only step, no sampling information."""
        reqs = batch.reqs
        fb = batch.to_forward_batch()
        plan = None
        if lane_state is not None and fb.forward_mode.is_extend() and any(r.wants_input_logprobs for r in reqs):
            plan = plan_logits(reqs, fb.extend_prefix_lens.tolist(), fb.seq_lens.tolist(), self.runner.device)
            fb.logit_rows = plan.rows
        self.runner.prepare(fb)
        want_logprob = any(r.return_logprob for r in reqs)
        top_k = max((r.top_logprobs_num for r in reqs if r.return_logprob), default=0)
        device = self.runner.device
        pending_rows = None
        if batch.same_reqs_as_last_decode:  # every request's previous token is pending, or none is
            if reqs[0].pending_tokens:
                pending_rows = torch.arange(len(reqs), device=device)
        else:
            flags = [r.pending_tokens > 0 for r in reqs]
            if any(flags):
                pending_rows = torch.tensor([i for i, f in enumerate(flags) if f], dtype=torch.int64, device=device)
        info = None if lane_state is None else lane_state.info_for(
            reqs, fb.forward_mode.is_decode(), return_logprob=want_logprob, top_logprobs_num=top_k)
        token_ids = [r.token_ids_logprob for r in reqs] if any(r.token_ids_logprob is not None for r in reqs) \
            else None
        grammars = None
        if lane_state is not None and any(r.grammar is not None for r in reqs):
            # a non-final prefill chunk's token is discarded (its fill_ids stop short of the request's tokens;
            # `is_chunked` may still count an earlier chunk whose result is not processed yet), and so is the
            # token of a finished request riding this step (overlap): their matchers must not see those tokens
            extend = fb.forward_mode.is_extend()
            grammars = [None if r.finished or (extend and len(r.fill_ids) < len(r.origin_input_ids) + len(r.output_ids))
                        else r.grammar for r in reqs]
        rooms = None
        if grammars is not None and self.jump_forward:  # no jump for logprob requests (forced tokens have none)
            rooms = [0 if g is None or r.return_logprob
                     else _room(r.sampling_params.max_new_tokens, len(r.output_ids) + r.pending_tokens)
                     for g, r in zip(grammars, reqs, strict=True)]
        return PreparedStep(fb, info, pending_rows, top_k, want_logprob, plan, token_ids, grammars, rooms)

    # --- forward side --------------------------------------------------------------------------------
    @inference
    def execute(self, step: PreparedStep) -> ForwardOutput:
        """Forward then sample: the whole step of a rank that holds the last layers (every rank but a
        non-last pipeline stage, which calls `forward` alone and sends its hidden states on)."""
        return self.sample(step, self.forward(step))

    @inference
    def forward(self, step: PreparedStep, proxy: dict[str, torch.Tensor] | None = None) -> ForwardResult:
        """The model forward of a prepared step: logits (the last stage) or the stage's hidden states and
        residual (`ForwardResult.proxy`, for the next stage). `proxy`: the previous stage's output (every
        stage but the first). A decode step's input ids are read from the token table first (the tokens the
        steps before it sampled)."""
        start = time.perf_counter()
        fb, info = step.forward_batch, step.sampling
        fb.pp_proxy = proxy
        if fb.forward_mode.is_decode():
            fb.input_ids = self.token_table.gather(fb.req_pool_indices)
        if step.pending_rows is not None and info is not None and info.output_counts is not None \
                and not info.penalties_carried:
            rows = fb.req_pool_indices.index_select(0, step.pending_rows)
            info.add_pending_tokens(step.pending_rows, self.token_table.gather(rows))
        out = self.runner.forward(fb)
        if isinstance(out, dict):
            return ForwardResult(proxy=out, forward_s=time.perf_counter() - start)
        input_logprobs = None
        if step.logit_plan is not None:
            out, input_logprobs = read_logits(step.logit_plan, out)
        return ForwardResult(logits=out, input_logprobs=input_logprobs, forward_s=time.perf_counter() - start)

    @inference
    def record_tokens(self, step: PreparedStep, next_token_ids: list[int]) -> None:
        """Write the tokens another stage sampled for `step` into the token table (pipeline stage 0, the one
        that embeds, when the step's output arrives back around the ring): the lane's next decode reads
        them. Called on the scheduling thread before the lane's next step is submitted, so the write
        precedes the read (the forward executor runs steps in submission order)."""
        ids = torch.tensor(next_token_ids, dtype=torch.int64, device=self.device)
        self.token_table.write(step.forward_batch.req_pool_indices, ids)

    @inference
    def write_tokens(self, rows: list[int], token_ids: list[int]) -> None:
        """Make `token_ids` the newest tokens of request `rows` without a forward (a disaggregated decode
        server's request that arrives with its first token, or one resumed from host memory): its next decode
        step reads them. Scheduling thread, before that step is submitted."""
        self.token_table.write(torch.tensor(rows, dtype=torch.int64, device=self.device),
                               torch.tensor(token_ids, dtype=torch.int64, device=self.device))

    def _fill_grammar_masks(self, grammars: list, info: SamplingBatchInfo, decode: bool) -> None:
        """The token masks of the step's constrained rows, from their matchers' current state: every token
        before this step was accepted by the steps before it on this (forward) side, in step order, so the
        mask follows the previous step's token even when the scheduler has not processed it yet (overlap).
        A decode row whose matcher is `jump_pending` is void (no mask); an extend row ends the pending state
        (the extend computes the forced tokens, and its token follows them)."""
        rows = []
        for i, m in enumerate(grammars):
            if m is None or m.is_terminated():
                continue
            if m.jump_pending:
                if decode:
                    continue
                m.jump_pending = False
            rows.append(i)
        if not rows:
            return
        bitmask = allocate_bitmask(len(rows), self.vocab_size)
        for j, i in enumerate(rows):
            grammars[i].fill(bitmask, j)
        info.grammar_bitmask = bitmask
        info.grammar_rows = torch.tensor(rows, dtype=torch.int64, device=self.device)

    @staticmethod
    def _accept_grammar_tokens(grammars: list, next_token_ids: list[int], rooms: list[int] | None,
                               out: ForwardOutput) -> None:
        """Advance each constrained row's matcher by its sampled token; `out.grammar_finished`: the rows whose
        grammar then ended. A token the matcher refuses (it cannot happen through the mask) also ends the row,
        rather than letting the request run on unconstrained. With `rooms` (jump-forward), a row that goes on
        also accepts the tokens its grammar forces next (at most its room) and reports them in `out.forced`;
        void rows (`jump_pending` decode rows) accept nothing. `out.forced_finished`: the rows whose grammar
        ended with their last forced token (no extend follows: the request stops there)."""
        done: set[int] = set()
        forced: dict[int, list[int]] = {}
        forced_done: set[int] = set()
        for i, m in enumerate(grammars):
            if m is None or m.is_terminated() or m.jump_pending:
                continue
            if not m.accept(next_token_ids[i]) or m.is_terminated():
                done.add(i)
                continue
            if rooms is None or rooms[i] <= 0:
                continue
            tokens = m.forced_tokens()[: rooms[i]]
            taken = 0
            for token in tokens:  # the backend's tokens are checked by its own matcher, token by token
                if not m.accept(token):
                    break
                taken += 1
            if taken:
                forced[i] = tokens[:taken]
                if m.is_terminated():
                    forced_done.add(i)
                else:
                    m.jump_pending = True
        out.grammar_finished = done
        out.forced = forced or None
        out.forced_finished = forced_done or None

    @inference
    def sample(self, step: PreparedStep, forwarded: ForwardResult) -> ForwardOutput:
        """Sample the next tokens from a forward's logits and hand back plain Python results; stores the
        tokens for batches scheduled behind this one."""
        if forwarded.logits is None:
            raise ValueError("sample() needs logits: this rank's model does not hold the last layers")
        start = time.perf_counter()
        fb, info, logits = step.forward_batch, step.sampling, forwarded.logits
        if step.grammars is not None:
            self._fill_grammar_masks(step.grammars, info, fb.forward_mode.is_decode())
        sample = self.runner.sample(logits, info)
        if info.output_counts is not None and fb.forward_mode.is_decode():  # carried to the next step
            rows = torch.arange(sample.next_token_ids.numel(), device=sample.next_token_ids.device)
            info.add_pending_tokens(rows, sample.next_token_ids)
        self.token_table.write(fb.req_pool_indices, sample.next_token_ids)
        out = ForwardOutput(next_token_ids=sample.next_token_ids.tolist(), input_logprobs=forwarded.input_logprobs)
        if step.token_ids is not None:
            out.token_ids_logprobs = token_ids_logprobs(logits, step.token_ids)
        # extend results check every row (chunks discard their token), and so do decode steps of a few rows: the
        # stop rule on each costs less than the tensor filter's ops right after the step's weight stream
        if fb.forward_mode.is_decode() and len(out.next_token_ids) > CHECK_EVERY_ROW_UP_TO:
            out.finish_candidates = info.finish_candidates(sample.next_token_ids, self.eos_ids)
        if step.grammars is not None:
            self._accept_grammar_tokens(step.grammars, out.next_token_ids, step.jump_rooms, out)
            if out.finish_candidates is not None and out.grammar_finished:
                out.finish_candidates = sorted(set(out.finish_candidates) | out.grammar_finished)
        if step.want_logprob:
            out.logprobs = sample.next_token_logprobs.tolist()
            if step.top_logprobs_num:
                values, ids = sample.top_logprobs.tolist(), sample.top_logprob_ids.tolist()
                out.top_logprobs = [list(zip(v, i, strict=True)) for v, i in zip(values, ids, strict=True)]
        out.forward_s, out.sample_s = forwarded.forward_s, time.perf_counter() - start
        return out


def _room(max_new_tokens: int | None, generated: int) -> int:
    """Forced tokens a request may take after the token this step samples (its `generated`-th + 1)."""
    return (1 << 30) if max_new_tokens is None else max_new_tokens - generated - 1
