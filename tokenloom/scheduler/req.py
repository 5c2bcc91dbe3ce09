"""`Req`: the scheduler's state for one request, from arrival to finish.

Lifecycle: waiting (no request row, maybe a matched prefix) → admitted into a prefill batch (row allocated,
prefix locked) → possibly several chunks (`is_chunked` counts outstanding non-final chunks) → running
(decoded one token per step) → finished (KV cached/freed, row freed). Retraction sends a running request
back to waiting with its KV freed; it is recomputed from `origin_input_ids + output_ids` later.

Prompt logprobs (`return_logprob` with `logprob_start_len` k >= 0): while they are not complete, the cache
match stops at k, so every position from k on is computed (a cached prefix has no logits); each prefill
chunk adds the positions it computed (`add_input_logprobs`). A retracted request has them complete already
(only running requests are retracted) and is recomputed without them, with a full cache match.

Invariants while the request holds a row:
- `kv_len` tokens of `all_ids()` have KV at `req_to_token[req_pool_idx, :kv_len]`;
- the first `prefix_len` of those are the cached prefix locked at `last_node`;
- `kv_len` counts tokens placed by planned batches, whose KV may still be being computed;
- the row and KV are released only when no launched batch still uses them (`inflight == 0`).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from tokenloom.finish_reason import finish_abort
from tokenloom.sampling.sampling_params import SamplingParams
from tokenloom.sampling.stopping import finish_reason

if TYPE_CHECKING:
    from tokenloom.protocol import Bootstrap

# Clip used when estimating how many tokens a request may still generate (SGLang's default).
CLIP_MAX_NEW_TOKENS_ESTIMATION = 4096


LONG_FACTOR_KEYS = 1 << 32  # Req.cache_namespace of prompts computed with LongRoPE's long factors


class Req:
    def __init__(self, rid: str, input_ids: list[int], sampling_params: SamplingParams, *,
                 input_text: str | None = None, stream: bool = False, return_logprob: bool = False,
                 top_logprobs_num: int = 0, logprob_start_len: int = -1, token_ids_logprob: list[int] | None = None,
                 arrival_time: float | None = None, eos_token_ids: tuple[int, ...] = (),
                 bootstrap: Bootstrap | None = None) -> None:
        self.rid = rid
        self.input_text = input_text
        self.origin_input_ids = list(input_ids)
        self.output_ids: list[int] = []
        self.sampling_params = sampling_params
        self.stream = stream
        self.return_logprob = return_logprob
        self.top_logprobs_num = top_logprobs_num
        self.logprob_start_len = logprob_start_len
        self.token_ids_logprob = token_ids_logprob if return_logprob else None
        self.arrival_time = arrival_time if arrival_time is not None else time.time()
        self.eos_token_ids = eos_token_ids
        # Prefill/decode disaggregation: where its prefill server is and the room both servers know it by (request
        # input; the disaggregated side's own state of the request is its own: disaggregation/prefill.py, decode.py).
        self.bootstrap = bootstrap
        # Memory state
        self.req_pool_idx: int | None = None
        self.prefix_indices = torch.empty(0, dtype=torch.int64)
        self.last_node: Any = None
        self.kv_len = 0
        # Scheduling state
        self.fill_ids: list[int] = []
        self.extend_input_len = 0
        self.is_chunked = 0
        self.finished_reason: dict[str, Any] | None = None
        self.cached_tokens = 0
        self.retraction_count = 0
        # Timing for meta_info (/metrics): seconds from receipt to the first admission into a prefill batch, and
        # the wall-clock time (time.time()) the first output token was produced.
        self.received_time = time.perf_counter()
        self.queue_time: float | None = None
        self.first_token_time: float | None = None
        self.sent_len = 0  # output tokens already handed to the detokenizer
        self.finish_sent = False  # the finish reason was handed over (a request finishes exactly once)
        # Overlap scheduling: batches launched with this request and not processed yet, and how many of them
        # are decode steps whose sampled token is not in `output_ids` yet (it is in the worker's token table).
        self.inflight = 0
        self.pending_tokens = 0
        # Logprobs of output tokens: (logprob, token id) and per position top-k lists.
        self.output_token_logprobs: list[tuple[float, int]] = []
        self.output_top_logprobs: list[list[tuple[float, int]]] = []
        self.output_token_ids_logprobs: list[list[float]] = []
        # Prompt logprobs: one entry per prompt position from logprob_start_len on. The first is None (SGLang:
        # the logits before position k are not computed); entry p > k is log P(token p | tokens < p).
        self.input_logprobs = InputLogprobs() if return_logprob and logprob_start_len >= 0 else None
        # Constrained decoding: the grammar matcher (grammar/backends.py `Matcher`) once compiled; it follows
        # `output_ids` and is advanced on the forward side right after each sampling (executor/worker.py).
        self.grammar: Any = None
        # Jump-forward (scheduler/jump_forward.py): its output ends with forced tokens that have no KV yet; it
        # waits in its lane's `jumping` list for the extend that computes them (decode rows of it are void).
        self.forced_pending = False
        # The prefix cache's key space (`cache_key`): 0, or LONG_FACTOR_KEYS for a LongRoPE model's prompt
        # longer than its original length, whose every token's KV is computed with the long factors and so must
        # never be shared with (matched by, or matching) KV computed with the short ones. Set on arrival.
        self.cache_namespace = 0

    # --- token views -------------------------------------------------------------------------------
    def all_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    def cache_key(self, ids: list[int]) -> list[int]:
        """`ids` as the prefix cache keys them: shifted into this request's namespace (token ids are below
        2**31, namespaces are multiples of 2**32, so two namespaces share no key)."""
        if not self.cache_namespace:
            return ids
        return [t + self.cache_namespace for t in ids]

    @property
    def prefix_len(self) -> int:
        return int(self.prefix_indices.numel())

    @property
    def max_new_tokens(self) -> int:
        return self.sampling_params.max_new_tokens  # clamped to the context by the scheduler on arrival

    def remaining_new_tokens_estimate(self) -> int:
        return min(self.max_new_tokens - len(self.output_ids), CLIP_MAX_NEW_TOKENS_ESTIMATION)

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    # --- scheduling ----------------------------------------------------------------------------------
    @property
    def wants_input_logprobs(self) -> bool:
        """Prompt logprobs were asked for and are not complete yet."""
        return self.input_logprobs is not None and not self.input_logprobs.done

    def init_next_round_input(self, match_prefix: Any) -> None:
        """Set `fill_ids` to everything known and match the cache on all but the last token (so at least
        one token is computed and produces logits), and not beyond `logprob_start_len` while prompt logprobs
        are outstanding (their positions need logits)."""
        self.fill_ids = self.all_ids()
        if self.req_pool_idx is None:
            limit = len(self.fill_ids) - 1
            if self.wants_input_logprobs:
                limit = min(limit, self.logprob_start_len)
            result = match_prefix(self.cache_key(self.fill_ids[:limit]))
            self.prefix_indices, self.last_node = result.indices, result.last_node
        self.extend_input_len = len(self.fill_ids) - self.prefix_len

    def add_input_logprobs(self, chunk: Any) -> None:
        """Append one prefill chunk's prompt logprobs (`executor.prompt_logprobs.InputLogprobChunk`): the
        logits of positions `chunk.start ..` score the tokens after them. Chunks arrive in order."""
        acc = self.input_logprobs
        expected = max(self.logprob_start_len, acc.next_position)
        if chunk.start != expected:
            raise AssertionError(f"{self.rid}: prompt logprobs from position {chunk.start}, expected {expected}")
        acc.values.extend(chunk.values)
        if chunk.top is not None:
            acc.top.extend(chunk.top)
        if chunk.token_ids is not None:
            acc.token_ids.extend(chunk.token_ids)
        acc.next_position = chunk.start + len(chunk.values)

    def finish_input_logprobs(self) -> None:
        """The prompt is fully prefilled: its logprobs are complete (positions k+1 .. n-1 scored)."""
        acc = self.input_logprobs
        expected = len(self.origin_input_ids) - 1 - self.logprob_start_len
        if len(acc.values) != expected:
            raise AssertionError(f"{self.rid}: {len(acc.values)} prompt logprobs, expected {expected}")
        acc.done = True

    def mark_admitted(self) -> None:
        """The request is in a prefill batch being planned; only the first admission sets `queue_time`."""
        if self.queue_time is None:
            self.queue_time = time.perf_counter() - self.received_time

    def reset_for_retract(self) -> None:
        self.req_pool_idx = None
        self.prefix_indices = torch.empty(0, dtype=torch.int64)
        self.last_node = None
        self.kv_len = 0
        self.is_chunked = 0
        self.fill_ids = []
        self.extend_input_len = 0
        self.retraction_count += 1

    # --- stopping ------------------------------------------------------------------------------------
    def check_finished(self, tail_text: Any = None) -> None:
        """Set `finished_reason` by the stop rule (sampling/stopping.py) after a new output token, or before the
        first one (max_new_tokens 0). `tail_text(n)` decodes the last n output tokens (given when the request
        has stop strings)."""
        if not self.finished:
            self.finished_reason = finish_reason(self.sampling_params, self.output_ids, self.eos_token_ids, tail_text)

    def abort(self, message: str, status_code: int = 400) -> None:
        if not self.finished:
            self.finished_reason = finish_abort(message, status_code)

    def __repr__(self) -> str:
        return f"Req(rid={self.rid}, input={len(self.origin_input_ids)}, output={len(self.output_ids)})"


class InputLogprobs:
    """A request's prompt logprobs as its chunks compute them: per scored position (k+1 ..) the logprob of
    its token, its top-k [(logprob, id)] and the logprobs of the request's `token_ids_logprob`."""

    __slots__ = ("values", "top", "token_ids", "next_position", "done", "sent")

    def __init__(self) -> None:
        self.values: list[float] = []
        self.top: list[list[tuple[float, int]]] = []
        self.token_ids: list[list[float]] = []
        self.next_position = 0  # the next position whose logits score a prompt token
        self.done = False
        self.sent = False
