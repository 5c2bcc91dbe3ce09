"""Scheduler statistics: the new-token-ratio estimate used for admission, and step logging.

`NewTokenRatio` estimates what fraction of their remaining max_new_tokens running requests will still use:
it starts at min(0.7 * conservativeness, 1), decays linearly over 600 decode steps to 14% of that while
nothing is retracted, and jumps back up after a retraction (SGLang's defaults: SGLANG_INIT_NEW_TOKEN_RATIO 0.7,
SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR 0.14, SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS 600 in sglang/srt/environ.py).
`StepStats` logs, at INFO, one line per prefill batch and one every `decode_log_interval` decode steps, in
SGLang's wording ("Prefill batch. #new-seq: 1, #new-token: 12, #cached-token: 0, token usage: 0.00,
#running-req: 0, #queue-req: 0"; "Decode batch. #running-req: ..., gen throughput (token/s): ..."). Token usage
is the share of the KV pool held by requests (not the evictable prefix cache), after the batch's KV is
allocated; a prefill line's #running-req counts the requests holding a request slot besides the batch's
(decoding, or prefilled and not processed yet). A prefill batch of health probes alone is logged at DEBUG,
so probes do not fill the log. No line carries request text.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from tokenloom.protocol import HEALTH_CHECK_RID_PREFIX

logger = logging.getLogger("tokenloom.scheduler")


DECAY_STEPS = 600
MIN_RATIO_FACTOR = 0.14
RETRACT_RESERVE_PER_REQ = 20


class NewTokenRatio:
    def __init__(self, conservativeness: float) -> None:
        self.init = min(0.7 * conservativeness, 1.0)
        self.min = self.init * MIN_RATIO_FACTOR
        self.step = (self.init - self.min) / DECAY_STEPS
        self.value = self.init

    def decay(self, steps: float = 1.0) -> None:
        """One decode step's decay (`steps` < 1: a share of one, for each of several micro-batch lanes)."""
        self.value = max(self.value - self.step * steps, self.min)

    def after_retract(self, running: list[Any]) -> None:
        decoded = sum(len(r.output_ids) for r in running)
        total = sum(r.max_new_tokens for r in running)
        self.value = min(1.0, (decoded + RETRACT_RESERVE_PER_REQ * len(running)) / (total + 1))


class StepStats:
    def __init__(self, decode_log_interval: int) -> None:
        self.interval = decode_log_interval
        self.decode_steps = 0
        self.tokens_since_log = 0
        self.last_log_time = time.perf_counter()
        self.last_gen_throughput = 0.0
        self.prefill_tokens = 0
        self.cached_prefill_tokens = 0

    def cache_hit_rate(self) -> float:
        total = self.prefill_tokens + self.cached_prefill_tokens
        return self.cached_prefill_tokens / total if total else 0.0

    def on_prefill(self, batch: Any, queued: int, tree_cache: Any, pool_size: int) -> None:
        new = int(sum(r.extend_input_len for r in batch.reqs))
        cached = int(sum(r.prefix_len for r in batch.reqs))
        self.prefill_tokens += new
        self.cached_prefill_tokens += cached
        probes_only = all(r.rid.startswith(HEALTH_CHECK_RID_PREFIX) for r in batch.reqs)
        level = logging.DEBUG if probes_only else logging.INFO
        if not logger.isEnabledFor(level):
            return
        rows = tree_cache.req_to_token_pool
        running = rows.size - rows.available_size() - len(batch.reqs)
        logger.log(level, "Prefill batch. #new-seq: %d, #new-token: %d, #cached-token: %d, token usage: %.2f, "
                   "#running-req: %d, #queue-req: %d", len(batch.reqs), new, cached,
                   _used_tokens(tree_cache, pool_size) / pool_size, max(running, 0), queued)

    def on_decode(self, batch: Any, queued: int, tree_cache: Any, pool_size: int) -> None:
        self.decode_steps += 1
        self.tokens_since_log += len(batch.reqs)
        if self.decode_steps % self.interval:
            return
        now = time.perf_counter()
        self.last_gen_throughput = self.tokens_since_log / max(now - self.last_log_time, 1e-9)
        self.last_log_time, self.tokens_since_log = now, 0
        used = _used_tokens(tree_cache, pool_size)
        logger.info("Decode batch. #running-req: %d, #token: %d, token usage: %.2f, cache hit rate: %.2f%%, "
                    "gen throughput (token/s): %.2f, #queue-req: %d", len(batch.reqs), used, used / pool_size,
                    100 * self.cache_hit_rate(), self.last_gen_throughput, queued)


def _used_tokens(tree_cache: Any, pool_size: int) -> int:
    """KV tokens held by requests: the pool less what is free and what only the prefix cache holds."""
    return pool_size - tree_cache.allocator.full_available_size() - tree_cache.evictable_size()
