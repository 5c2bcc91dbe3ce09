"""Scheduling against a fake worker (it stands where the model worker would): the real `Scheduler`, `KVMemory`
(a small pool on the CPU) and event loops, no model. Continuous batching, chunked prefill, radix-cache hits,
retraction under a tiny pool, EOS, and aborts of waiting and running requests; every test ends with the pools
full.

The fake's next token reads the KV pool: every token id is stored in K at its slot when its step runs, and a
request's next token is the sum of its whole sequence read back through the KV slots the scheduler gave it,
mod `VOCAB`. So a wrong prefix match, a stale row after retraction or a freed-but-still-used slot changes
the tokens, and `reference()` — the same rule applied to plain lists — is an independent expectation."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from tests.scheduler_harness import LoopHarness, Result
from tokenloom.cache.kv_memory import KVMemory
from tokenloom.config import ServerArgs
from tokenloom.executor.token_table import TokenTable
from tokenloom.executor.worker import ForwardOutput
from tokenloom.forward_batch import ForwardMode
from tokenloom.protocol import FlushCacheReply, FlushCacheRequest, GetInternalStateRequest, InternalStateReply
from tokenloom.scheduler.schedule_batch import ScheduleBatch

VOCAB = 997
CONTEXT = 256
GREEDY = {"temperature": 0, "ignore_eos": True}


def reference(prompt: list[int], n: int) -> list[int]:
    seq, out = list(prompt), []
    for _ in range(n):
        out.append(sum(seq) % VOCAB)
        seq.append(out[-1])
    return out


@dataclass
class FakeStep:
    input_ids: torch.Tensor  # may hold future-token placeholders
    out_cache_loc: torch.Tensor
    seq_slots: list[torch.Tensor]  # per request, the KV slots of its positions [0, seq_len), as at prepare
    rows: torch.Tensor  # request rows (where the token table holds a decode step's inputs)
    is_decode: bool


@dataclass
class FakeWorker:
    """The worker interface the scheduler uses (`SchedulerWorker`), over a one-layer, one-head, head_dim-1 pool."""

    memory: KVMemory
    eos_token_ids: tuple[int, ...] = (VOCAB + 1,)  # no token is EOS unless a test says so
    batches: list[tuple[ForwardMode, list[str], list[int]]] = field(default_factory=list)  # mode, rids, new tokens

    def __post_init__(self) -> None:
        self.device = self.memory.device
        self.tokens = TokenTable(self.memory.req_to_token_pool.req_to_token.shape[0], self.device)

    def new_lane_state(self) -> None:
        return None

    def prepare(self, batch: ScheduleBatch, lane_state: None = None) -> FakeStep:
        fb = batch.to_forward_batch()
        # What ModelRunner.prepare does: record the new tokens' slots, then snapshot each request's KV indices.
        self.memory.req_to_token_pool.write(fb.req_pool_indices[fb.token_req_index], fb.positions, fb.out_cache_loc)
        table = self.memory.req_to_token_pool.req_to_token
        seq_slots = [table[row, :n].to(torch.int64).clone()
                     for row, n in zip(fb.req_pool_indices.tolist(), fb.seq_lens.tolist(), strict=True)]
        self.batches.append((fb.forward_mode, [r.rid for r in batch.reqs], fb.extend_seq_lens.tolist()))
        return FakeStep(fb.input_ids.clone(), fb.out_cache_loc.clone(), seq_slots, fb.req_pool_indices.clone(),
                        fb.forward_mode.is_decode())

    def execute(self, step: FakeStep) -> ForwardOutput:
        ids = self.tokens.gather(step.rows) if step.is_decode else step.input_ids
        k = self.memory.kv_pool.k_buffers[0]
        k[0, step.out_cache_loc, 0] = ids.to(k.dtype)  # the "attention backend" stores this step's KV
        next_ids = [int(k[0, slots, 0].to(torch.int64).sum()) % VOCAB for slots in step.seq_slots]
        self.tokens.write(step.rows, torch.tensor(next_ids, dtype=torch.int64, device=self.device))
        return ForwardOutput(next_token_ids=next_ids)


def harness(tokens: int = 512, eos: int | None = None, **server_args: Any) -> tuple[LoopHarness, FakeWorker]:
    defaults: dict[str, Any] = dict(max_total_tokens=tokens, max_running_requests=8, overlap_schedule="off")
    args = ServerArgs(**{**defaults, **server_args})
    memory = KVMemory.build(tokens=tokens, request_slots=args.max_running_requests, context_len=CONTEXT,
                            page_size=args.page_size, num_kv_heads=1, head_dim=1, dtype=torch.float32,
                            device=torch.device("cpu"), start_layer=0, end_layer=1,
                            disable_radix_cache=args.disable_radix_cache)
    worker = FakeWorker(memory) if eos is None else FakeWorker(memory, (eos,))
    return LoopHarness(args, worker, memory, VOCAB), worker


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 31 + 7 * i) % (VOCAB - 1) + 1 for i in range(n)]


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_continuous_batching_admits_and_finishes_with_the_expected_tokens(overlap):
    h, worker = harness(max_running_requests=3, overlap_schedule=overlap)
    prompts = {f"r{i}": prompt(i, 5 + 3 * i) for i in range(6)}
    lengths = {f"r{i}": 4 + 2 * i for i in range(6)}
    for rid, ids in prompts.items():
        h.submit(rid, ids, dict(GREEDY, max_new_tokens=lengths[rid]))
    results = h.run()
    for rid, ids in prompts.items():
        assert results[rid].output_ids == reference(ids, lengths[rid]), rid
        assert results[rid].finish_reason == {"type": "length", "length": lengths[rid]}
    decodes = [rids for mode, rids, _ in worker.batches if mode is ForwardMode.DECODE]
    assert max(len(rids) for rids in decodes) == 3  # --max-running-requests bounds the batch
    # r5 waited while earlier requests decoded, joined when one finished, then decoded beside older ones.
    joined = next(i for i, (mode, rids, _) in enumerate(worker.batches) if mode is ForwardMode.EXTEND and "r5" in rids)
    assert any(mode is ForwardMode.DECODE for mode, _, _ in worker.batches[:joined])
    assert any("r5" in rids and len(rids) > 1 for mode, rids, _ in worker.batches[joined + 1:]
               if mode is ForwardMode.DECODE)
    h.assert_pools_full()


def test_eos_finishes_a_request():
    ids = prompt(3, 9)
    expected = reference(ids, 10)
    eos = expected[4]
    assert eos not in expected[:4]
    h, _ = harness(eos=eos)
    h.submit("a", ids, {"temperature": 0, "max_new_tokens": 10})
    results = h.run()
    assert results["a"].output_ids == expected[:5]
    assert results["a"].finish_reason["type"] == "stop"
    h.assert_pools_full()


@pytest.mark.parametrize("disable_radix_cache", [False, True])
@pytest.mark.parametrize("page_size", [1, 4])
def test_chunked_prefill(disable_radix_cache, page_size):
    h, worker = harness(chunked_prefill_size=8, page_size=page_size, disable_radix_cache=disable_radix_cache)
    long, short = prompt(1, 30), prompt(2, 5)
    h.submit("long", long, dict(GREEDY, max_new_tokens=6))
    h.submit("short", short, dict(GREEDY, max_new_tokens=6))
    results = h.run()
    assert results["long"].output_ids == reference(long, 6)
    assert results["short"].output_ids == reference(short, 6)
    chunks = [new[rids.index("long")] for mode, rids, new in worker.batches
              if mode is ForwardMode.EXTEND and "long" in rids]
    assert chunks == [8, 8, 8, 6]
    h.assert_pools_full()


@pytest.mark.parametrize("page_size", [1, 4])
def test_radix_cache_hit_reports_cached_tokens(page_size):
    h, worker = harness(page_size=page_size)
    base = prompt(5, 40)
    h.submit("a", base, dict(GREEDY, max_new_tokens=4))
    h.run()
    branch = base[:32] + prompt(6, 9)
    h.submit("b", branch, dict(GREEDY, max_new_tokens=4))
    h.submit("c", base, dict(GREEDY, max_new_tokens=4))
    results = h.run()
    assert results["a"].meta["cached_tokens"] == 0
    assert results["b"].meta["cached_tokens"] == 32
    assert results["c"].meta["cached_tokens"] == (len(base) - 1) // page_size * page_size  # one token computed
    for rid, ids in (("a", base), ("b", branch), ("c", base)):
        assert results[rid].output_ids == reference(ids, 4), rid  # the cached KV is the right KV
    new_tokens = {rids[0]: new[0] for mode, rids, new in worker.batches if mode is ForwardMode.EXTEND}
    assert new_tokens["b"] == len(branch) - 32
    h.assert_pools_full()


@pytest.mark.parametrize("overlap", ["off", "on"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_retraction_under_a_tiny_pool_loses_nothing(overlap, page_size):
    # A low conservativeness admits requests on an optimistic estimate of their outputs; the pool then runs
    # out during decode and requests are retracted (freed, re-queued) and recomputed later.
    h, worker = harness(tokens=64, page_size=page_size, overlap_schedule=overlap, schedule_conservativeness=0.1)
    prompts = {f"r{i}": prompt(10 + i, 10) for i in range(4)}
    for rid, ids in prompts.items():
        h.submit(rid, ids, dict(GREEDY, max_new_tokens=30))
    results = h.run()
    for rid, ids in prompts.items():
        assert results[rid].output_ids == reference(ids, 30), rid
        assert results[rid].finish_reason == {"type": "length", "length": 30}
    prefills: dict[str, int] = {}
    for mode, rids, _ in worker.batches:
        if mode is ForwardMode.EXTEND:
            for rid in rids:
                prefills[rid] = prefills.get(rid, 0) + 1
    assert max(prefills.values()) > 1, "no request was retracted and recomputed"
    h.assert_pools_full()


@pytest.mark.parametrize("chunked", [False, True])
def test_abort_while_its_prefill_is_in_flight(chunked):
    """With the overlap scheduler a request whose prefill batch is launched but whose result is not processed
    yet sits in no queue; an abort then must still end it (it used to run on to its length limit)."""
    flags = {"chunked_prefill_size": 8} if chunked else {}
    h, _ = harness(overlap_schedule="on", **flags)
    h.submit("a", prompt(1, 12), dict(GREEDY, max_new_tokens=30))
    h.loop.run_once()  # the prefill (or its first chunk) of "a" is launched; its result waits a step
    assert len(h.loop.inflight) == 1 and not h.scheduler.running and not h.scheduler.waiting_queue
    h.abort("a")
    results = h.run()
    assert results["a"].finish_reason["type"] == "abort" and len(results["a"].output_ids) <= 1
    assert not h.scheduler.prefilling
    h.assert_pools_full()


def test_abort_of_a_waiting_and_of_a_running_request():
    h, _ = harness(max_running_requests=1)
    ids_a, ids_b = prompt(20, 12), prompt(21, 12)
    h.submit("a", ids_a, dict(GREEDY, max_new_tokens=50), stream=True)  # streamed: outputs arrive while it runs
    h.submit("b", ids_b, dict(GREEDY, max_new_tokens=50))
    h.run(until=lambda hh: len(hh.results.get("a", Result()).output_ids) >= 3)
    assert [r.rid for r in h.scheduler.waiting_queue] == ["b"]
    h.abort("b")
    h.run(until=lambda hh: "b" in hh.results)
    assert h.results["b"].finish_reason["type"] == "abort" and h.results["b"].output_ids == []
    h.abort("a")
    results = h.run()
    assert results["a"].finish_reason["type"] == "abort"
    out = results["a"].output_ids
    assert 3 <= len(out) < 50 and out == reference(ids_a, len(out))
    h.assert_pools_full()
    h.submit("c", ids_b, dict(GREEDY, max_new_tokens=5))  # the freed memory serves the next request
    assert h.run()["c"].output_ids == reference(ids_b, 5)
    h.assert_pools_full()



class RecordingLoop:
    """A `LoopControl` that records what the scheduler asked of it."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def settle_all(self) -> None:
        self.calls.append("settle_all")

    def info(self) -> dict[str, Any]:
        self.calls.append("info")
        return {"loop_marker": 7}


def test_the_scheduler_asks_the_loop_passed_to_it_to_settle():
    """Flush and state requests settle the loop that passes them in (the loop is an argument, not an
    attribute the loops overwrite); the state report carries the loop's own info."""
    h, _ = harness(overlap_schedule="on")
    loop = RecordingLoop()
    h.scheduler.handle(GetInternalStateRequest(), loop)
    h.scheduler.handle(FlushCacheRequest(), loop)
    assert loop.calls == ["settle_all", "info", "settle_all"]
    replies = h.outbox.recv_all()
    assert isinstance(replies[0], InternalStateReply) and replies[0].state["loop_marker"] == 7
    assert isinstance(replies[1], FlushCacheReply) and replies[1].success
    assert "loop_marker" not in h.scheduler.internal_state()


def test_retraction_settles_the_loop_first():
    """A decode step that does not fit settles the launched batches before it retracts (finished requests
    may free enough): with the overlap loop driving, its state report then shows a retraction happened only
    after everything in flight was processed, and every request still ends with its reference tokens."""
    h, _ = harness(tokens=48, overlap_schedule="on", max_running_requests=4, schedule_conservativeness=0.3)
    settles = []
    drain = h.loop.settle

    def counting_settle(lane) -> None:
        settles.append(len(h.loop.inflight))
        drain(lane)

    h.loop.settle = counting_settle
    ids = [prompt(30 + i, 10) for i in range(3)]
    for i, p in enumerate(ids):
        h.submit(f"r{i}", p, dict(GREEDY, max_new_tokens=12))
    results = h.run()
    assert h.scheduler.num_retracted > 0 and settles, (h.scheduler.num_retracted, settles)
    for i, p in enumerate(ids):
        assert results[f"r{i}"].output_ids == reference(p, 12)
    h.assert_pools_full()


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_request_longer_than_the_pool_is_clamped_to_it_not_fatal(page_size):
    # 64 slots: a 40-token prompt asking for 100 tokens fits only 64 - 40 - 1 = 23 of them (SGLang's clamp); the
    # scheduler used to run it until the pool ran out and then raise, which ended the server
    h, _ = harness(tokens=64, page_size=page_size)
    ids = prompt(3, 40)
    h.submit("long", ids, dict(GREEDY, max_new_tokens=100))
    h.submit("after", prompt(4, 5), dict(GREEDY, max_new_tokens=3))
    results = h.run()
    assert results["long"].output_ids == reference(ids, 23)
    assert results["long"].finish_reason == {"type": "length", "length": 23}
    assert results["after"].output_ids == reference(prompt(4, 5), 3)
    h.assert_pools_full()


def test_a_last_request_that_cannot_continue_ends_with_500_and_the_scheduler_serves_on():
    # The clamp makes it unexpected; force it: the lone running request's next slot is taken from under it
    h, _ = harness(tokens=64)
    h.submit("a", prompt(5, 10), dict(GREEDY, max_new_tokens=40))
    h.run(until=lambda hh: bool(hh.scheduler.running) and len(hh.scheduler.running[0].output_ids) >= 2)
    scheduler = h.scheduler
    taken = scheduler.allocator.alloc(scheduler.allocator.available_size())  # as a KV leak elsewhere would
    finish_aborted = scheduler._finish_aborted

    def give_back_then_finish(req, message, status=400):  # before the loop's idle check counts the pool
        scheduler.allocator.free(taken)
        finish_aborted(req, message, status)

    scheduler._finish_aborted = give_back_then_finish
    h.run(until=lambda hh: "a" in hh.results and hh.results["a"].finish_reason is not None)
    reason = h.results["a"].finish_reason
    assert reason["type"] == "abort" and reason["status_code"] == 500 and "KV cache pool is full" in reason["message"]
    scheduler._finish_aborted = finish_aborted
    h.submit("b", prompt(6, 5), dict(GREEDY, max_new_tokens=3))
    assert h.run()["b"].output_ids == reference(prompt(6, 5), 3)
    h.assert_pools_full()
