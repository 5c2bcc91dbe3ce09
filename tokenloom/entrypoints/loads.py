"""Load reports for routers: GET /get_load (SGLang's legacy shape, which sglang-router's power-of-two policy
polls and sums `num_tokens` of) and GET /v1/loads (its current report), built from the scheduler's internal
state.

tokenloom runs one data-parallel rank (0), so each report has one entry. Only SGLang's "core" section is
reported: tokenloom has no speculative decoding, LoRA or PD, and does not break memory or queues down.
`num_tokens` / `num_used_tokens` count the KV slots held by running requests; tokens of waiting prompts
(SGLang's `num_pending_tokens`) are not tracked, so they are not reported.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

LOAD_SECTIONS = frozenset({"core", "memory", "spec", "lora", "disagg", "queues", "all"})


def legacy_load(state: dict[str, Any]) -> list[dict[str, Any]]:
    """GET /get_load: one entry per DP rank; `num_reqs` counts running and waiting requests."""
    return [{"dp_rank": 0, "num_reqs": state["num_running_reqs"] + state["num_waiting_reqs"],
             "num_waiting_reqs": state["num_waiting_reqs"], "num_tokens": state["kv_tokens_in_use"],
             "ts_tic": time.perf_counter()}]


def rank_load(state: dict[str, Any]) -> dict[str, Any]:
    running, waiting = state["num_running_reqs"], state["num_waiting_reqs"]
    return {"dp_rank": 0, "timestamp": state.get("time", time.time()), "num_running_reqs": running,
            "num_waiting_reqs": waiting, "num_total_reqs": running + waiting,
            "num_used_tokens": state["kv_tokens_in_use"], "max_total_num_tokens": state["max_total_num_tokens"],
            "token_usage": state["kv_tokens_in_use"] / max(state["max_total_num_tokens"], 1),
            "gen_throughput": state.get("last_gen_throughput") or 0.0,
            "cache_hit_rate": state.get("cache_hit_rate") or 0.0,
            "max_running_requests": state["max_running_requests"]}


def loads_report(state: dict[str, Any], version: str, include: str | None = None,
                 dp_rank: int | None = None) -> dict[str, Any]:
    """GET /v1/loads: per-rank loads (filtered by `dp_rank`) and their aggregate. `include` is SGLang's
    comma-separated section list; an unknown section is a ValueError."""
    sections = {s.strip() for s in include.split(",")} if include else {"all"}
    invalid = sorted(sections - LOAD_SECTIONS)
    if invalid:
        raise ValueError(f"Invalid include sections: {', '.join(invalid)}. Valid options: "
                         f"{', '.join(sorted(LOAD_SECTIONS))}")
    loads = [rank_load(state)] if dp_rank in (None, 0) else []
    count = max(len(loads), 1)
    aggregate = {
        "total_running_reqs": sum(d["num_running_reqs"] for d in loads),
        "total_waiting_reqs": sum(d["num_waiting_reqs"] for d in loads),
        "total_reqs": sum(d["num_total_reqs"] for d in loads),
        "total_used_tokens": sum(d["num_used_tokens"] for d in loads),
        "avg_token_usage": round(sum(d["token_usage"] for d in loads) / count, 4),
        "avg_throughput": round(sum(d["gen_throughput"] for d in loads) / count, 2),
    }
    return {"timestamp": datetime.now(UTC).isoformat(), "version": version, "dp_rank_count": len(loads),
            "loads": loads, "aggregate": aggregate}


def loads_prometheus(report: dict[str, Any]) -> str:
    """`format=prometheus`: every numeric field of each rank as a gauge labelled with its rank."""
    lines = []
    for load in report["loads"]:
        for key, value in load.items():
            if key != "dp_rank" and isinstance(value, int | float) and not isinstance(value, bool):
                lines += [f"# TYPE tokenloom_{key} gauge", f'tokenloom_{key}{{dp_rank="{load["dp_rank"]}"}} {value}']
    return "\n".join(lines) + "\n"
