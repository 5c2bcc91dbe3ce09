"""`scheduler_state`: what a `Scheduler` reports of itself (/get_server_info, /metrics, the tests' checks):
its pools, queues and counters, with its request port's, grammar queue's, jump-forward's and driving loop's
own. Under TP, `tp_ranks_agree` says whether every rank's pools, queues (the grammar queue's included) and
sampled tokens equal rank 0's; every rank computes it while handling the same state request.
"""

from __future__ import annotations

import time
from typing import Any


def scheduler_state(sched: Any, loop_info: dict[str, Any] | None = None) -> dict[str, Any]:
    """`sched`'s state (a scheduler/scheduler.py `Scheduler`, which calls this: typed loosely so that this module
    does not import the one importing it), with the driving loop's `loop_info` merged in."""
    free = sched.allocator.full_available_size()  # == available_size() but for a sliding-window pool
    used = sched.max_total_num_tokens - free - sched.tree_cache.evictable_size()
    agree = {}
    if sched.ranks_agree is not None:  # every rank's pools, queues and sampled tokens equal rank 0's
        agree["tp_ranks_agree"] = sched.ranks_agree(
            (sched.allocator.available_size(), sched.tree_cache.evictable_size(),
             sched.req_to_token_pool.available_size(), [r.rid for r in sched.running],
             [r.rid for r in sched.waiting_queue], [r.rid for r, _, _ in sched.grammar_queue.pending],
             sched.token_digest))
    return {
        **agree,
        "max_total_num_tokens": sched.max_total_num_tokens,
        "max_req_input_len": sched.max_req_input_len,
        "max_running_requests": sched.max_running_requests,
        "available_kv_tokens": free,
        "evictable_kv_tokens": sched.tree_cache.evictable_size(),
        "kv_tokens_in_use": used,
        "free_request_slots": sched.req_to_token_pool.available_size(),
        **({"swa_max_total_num_tokens": sched.allocator.swa_size,  # a sliding-window pool's sliding-layer slots
            "swa_available_kv_tokens": sched.allocator.swa_size - sched.allocator.swa_in_use()}
           if hasattr(sched.allocator, "swa_size") else {}),
        "num_running_reqs": len(sched.running) + len(sched._in_flight_prefills()),
        "num_waiting_reqs": len(sched.waiting_queue),
        "num_retracted_reqs": sched.num_retracted,
        "last_gen_throughput": sched.stats.last_gen_throughput,
        "cache_hit_rate": sched.stats.cache_hit_rate(),
        **sched.port.info(),
        **sched.grammar_queue.info(),
        **(sched.jump.info(sched.output.forced_tokens, sched.output.void_rows) if sched.jump is not None else {}),
        **(loop_info or {}),
        "time": time.time(),
    }
