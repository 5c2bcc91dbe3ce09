"""Applying a `ForwardOutput` to the requests of a batch, releasing finished ones, and emitting
`BatchTokenOutput`s for the detokenizer.

After an extend step: a request in a non-final chunk discards its token (the scheduler caches its KV so far
when it plans the next chunk); others take their first token, cache their prompt KV (so later requests can
share it) and either finish or start running. Every chunk first adds the prompt logprobs it computed; they
are complete after the final chunk and go out once, with the request's first output. A request with
max_new_tokens 0 (prompt scoring) takes no token: it finishes right after its prefill. After a decode step:
every request takes its token and may finish. A finished request's KV goes to the prefix cache and its row
is freed as soon as no launched batch uses them; with the overlap scheduler a request that finished in batch
k may ride batch k+1 (planned before k's tokens were known): its token there is discarded and its KV
released when k+1's results arrive.

Jump-forward (scheduler/jump_forward.py): a row with forced tokens (`ForwardOutput.forced`) appends them after
its sampled token, one at a time with the stop checks (a stop string or max_new_tokens inside them ends the
request there; the rest are dropped); a request that goes on is marked `forced_pending` and handed back to the
scheduler in `jumped` (it waits for the extend of those tokens) instead of running; one whose grammar ended
with them (`forced_finished`) stops. A decode row of a `forced_pending` request is void: its token is
discarded.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from tokenloom.cache.prefix_cache import PrefixCache
from tokenloom.cache.req_to_token import ReqToTokenPool
from tokenloom.executor.worker import ForwardOutput
from tokenloom.finish_reason import finish_stop
from tokenloom.protocol import BatchTokenOutput
from tokenloom.scheduler.req import Req
from tokenloom.scheduler.schedule_batch import ScheduleBatch


class OutputProcessor:
    def __init__(self, tree_cache: PrefixCache, req_to_token_pool: ReqToTokenPool, tokenizer: Any,
                 send: Callable[[Any], None], stream_interval: int,
                 held: Callable[[Req], bool] = lambda req: False) -> None:
        """`held(req)`: whether something outside the scheduler (its request port: a PD transfer) still reads a
        finished request's KV; such a request is neither released nor answered here until it is let go."""
        self.held = held
        self.tree_cache = tree_cache
        self.req_to_token_pool = req_to_token_pool
        self.tokenizer = tokenizer
        self.send = send
        self.stream_interval = stream_interval
        self.jumped: list[Req] = []  # requests that took forced tokens in the batch just processed
        self.forced_tokens = 0  # forced tokens appended so far (internal_state: num_jump_forward_tokens)
        self.void_rows = 0  # decode rows discarded because their request was jumping (overlap)

    # --- memory ------------------------------------------------------------------------------------
    def release(self, req: Req) -> None:
        """Give a finished (or aborted) request's KV to the cache and free its row, unless a launched batch
        still uses them (then processing that batch's results releases it)."""
        if req.req_pool_idx is None or req.inflight > 0 or self.held(req):
            return
        self.tree_cache.cache_finished(req.req_pool_idx, req.cache_key(req.all_ids()), req.kv_len, req.prefix_len,
                                       req.last_node)
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx = None

    def cache_progress(self, req: Req) -> None:
        """Insert the KV placed for a still-running request, re-pointing its row at the cached slots; it then
        counts as the request's locked prefix. A no-op when nothing was placed beyond that prefix."""
        if req.kv_len <= req.prefix_len:
            return
        req.prefix_indices, req.last_node = self.tree_cache.cache_unfinished(
            req.req_pool_idx, req.cache_key(req.all_ids()[: req.kv_len]), req.prefix_len, req.last_node)

    # --- results -----------------------------------------------------------------------------------
    def process_extend(self, batch: ScheduleBatch, out: ForwardOutput) -> list[Req]:
        """Returns the requests that should start (or keep) decoding."""
        to_run = []
        for i, req in enumerate(batch.reqs):
            if req.wants_input_logprobs and not req.finished:
                chunk = out.input_logprobs[i] if out.input_logprobs is not None else None
                if chunk is not None:
                    req.add_input_logprobs(chunk)
                if req.is_chunked == 0:
                    req.finish_input_logprobs()
            if req.is_chunked > 0:
                req.is_chunked -= 1
                continue
            if req.finished:  # aborted while in flight
                self.release(req)
                continue
            if not req.output_ids:
                req.check_finished()  # the stop rule before any token: max_new_tokens 0 (prompt scoring) ends here
                if req.finished:
                    self.release(req)
                    continue
            self.append_token(req, i, out)
            self.append_forced(req, i, out)
            if req.finished:
                self.release(req)
            else:
                self.cache_progress(req)
                if not req.forced_pending:
                    to_run.append(req)
        self.emit(batch.reqs)
        return to_run

    def process_decode(self, batch: ScheduleBatch, out: ForwardOutput) -> None:
        """Every request takes its token; only the rows the forward side flagged as finish candidates (the
        stop conditions evaluated as tensor ops over the batch) run the per-request stop check."""
        check = None if out.finish_candidates is None else set(out.finish_candidates)
        for i, req in enumerate(batch.reqs):
            if req.finished:  # aborted, or finished in the batch before (overlap): this token is discarded
                self.release(req)
                continue
            if req.forced_pending:  # void row: launched before its jump was known (overlap)
                self.void_rows += 1
                continue
            self.append_token(req, i, out, check is None or i in check)
            self.append_forced(req, i, out)
            if req.finished:
                self.release(req)
            elif self.tree_cache.sliding_window:  # its oldest in-window token just left the window
                self.tree_cache.release_out_of_window(req.req_pool_idx, req.kv_len, req.prefix_len, 8)
        self.emit(batch.reqs)

    def append_token(self, req: Req, i: int, out: ForwardOutput, may_finish: bool = True) -> None:
        """Append row `i` of `out` (token, logprobs) to `req`'s outputs and, with `may_finish`, run its stop
        checks."""
        if not req.output_ids:
            req.first_token_time = time.time()
        req.output_ids.append(out.next_token_ids[i])
        if req.return_logprob and out.logprobs is not None:
            req.output_token_logprobs.append((out.logprobs[i], out.next_token_ids[i]))
            if req.top_logprobs_num and out.top_logprobs is not None:
                req.output_top_logprobs.append(out.top_logprobs[i][: req.top_logprobs_num])
            if req.token_ids_logprob is not None and out.token_ids_logprobs is not None:
                req.output_token_ids_logprobs.append(out.token_ids_logprobs[i])
        if not may_finish:
            return
        tail = None
        if req.sampling_params.stop:
            def tail(n: int, r: Req = req) -> str:
                return self.tokenizer.decode(r.output_ids[-n:], skip_special_tokens=False)
        req.check_finished(tail)
        if not req.finished and out.grammar_finished and i in out.grammar_finished:
            req.finished_reason = finish_stop(out.next_token_ids[i])  # the grammar's answer is complete

    def append_forced(self, req: Req, i: int, out: ForwardOutput) -> None:
        """Append row `i`'s forced tokens (jump-forward) to a request that goes on after its sampled token, each
        with the stop checks; if it still goes on, it is `forced_pending` and listed in `jumped`."""
        if req.finished or out.forced is None or i not in out.forced:
            return
        tail = None
        if req.sampling_params.stop:
            def tail(n: int, r: Req = req) -> str:
                return self.tokenizer.decode(r.output_ids[-n:], skip_special_tokens=False)
        for token in out.forced[i]:
            req.output_ids.append(token)
            self.forced_tokens += 1
            req.check_finished(tail)
            if req.finished:
                return
        if out.forced_finished and i in out.forced_finished:  # the grammar's answer is complete
            req.finished_reason = finish_stop(req.output_ids[-1])
            return
        req.forced_pending = True
        self.jumped.append(req)

    # --- streaming ---------------------------------------------------------------------------------
    def emit(self, reqs: list[Req]) -> None:
        """Send new tokens of finished requests, and of streaming ones every `stream_interval` tokens (not of a
        request whose KV is `held`: it is answered once let go)."""
        picked = []
        for req in reqs:
            if req.is_chunked > 0 or req.finish_sent:
                continue
            new = len(req.output_ids) - req.sent_len
            interval = req.sampling_params.stream_interval or self.stream_interval
            if (req.finished or (req.stream and new >= interval)) and not self.held(req):  # held: answered later
                picked.append(req)
        if picked:
            self.send(make_token_output(picked))


def make_token_output(reqs: list[Req]) -> BatchTokenOutput:
    out = BatchTokenOutput(rids=[], new_token_ids=[], finished_reasons=[], meta=[])
    for req in reqs:
        start = req.sent_len
        meta: dict[str, Any] = {
            "id": req.rid,
            "prompt_tokens": len(req.origin_input_ids),
            "completion_tokens": len(req.output_ids),
            "cached_tokens": req.cached_tokens,
            "total_retractions": req.retraction_count,
        }
        if req.queue_time is not None:  # SGLang's meta_info names
            meta["queue_time"] = req.queue_time
        if req.first_token_time is not None:
            meta["prefill_finished_ts"] = req.first_token_time
        if req.return_logprob:
            meta["output_token_logprobs"] = req.output_token_logprobs[start:]
            if req.top_logprobs_num:
                meta["output_top_logprobs"] = req.output_top_logprobs[start:]
            if req.token_ids_logprob is not None:
                meta["output_token_ids_logprobs"] = req.output_token_ids_logprobs[start:]
            _add_input_logprobs(meta, req)
        out.rids.append(req.rid)
        out.new_token_ids.append(req.output_ids[start:])
        out.finished_reasons.append(req.finished_reason)
        out.meta.append(meta)
        out.skip_special_tokens.append(req.sampling_params.skip_special_tokens)
        out.stop_strings.append(req.sampling_params.stop_strings)
        out.no_stop_trim.append(req.sampling_params.no_stop_trim)
        req.sent_len = len(req.output_ids)
        req.finish_sent = req.finished
    return out


def _add_input_logprobs(meta: dict[str, Any], req: Req) -> None:
    """Prompt logprobs, once complete and not sent yet, as SGLang's lists: `input_token_logprobs`
    [(logprob | None, token id)] for positions k..n-1 (the first logprob is None: nothing computed scores it),
    `input_top_logprobs` and `input_token_ids_logprobs` (per position a list, None first) when asked."""
    acc = req.input_logprobs
    if acc is None or not acc.done or acc.sent:
        return
    acc.sent = True
    ids = req.origin_input_ids[req.logprob_start_len:]
    meta["input_token_logprobs"] = list(zip([None, *acc.values], ids, strict=True))
    if req.top_logprobs_num:
        meta["input_top_logprobs"] = [None, *acc.top]
    if req.token_ids_logprob is not None:
        meta["input_token_ids_logprobs"] = [None, *acc.token_ids]
