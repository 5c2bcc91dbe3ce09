"""Greedy outputs do not depend on how requests are scheduled: one at a time vs all at once, radix cache on
or off, chunked prefill 16 / 64 / off, page size 1 vs 16, LPM vs FCFS, and a KV pool so small that requests
are retracted and recomputed. Every request finishes and the pools are full again afterwards."""

from __future__ import annotations

import pytest
import torch

from tests.scheduler_harness import Harness

NUM_REQS = 10


def _workload(seed: int = 0) -> list[tuple[list[int], dict]]:
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(1, 256, (40,), generator=g).tolist()
    reqs = []
    for i in range(NUM_REQS):
        n = int(torch.randint(3, 150, (1,), generator=g))
        ids = torch.randint(1, 256, (n,), generator=g).tolist()
        if i % 3 == 0:
            ids = shared + ids[:20]  # shared prefixes exercise the radix cache
        reqs.append((ids, {"temperature": 0, "max_new_tokens": 12 + 7 * i, "ignore_eos": True}))
    return reqs


def _run(folder: str, one_at_a_time: bool = False, **server_args) -> dict[str, list[int]]:
    h = Harness(folder, **server_args)
    outputs = {}
    for i, (ids, params) in enumerate(_workload()):
        h.submit(f"r{i}", ids, params)
        if one_at_a_time:
            h.run()
    results = h.run()
    h.assert_pools_full()
    for i, (_, params) in enumerate(_workload()):
        res = results[f"r{i}"]
        assert res.finish_reason == {"type": "length", "length": params["max_new_tokens"]}
        assert len(res.output_ids) == params["max_new_tokens"]
        outputs[f"r{i}"] = res.output_ids
    return outputs, results, h


@pytest.fixture(scope="module")
def folder(tiny_model_dir):
    return tiny_model_dir("llama")[0]


@pytest.fixture(scope="module")
def reference(folder):
    return _run(folder, one_at_a_time=True, disable_radix_cache=True, chunked_prefill_size=-1)[0]


@pytest.mark.parametrize("config", [
    {},
    {"disable_radix_cache": True},
    {"chunked_prefill_size": 16},
    {"chunked_prefill_size": 64},
    {"chunked_prefill_size": -1},
    {"page_size": 16},
    {"page_size": 16, "chunked_prefill_size": 32},
    {"schedule_policy": "lpm"},
    {"max_running_requests": 3},
    {"max_prefill_tokens": 50},
], ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "default")
def test_all_at_once_matches_one_at_a_time(folder, reference, config):
    outputs, _, _ = _run(folder, **config)
    assert outputs == reference


@pytest.mark.parametrize("page_size", [1, 16])
def test_retraction_recomputes_identically(folder, reference, page_size):
    outputs, results, h = _run(folder, max_total_tokens=360, schedule_conservativeness=0.05, page_size=page_size,
                               chunked_prefill_size=64)
    assert outputs == reference
    assert max(r.meta["total_retractions"] for r in results.values()) > 0


def test_shared_prefix_reports_cached_tokens(folder):
    h = Harness(folder)
    prompt = list(range(1, 101))
    h.submit("a", prompt, {"temperature": 0, "max_new_tokens": 4})
    h.run()
    h.submit("b", prompt[:80] + [7, 8, 9], {"temperature": 0, "max_new_tokens": 4})
    results = h.run()
    assert results["a"].meta["cached_tokens"] == 0
    assert results["b"].meta["cached_tokens"] == 80
    h.assert_pools_full()


def test_radix_off_reports_no_cached_tokens(folder):
    h = Harness(folder, disable_radix_cache=True)
    prompt = list(range(1, 60))
    for rid in "ab":
        h.submit(rid, prompt, {"temperature": 0, "max_new_tokens": 3})
        h.run()
    assert h.results["b"].meta["cached_tokens"] == 0
    h.assert_pools_full()
