"""Aborts at every stage free KV at once; stop conditions (EOS, stop ids, min_new_tokens, max_new_tokens)
end requests with SGLang-shaped finish reasons. In-process scheduler on a tiny random model."""

from __future__ import annotations

import pytest

from tests.scheduler_harness import Harness

GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def folder(tiny_model_dir):
    return tiny_model_dir("llama")[0]


def _free(h: Harness) -> int:
    return h.runner.token_allocator.available_size() + h.scheduler.tree_cache.evictable_size()


def test_abort_waiting_request(folder):
    h = Harness(folder, max_running_requests=1)
    h.submit("a", list(range(1, 30)), dict(GREEDY, max_new_tokens=50))
    h.submit("b", list(range(2, 40)), dict(GREEDY, max_new_tokens=50))
    h.run(until=lambda hh: len(hh.scheduler.running) == 1)
    assert [r.rid for r in h.scheduler.waiting_queue] == ["b"]
    h.abort("b")
    h.run(until=lambda hh: "b" in hh.results)
    assert h.results["b"].finish_reason["type"] == "abort"
    assert h.results["b"].output_ids == []
    results = h.run()
    assert results["a"].finish_reason == {"type": "length", "length": 50}
    h.assert_pools_full()


def test_abort_chunked_request_frees_kv_now(folder):
    h = Harness(folder, chunked_prefill_size=16, disable_radix_cache=True)
    h.submit("long", list(range(1, 200)), dict(GREEDY, max_new_tokens=5))
    h.run(until=lambda hh: hh.scheduler.chunked_req is not None and hh.scheduler.chunked_req.kv_len >= 32)
    assert _free(h) < h.runner.max_total_num_tokens
    h.abort("long")
    h.run(until=lambda hh: "long" in hh.results)
    assert h.scheduler.chunked_req is None
    assert _free(h) == h.runner.max_total_num_tokens  # freed at once, before the scheduler goes idle
    assert h.results["long"].finish_reason["type"] == "abort"
    h.assert_pools_full()


def test_abort_running_request_frees_kv_now(folder):
    h = Harness(folder, disable_radix_cache=True)
    h.submit("a", list(range(1, 50)), dict(GREEDY, max_new_tokens=400))
    h.submit("b", list(range(3, 20)), dict(GREEDY, max_new_tokens=30))
    h.run(until=lambda hh: any(r.rid == "a" and len(r.output_ids) >= 10 for r in hh.scheduler.running))
    used_before = h.runner.max_total_num_tokens - _free(h)
    h.abort("a")
    h.run(until=lambda hh: "a" in hh.results and hh.results["a"].finish_reason is not None)
    assert h.runner.max_total_num_tokens - _free(h) < used_before - 50
    results = h.run()
    assert results["a"].finish_reason["type"] == "abort" and len(results["a"].output_ids) < 400
    assert results["b"].finish_reason == {"type": "length", "length": 30}
    h.assert_pools_full()


def test_abort_unknown_rid_is_harmless(folder):
    h = Harness(folder)
    h.abort("nobody")
    h.submit("x", [5, 6, 7], dict(GREEDY, max_new_tokens=3))
    assert h.run()["x"].finish_reason == {"type": "length", "length": 3}


def test_eos_stop_token_and_min_new_tokens(folder):
    h = Harness(folder, eos=(0,))
    prompt = list(range(10, 40))
    h.submit("free", prompt, dict(GREEDY, max_new_tokens=30))
    ids = h.run()["free"].output_ids
    target = ids[5]
    first = ids.index(target)
    # The token greedy decoding produces at step `first` is treated as EOS.
    h2 = Harness(folder, eos=(target,))
    h2.submit("eos", prompt, {"temperature": 0, "max_new_tokens": 30})
    h2.submit("ignore", prompt, {"temperature": 0, "max_new_tokens": 30, "ignore_eos": True})
    h2.submit("stopid", prompt, dict(GREEDY, max_new_tokens=30, stop_token_ids=[target]))
    res = h2.run()
    assert res["eos"].finish_reason == {"type": "stop", "matched": target}
    assert res["eos"].output_ids == ids[: first + 1]
    assert res["ignore"].finish_reason == {"type": "length", "length": 30}
    assert res["stopid"].finish_reason == {"type": "stop", "matched": target}
    # min_new_tokens masks EOS until reached: the output never contains it before then.
    h3 = Harness(folder, eos=(target,))
    h3.submit("min", prompt, {"temperature": 0, "max_new_tokens": 30, "min_new_tokens": first + 3})
    out = h3.run()["min"]
    assert target not in out.output_ids[: first + 3]
    assert len(out.output_ids) >= first + 3
    h3.assert_pools_full()


def test_max_new_tokens_none_runs_to_context_limit(folder):
    h = Harness(folder, context_length=64)
    h.submit("n", list(range(1, 41)), {"temperature": 0, "max_new_tokens": None, "ignore_eos": True})
    res = h.run()["n"]
    assert res.finish_reason["type"] == "length" and 40 + len(res.output_ids) == 63


def test_too_long_prompt_is_rejected_not_dropped(folder):
    h = Harness(folder, max_total_tokens=128)
    h.submit("big", list(range(1, 200)), dict(GREEDY, max_new_tokens=3))
    res = h.run()["big"]
    assert res.finish_reason["type"] == "abort" and res.finish_reason["status_code"] == 400
    assert "longer than" in res.finish_reason["message"]


def test_queue_full_gets_503(folder):
    h = Harness(folder, max_queued_requests=2, max_running_requests=1)
    for i in range(4):
        h.submit(f"q{i}", list(range(1, 20)), dict(GREEDY, max_new_tokens=5))
    res = h.run()
    statuses = [res[f"q{i}"].finish_reason for i in range(4)]
    assert statuses[3]["type"] == "abort" and statuses[3]["status_code"] == 503
    assert statuses[3]["message"] == "The request queue is full."
    assert all(s["type"] == "length" for s in statuses[:2])


def test_decode_log_line_every_n_steps(folder, caplog):
    import logging

    h = Harness(folder, decode_log_interval=5)
    with caplog.at_level(logging.INFO, logger="tokenloom.scheduler"):
        h.submit("a", list(range(1, 30)), dict(GREEDY, max_new_tokens=21))
        h.run()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Decode batch.")]
    assert len(lines) == 4  # 20 decode steps after the prefill token
    assert "#running-req: 1" in lines[0] and "token usage:" in lines[0] and "cache hit rate:" in lines[0]
    assert "gen throughput (token/s):" in lines[0] and "#queue-req: 0" in lines[0]
