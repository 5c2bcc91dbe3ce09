"""The scheduler's micro-batch lanes (scheduler/lane.py) driven as a pipeline drives them (tests/lane_driver.py:
each lane's result processed L - 1 iterations after launch), against the fake worker whose tokens depend on
every KV slot the scheduler handed out. Outputs must equal `reference()` and the pools must end full for
many requests, chunked prefill with chunks of one prompt in several lanes, radix hits, retraction inside a
lane, a tight `--max-running-requests`, and aborts of requests in every lane (SGLang PR #29405's shape)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.lane_driver import LaneDriver
from tests.scheduler_harness import LoopHarness
from tests.unit.test_scheduler_fake_runner import CONTEXT, GREEDY, VOCAB, FakeWorker, prompt, reference
from tokenloom.cache.kv_memory import KVMemory
from tokenloom.config import ServerArgs
from tokenloom.forward_batch import ForwardMode


def lanes_harness(lanes: int, tokens: int = 512, lane_cap: int | None = None,
                  **server_args: Any) -> tuple[LoopHarness, FakeWorker]:
    defaults: dict[str, Any] = dict(max_total_tokens=tokens, max_running_requests=8, overlap_schedule="off")
    args = ServerArgs(**{**defaults, **server_args})
    memory = KVMemory.build(tokens=tokens, request_slots=args.max_running_requests + 4, context_len=CONTEXT,
                            page_size=args.page_size, num_kv_heads=1, head_dim=1, dtype=torch.float32,
                            device=torch.device("cpu"), start_layer=0, end_layer=1,
                            disable_radix_cache=args.disable_radix_cache)
    worker = FakeWorker(memory)
    h = LoopHarness(args, worker, memory, VOCAB, num_lanes=lanes, lane_cap=lane_cap, make_loop=LaneDriver)
    return h, worker



@pytest.mark.parametrize("lanes", [2, 3, 4])
def test_many_requests_over_lanes_give_the_reference_tokens(lanes):
    h, worker = lanes_harness(lanes, lane_cap=3)
    prompts = {f"r{i}": prompt(i, 4 + (5 * i) % 13) for i in range(11)}
    lengths = {f"r{i}": 3 + (7 * i) % 11 for i in range(11)}
    for rid, ids in prompts.items():
        h.submit(rid, ids, dict(GREEDY, max_new_tokens=lengths[rid]))
    results = h.run()
    for rid, ids in prompts.items():
        assert results[rid].output_ids == reference(ids, lengths[rid]), rid
    decodes = [rids for mode, rids, _ in worker.batches if mode is ForwardMode.DECODE]
    assert max(len(rids) for rids in decodes) <= 3  # the lane cap bounds each micro-batch
    assert h.loop.max_admitted <= 8  # --max-running-requests bounds all lanes together
    # a request decodes in one lane only: never in two batches launched within L - 1 iterations of each other
    assert len({rid for rids in decodes for rid in rids}) == 11
    h.assert_pools_full()


@pytest.mark.parametrize("lanes", [2, 3])
@pytest.mark.parametrize("page_size", [1, 4])
def test_chunked_prefill_with_chunks_in_several_lanes(lanes, page_size):
    h, worker = lanes_harness(lanes, chunked_prefill_size=8, page_size=page_size)
    long_a, long_b, short = prompt(1, 45), prompt(2, 30), prompt(3, 5)
    h.submit("a", long_a, dict(GREEDY, max_new_tokens=6))
    h.submit("b", long_b, dict(GREEDY, max_new_tokens=5))
    h.submit("c", short, dict(GREEDY, max_new_tokens=7))
    results = h.run()
    for rid, ids, n in (("a", long_a, 6), ("b", long_b, 5), ("c", short, 7)):
        assert results[rid].output_ids == reference(ids, n), rid
    chunk_batches = [i for i, (mode, rids, _) in enumerate(worker.batches) if mode is ForwardMode.EXTEND
                     and "a" in rids]
    assert len(chunk_batches) >= 5
    # consecutive chunks of "a" were launched in consecutive iterations (different lanes), not one per round
    assert any(j - i == 1 for i, j in zip(chunk_batches, chunk_batches[1:], strict=False))
    h.assert_pools_full()


def test_radix_hits_across_lanes():
    h, worker = lanes_harness(3)
    base = prompt(7, 40)
    h.submit("a", base, dict(GREEDY, max_new_tokens=4))
    h.run()
    h.submit("b", base[:32] + prompt(8, 6), dict(GREEDY, max_new_tokens=4))
    h.submit("c", base, dict(GREEDY, max_new_tokens=4))
    results = h.run()
    assert results["b"].meta["cached_tokens"] == 32
    assert results["c"].output_ids == reference(base, 4) and results["b"].output_ids == reference(
        base[:32] + prompt(8, 6), 4)
    h.assert_pools_full()


@pytest.mark.parametrize("lanes", [2, 3])
def test_retraction_inside_a_lane_loses_nothing(lanes):
    h, worker = lanes_harness(lanes, tokens=72, schedule_conservativeness=0.1, lane_cap=2)
    prompts = {f"r{i}": prompt(10 + i, 10) for i in range(6)}
    for rid, ids in prompts.items():
        h.submit(rid, ids, dict(GREEDY, max_new_tokens=24))
    results = h.run()
    for rid, ids in prompts.items():
        assert results[rid].output_ids == reference(ids, 24), rid
    assert h.scheduler.num_retracted > 0
    h.assert_pools_full()


def test_max_running_requests_two_over_three_lanes():
    h, worker = lanes_harness(3, max_running_requests=2)
    prompts = {f"r{i}": prompt(40 + i, 6) for i in range(5)}
    for rid, ids in prompts.items():
        h.submit(rid, ids, dict(GREEDY, max_new_tokens=5))
    results = h.run()
    for rid, ids in prompts.items():
        assert results[rid].output_ids == reference(ids, 5)
    assert h.loop.max_admitted <= 2
    h.assert_pools_full()


def test_abort_every_request_with_one_per_lane():
    """Four lanes of one request each (pp_max_micro_batch_size 1): aborting all of them, whichever lane or
    launched batch they sit in, ends every one at once and frees everything (SGLang missed other slots')."""
    h, _ = lanes_harness(4, tokens=1200, lane_cap=1)
    for i in range(4):
        h.submit(f"r{i}", prompt(50 + i, 8), dict(GREEDY, max_new_tokens=200), stream=True)
    h.run(until=lambda hh: sum(len(r.output_ids) for r in hh.results.values()) >= 12
          and all(len(lane.running) == 1 for lane in hh.scheduler.lanes))
    assert sum(bool(lane.launched) for lane in h.scheduler.lanes) >= 2  # several lanes have a batch in flight
    for i in range(4):
        h.abort(f"r{i}")
    results = h.run()
    assert all(results[f"r{i}"].finish_reason["type"] == "abort" for i in range(4))
    assert all(len(results[f"r{i}"].output_ids) < 20 for i in range(4))
    h.assert_pools_full()


def test_abort_of_a_request_whose_prefill_is_in_flight_in_another_lane():
    h, _ = lanes_harness(3)
    h.submit("a", prompt(60, 12), dict(GREEDY, max_new_tokens=30))
    h.loop.run_once()  # lane 0 launched a's prefill; its result is processed two iterations later
    assert h.scheduler.lanes[0].launched and not h.scheduler.running
    h.abort("a")
    results = h.run()
    assert results["a"].finish_reason["type"] == "abort" and len(results["a"].output_ids) <= 1
    h.assert_pools_full()


@pytest.mark.parametrize("flag, expected", [(None, 4), (3, 3), (100, 8)])
def test_pp_max_micro_batch_size_caps_each_lane(flag, expected):
    """--pp-max-micro-batch-size (default --max-running-requests // --pp-size) is every lane's cap, within
    --max-running-requests; the lanes then never hold more than it per micro-batch."""
    h, worker = lanes_harness(2, lane_cap=None, pp_size=2, pp_max_micro_batch_size=flag)
    assert [lane.cap for lane in h.scheduler.lanes] == [expected, expected]
    for i in range(10):
        h.submit(f"r{i}", prompt(70 + i, 5), dict(GREEDY, max_new_tokens=4))
    h.run()
    assert max(len(rids) for mode, rids, _ in worker.batches) == expected
    h.assert_pools_full()
