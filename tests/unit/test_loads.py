"""The router load reports (`loads.py`) from a scheduler state: SGLang's /get_load shape, which
sglang-router sums `num_tokens` of, and the /v1/loads report with its section check and rank filter."""

from __future__ import annotations

import pytest

from tokenloom.entrypoints.loads import legacy_load, loads_prometheus, loads_report

STATE = {"num_running_reqs": 3, "num_waiting_reqs": 2, "kv_tokens_in_use": 400, "max_total_num_tokens": 1600,
         "max_running_requests": 16, "last_gen_throughput": 12.5, "cache_hit_rate": 0.25, "time": 1000.0}


def test_legacy_load():
    (entry,) = legacy_load(STATE)
    assert {k: entry[k] for k in ("dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens")} == {
        "dp_rank": 0, "num_reqs": 5, "num_waiting_reqs": 2, "num_tokens": 400}
    assert isinstance(entry["ts_tic"], float)


def test_loads_report():
    report = loads_report(STATE, "9.9", include="core, memory")
    (load,) = report["loads"]
    assert (report["version"], report["dp_rank_count"]) == ("9.9", 1)
    assert load == {"dp_rank": 0, "timestamp": 1000.0, "num_running_reqs": 3, "num_waiting_reqs": 2,
                    "num_total_reqs": 5, "num_used_tokens": 400, "max_total_num_tokens": 1600, "token_usage": 0.25,
                    "gen_throughput": 12.5, "cache_hit_rate": 0.25, "max_running_requests": 16}
    assert report["aggregate"] == {"total_running_reqs": 3, "total_waiting_reqs": 2, "total_reqs": 5,
                                   "total_used_tokens": 400, "avg_token_usage": 0.25, "avg_throughput": 12.5}
    assert loads_report(STATE, "9.9", dp_rank=0)["loads"] == [load]
    other = loads_report(STATE, "9.9", dp_rank=3)
    assert other["loads"] == [] and other["aggregate"]["total_reqs"] == 0
    with pytest.raises(ValueError, match="Invalid include sections: bogus"):
        loads_report(STATE, "9.9", include="core,bogus")


def test_loads_prometheus():
    text = loads_prometheus(loads_report(STATE, "9.9"))
    assert 'tokenloom_num_running_reqs{dp_rank="0"} 3\n' in text and "# TYPE tokenloom_token_usage gauge" in text
    assert "dp_rank{" not in text
