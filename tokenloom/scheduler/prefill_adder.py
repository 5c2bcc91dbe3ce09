"""`PrefillAdder`: decides which waiting requests join the next prefill batch, under token budgets.

Budgets (the shape of SGLang's `PrefillAdder`, sglang/srt/managers/schedule_policy.py):
- `rem_total_tokens`: free + evictable KV, minus what running requests are expected to still need
  (remaining max_new_tokens, clipped at 4096, times the new-token ratio) and what admitted requests need;
- `rem_input_tokens`: `--max-prefill-tokens` of new prompt tokens per batch (one oversize request may still
  run alone);
- `rem_chunk_tokens`: `--chunked-prefill-size` per batch; a request that does not fit is cut to the budget
  (page-aligned) and becomes the single chunked request, continued first in the next prefill.
- at most `max_running_requests` requests running.

`add_one_req` returns CONTINUE (admitted; try the next), NO_TOKEN (KV budget exhausted) or OTHER (some
other budget exhausted); on anything but CONTINUE the caller stops.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

from tokenloom.scheduler.req import Req


class AddResult(enum.Enum):
    CONTINUE = "continue"
    NO_TOKEN = "no_token"
    OTHER = "other"


class PrefillAdder:
    def __init__(self, page_size: int, available_tokens: Callable[[], int], lock: Callable[[Any], None],
                 unlock: Callable[[Any], None], running_reqs: list[Req], new_token_ratio: float,
                 max_prefill_tokens: int, chunked_prefill_size: int | None, max_new_reqs: int) -> None:
        """`available_tokens()` is free + evictable KV now (locking a prefix makes it unevictable, so it is
        re-read after every admission); `lock(node)` protects an admitted request's cached prefix and
        `unlock(node)` undoes it for a request that turns out not to fit."""
        self.page_size = page_size
        self.available_tokens = available_tokens
        self.lock_node = lock
        self.unlock_node = unlock
        self.offset = sum(r.remaining_new_tokens_estimate() for r in running_reqs) * new_token_ratio
        self.rem_input_tokens = max_prefill_tokens
        self.rem_chunk_tokens = chunked_prefill_size
        self.max_new_reqs = max_new_reqs
        self.nothing_running = not running_reqs
        self.can_run_list: list[Req] = []
        self.new_chunked_req: Req | None = None

    @property
    def rem_total_tokens(self) -> float:
        return self.available_tokens() - self.offset

    def _ceil_page(self, n: int) -> int:
        return -(-n // self.page_size) * self.page_size

    def _take(self, req: Req, extend: int, reserve_output: int) -> None:
        self.offset += self._ceil_page(extend) + reserve_output
        self.rem_input_tokens -= extend
        if self.rem_chunk_tokens is not None:
            self.rem_chunk_tokens -= extend
        self.can_run_list.append(req)

    def _alone_fits(self, extend: int) -> bool:
        """With nothing running, a request whose prompt fits runs even if its output reservation does not
        (retraction covers the rest); otherwise it could wait forever."""
        first = self.nothing_running and not self.can_run_list
        chunk = extend if self.rem_chunk_tokens is None else min(extend, self.rem_chunk_tokens)
        return first and self._ceil_page(chunk) < self.rem_total_tokens

    def add_chunked_req(self, req: Req) -> None:
        """Continue the pending chunked request with as much as the chunk budget allows."""
        limit = self.rem_chunk_tokens if self.rem_chunk_tokens is not None else req.extend_input_len
        # Room now (free + evictable), not the estimate: the chunked request already holds its row and prefix.
        limit = min(limit, self.available_tokens() - self.page_size)
        extend = req.extend_input_len
        if extend > limit:
            extend = limit // self.page_size * self.page_size
            if extend <= 0:
                return  # no room this round; decodes will finish or be retracted first
            req.extend_input_len = extend
            req.fill_ids = req.fill_ids[: req.prefix_len + extend]
            self.new_chunked_req = req
        self._take(req, extend, 0 if self.new_chunked_req is req else req.remaining_new_tokens_estimate())

    def add_one_req(self, req: Req) -> AddResult:
        if len(self.can_run_list) >= self.max_new_reqs:
            return AddResult.OTHER
        # Lock first: the request's own cached prefix must not count as evictable room for itself.
        self.lock_node(req.last_node)
        result = self._try_add(req)
        if result is not AddResult.CONTINUE and req not in self.can_run_list:
            self.unlock_node(req.last_node)
        return result

    def _try_add(self, req: Req) -> AddResult:
        extend = req.extend_input_len
        reserve = req.remaining_new_tokens_estimate()
        if self._ceil_page(extend) + reserve >= self.rem_total_tokens and not self._alone_fits(extend):
            return AddResult.NO_TOKEN
        if extend > self.rem_input_tokens and self.can_run_list:
            return AddResult.OTHER
        if self.rem_chunk_tokens is None or extend <= self.rem_chunk_tokens:
            self._take(req, extend, reserve)
            return AddResult.CONTINUE
        chunk = self.rem_chunk_tokens // self.page_size * self.page_size
        if chunk <= 0:
            return AddResult.OTHER
        req.extend_input_len = chunk
        req.fill_ids = req.fill_ids[: req.prefix_len + chunk]
        self.new_chunked_req = req
        self._take(req, chunk, 0)
        return AddResult.OTHER  # the chunk filled the budget
