"""Disaggregated scheduling in one process (tests/pd_harness.py): a prefill and a decode scheduler with real
agents, bootstrap server and control messages, a memmove in place of the transfer engine, the fake worker
whose tokens depend on the KV it reads back. The decode side's answers equal the unified reference
(`reference`) only if the prompt's KV and the first token arrived intact; every test ends with both pools
full (the harness checks idle integrity on both sides)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from tests.pd_harness import PDPair, small_memory
from tests.scheduler_harness import LoopHarness
from tests.unit.test_scheduler_fake_runner import VOCAB, FakeWorker, prompt, reference
from tokenloom.config import ServerArgs
from tokenloom.protocol import TransferEvent

CONTEXT = 256
GREEDY = {"temperature": 0, "ignore_eos": True}


class PDFakeWorker(FakeWorker):
    def write_tokens(self, rows: list[int], token_ids: list[int]) -> None:
        import torch

        self.tokens.write(torch.tensor(rows, dtype=torch.int64), torch.tensor(token_ids, dtype=torch.int64))


def make_harness(tokens: int = 512, **server_args: Any) -> tuple[LoopHarness, PDFakeWorker]:
    defaults: dict[str, Any] = dict(max_total_tokens=tokens, max_running_requests=8, overlap_schedule="off",
                                    num_reserved_decode_tokens=4)
    args = ServerArgs(**{**defaults, **server_args})
    memory = small_memory(args, tokens, CONTEXT)
    worker = PDFakeWorker(memory)
    return LoopHarness(args, worker, memory, VOCAB), worker


@pytest.fixture
def pair_factory():
    pairs = []

    def make(**kw: Any) -> PDPair:
        pairs.append(PDPair(make_harness, **kw))
        return pairs[-1]

    yield make
    for p in pairs:
        p.close()


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_decode_continues_exactly_where_prefill_stopped(pair_factory, overlap):
    pair = pair_factory(prefill_args={"chunked_prefill_size": 8, "overlap_schedule": overlap},
                        decode_args={"overlap_schedule": overlap})
    prompts = {f"r{i}": prompt(i, 5 + 7 * i) for i in range(5)}  # up to 33 tokens: several 8-token chunks
    for rid, ids in prompts.items():
        pair.submit(rid, ids, dict(GREEDY, max_new_tokens=6))
    results = pair.run()
    for rid, ids in prompts.items():
        assert results[rid].output_ids == reference(ids, 6), rid
        assert results[rid].finish_reason == {"type": "length", "length": 6}
    # the prefill side answered each with its first token only, once its KV was sent
    for rid, ids in prompts.items():
        assert pair.prefill_h.results[rid].output_ids == reference(ids, 1)
    assert pair.prefill.side.transferred == 5 and pair.decode.side.received == 5
    assert pair.prefill.engine.writes > 5  # chunks streamed: more writes than requests


def test_prefill_radix_hit_still_sends_the_whole_prompt(pair_factory):
    pair = pair_factory()
    shared = prompt(1, 20)
    pair.submit("a", shared + [5, 6], dict(GREEDY, max_new_tokens=4))
    pair.run()
    pair.submit("b", shared + [7, 8, 9], dict(GREEDY, max_new_tokens=4))
    results = pair.run()
    assert results["b"].output_ids == reference(shared + [7, 8, 9], 4)
    assert pair.prefill_h.results["b"].meta["cached_tokens"] >= 16  # the prefix came from the radix cache
    assert results["b"].meta["cached_tokens"] == pair.prefill_h.results["b"].meta["cached_tokens"]


def test_first_token_finishing_the_request_and_room_reuse_refused(pair_factory):
    pair = pair_factory()
    pair.submit("one", prompt(3, 9), dict(GREEDY, max_new_tokens=1))
    results = pair.run()
    assert results["one"].output_ids == reference(prompt(3, 9), 1)
    pair.submit("zero", prompt(3, 9), dict(GREEDY, max_new_tokens=0))
    results = pair.run()
    assert results["zero"].finish_reason["type"] == "abort" and results["zero"].finish_reason["status_code"] == 400


def test_decode_pre_allocation_waits_for_memory_and_retracts_to_host(pair_factory):
    # 64 decode slots: any two of these (12-token prompts, 40 new tokens: 52 slots each) cannot finish together
    pair = pair_factory(decode_args={"tokens": 64, "max_running_requests": 4, "num_reserved_decode_tokens": 1})
    prompts = {f"r{i}": prompt(10 + i, 12) for i in range(4)}
    for rid, ids in prompts.items():
        pair.submit(rid, ids, dict(GREEDY, max_new_tokens=40))
    results = pair.run()
    for rid, ids in prompts.items():
        assert results[rid].output_ids == reference(ids, 40), rid
    info = pair.decode.side.info()
    assert info["num_offloaded_reqs"] > 0, info  # retraction went through host memory, not recompute
    assert pair.decode_h.scheduler.num_retracted == info["num_offloaded_reqs"]


def step_until(pair: PDPair, condition: Any, timeout_s: float = 20.0) -> None:
    """Step both sides until `condition()` holds (bounded in wall-clock time, not steps: a loaded machine is slow
    to deliver the agents' control messages)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        if not pair.step():
            time.sleep(0.001)


@pytest.mark.parametrize("where", ["prefill-bootstrap", "prefill-waiting", "prefill-chunked", "prefill-inflight",
                                   "decode-prealloc", "decode-transfer", "decode-running"])
def test_an_abort_in_every_queue_frees_everything(pair_factory, where):
    # "waiting": the prefill pool holds a first request's 200 tokens but not 20 more, and that request's KV stays
    # held while its last write is held back, so "x" cannot leave the waiting queue whatever the timing
    prefill_pool = {"tokens": 210} if where == "prefill-waiting" else {}
    pair = pair_factory(prefill_args={"chunked_prefill_size": 4, "max_running_requests": 1, **prefill_pool})
    if where == "prefill-inflight":
        pair.prefill.engine.delay_s = 0.3  # the last chunk's write is still going when the abort comes
    if where == "prefill-waiting":
        aux = pair.decode.aux  # the last chunk's write is the one carrying the metadata slot
        pair.prefill.engine.hold_when = lambda runs: any(aux.base_addr <= dst < aux.base_addr + aux.nbytes
                                                         for _, dst, _ in runs)
        pair.submit("first", prompt(3, 200), dict(GREEDY, max_new_tokens=2))
        step_until(pair, lambda: bool(pair.prefill.side.inflight))
    side, queue = where.split("-")
    ids = prompt(4, 20)
    if queue == "bootstrap":  # the decode side never hears of it: the prefill side waits for its destination
        pair.submit("x", ids, dict(GREEDY, max_new_tokens=8), to=("prefill",))
        for _ in range(5):
            pair.step()
        assert pair.prefill.side.bootstrap_queue
        pair.abort("x", "prefill")
        pair.step()
        assert pair.prefill_h.results["x"].finish_reason["type"] == "abort"
        pair.submit("y", prompt(5, 10), dict(GREEDY, max_new_tokens=3))
        assert pair.run(["y"])["y"].output_ids == reference(prompt(5, 10), 3)
        return
    pair.submit("x", ids, dict(GREEDY, max_new_tokens=200))
    until = {"chunked": lambda: pair.prefill_h.scheduler.chunked_req is not None,  # mid-way through its chunks
             "waiting": lambda: any(r.rid == "x" for r in pair.prefill_h.scheduler.waiting_queue),
             "inflight": lambda: bool(pair.prefill.side.inflight),
             "prealloc": lambda: bool(pair.decode.side.prealloc),
             "transfer": lambda: bool(pair.decode.side.transfer),
             "running": lambda: bool(pair.decode_h.scheduler.running)}[queue]
    step_until(pair, until)
    pair.abort("x", side)
    if where == "prefill-waiting":
        pair.step()
        assert pair.prefill_h.results["x"].finish_reason["type"] == "abort"
        pair.prefill.engine.gate.set()
    if side == "prefill":  # the decode side learns from the prefill entry and fails the room
        pair.run(["x"])
        assert pair.decode_h.results["x"].finish_reason["type"] == "abort"
    else:
        pair.run(["x"])
    assert pair.decode_h.results["x"].finish_reason["type"] == "abort"
    pair.submit("y", prompt(5, 10), dict(GREEDY, max_new_tokens=3))
    assert pair.run(["y"])["y"].output_ids == reference(prompt(5, 10), 3)


def test_transfer_failures_end_requests_with_500_and_the_pair_keeps_serving(pair_factory):
    pair = pair_factory()
    pair.prefill.engine.fail_next = 2
    for i in range(3):
        pair.submit(f"r{i}", prompt(20 + i, 10), dict(GREEDY, max_new_tokens=4))
    results = pair.run()
    failed = [r for r in results.values() if r.finish_reason["type"] == "abort"]
    assert len(failed) == 2 and all(r.finish_reason["status_code"] == 500 for r in failed)
    assert all("KV transfer" in r.finish_reason["message"] for r in failed)
    ok = [rid for rid, r in results.items() if r.finish_reason["type"] == "length"]
    assert len(ok) == 1 and results[ok[0]].output_ids == reference(prompt(20 + int(ok[0][1]), 10), 4)


def test_bootstrap_and_waiting_timeouts_fail_the_room_on_both_sides(pair_factory):
    pair = pair_factory(bootstrap_timeout_s=0.3, waiting_timeout_s=0.3)
    pair.submit("lonely-prefill", prompt(6, 10), dict(GREEDY, max_new_tokens=4), to=("prefill",))
    pair.submit("lonely-decode", prompt(7, 10), dict(GREEDY, max_new_tokens=4), to=("decode",))
    results = pair.run(["lonely-decode"], timeout_s=10)
    assert "timed out" in results["lonely-decode"].finish_reason["message"]
    while pair.prefill_h.results.get("lonely-prefill") is None or not pair.prefill_h.scheduler.is_idle():
        pair.step()
    assert "timed out" in pair.prefill_h.results["lonely-prefill"].finish_reason["message"]
    pair.submit("y", prompt(5, 10), dict(GREEDY, max_new_tokens=3))
    assert pair.run(["y"])["y"].output_ids == reference(prompt(5, 10), 3)


def test_page_size_mismatch_is_refused_at_bootstrap(pair_factory):
    pair = pair_factory(prefill_args={"page_size": 4}, decode_args={"page_size": 1})
    pair.submit("x", prompt(8, 10), dict(GREEDY, max_new_tokens=4))
    results = pair.run(["x"])
    assert "page size mismatch" in results["x"].finish_reason["message"]
    assert results["x"].finish_reason["status_code"] == 500


def test_fake_bootstrap_host_is_served_locally_on_both_sides(pair_factory):
    pair = pair_factory()
    for h in (pair.prefill_h, pair.decode_h):
        from tokenloom.protocol import Bootstrap, TokenizedRequest
        from tokenloom.sampling.sampling_params import SamplingParams

        sp = SamplingParams.from_dict(dict(GREEDY, max_new_tokens=5), VOCAB)
        h.inbox.send(TokenizedRequest("warm", None, prompt(9, 7), sp, bootstrap=Bootstrap("2.2.2.2", 0, 1)))
    for _ in range(200):
        pair.step()
    for h in (pair.prefill_h, pair.decode_h):
        assert h.results["warm"].output_ids == reference(prompt(9, 7), 5)
        h.scheduler.check_idle_integrity()


def test_a_decode_server_of_another_tp_size_than_disaggregation_decode_tp_is_refused(pair_factory):
    pair = pair_factory(expected_decode_tp=2)  # the prefill server's --disaggregation-decode-tp 2; decode has TP 1
    pair.submit("x", prompt(8, 10), dict(GREEDY, max_new_tokens=4))
    results = pair.run(["x"])
    assert "--disaggregation-decode-tp 2" in results["x"].finish_reason["message"], results["x"].finish_reason


def test_disaggregation_decode_polling_interval_polls_the_queues_less_often(pair_factory):
    polls = {}
    for interval in (1, 4):
        pair = pair_factory(decode_args={"disaggregation_decode_polling_interval": interval})
        pair.submit("long", prompt(30, 10), dict(GREEDY, max_new_tokens=60))
        pair.run(["long"])
        for i in range(3):
            pair.submit(f"r{i}", prompt(31 + i, 8), dict(GREEDY, max_new_tokens=20))
        pair.submit("long2", prompt(40, 10), dict(GREEDY, max_new_tokens=60))
        results = pair.run()
        for rid, ids in [("r0", prompt(31, 8)), ("r1", prompt(32, 8)), ("r2", prompt(33, 8))]:
            assert results[rid].output_ids == reference(ids, 20)
        polls[interval] = pair.decode.side.queue_polls
    assert polls[4] < 0.7 * polls[1], polls


def test_a_metadata_slot_of_another_room_fails_the_request_instead_of_a_wrong_token(pair_factory):
    pair = pair_factory()

    def overwrite_room(runs: list[tuple[int, int, int]]) -> None:
        import ctypes

        _, dst, n = runs[-1]  # the metadata slot goes last, with the last chunk
        if n < 4096:
            ctypes.c_int64.from_address(dst).value = 12345  # another request's room
    pair.prefill.engine.tamper = overwrite_room
    pair.submit("x", prompt(8, 10), dict(GREEDY, max_new_tokens=4))
    results = pair.run(["x"])
    assert "context corruption" in results["x"].finish_reason["message"], results["x"].finish_reason
    assert results["x"].output_ids == []


def test_a_kv_dtype_mismatch_is_refused_at_bootstrap(pair_factory):
    pair = pair_factory(decode_kv_dtype="bfloat16")
    pair.submit("x", prompt(8, 10), dict(GREEDY, max_new_tokens=4))
    results = pair.run(["x"])
    assert "KV cache dtype mismatch" in results["x"].finish_reason["message"]


def test_many_requests_through_a_tiny_decode_pool_all_finish(pair_factory):
    """Seed 001's stress in miniature: far more decode KV wanted than the pool holds, optimistic admission."""
    pair = pair_factory(decode_args={"tokens": 96, "max_running_requests": 8, "num_reserved_decode_tokens": 1})
    prompts = {f"r{i}": prompt(50 + i, 6 + i % 7) for i in range(40)}
    lengths = {rid: 10 + (i * 7) % 25 for i, rid in enumerate(prompts)}
    for rid, ids in prompts.items():
        pair.submit(rid, ids, dict(GREEDY, max_new_tokens=lengths[rid]))
    results = pair.run(timeout_s=60)
    for rid, ids in prompts.items():
        assert results[rid].output_ids == reference(ids, lengths[rid]), rid
    assert pair.decode.side.info()["num_offloaded_reqs"] > 0


def test_a_request_aborted_on_prefill_before_its_decode_half_arrived_ends_there_too(pair_factory):
    # The router sends both halves at once and the client's abort reaches the prefill server first: the decode
    # half, arriving later, must not wait for KV that never comes (its destination is answered with an abort)
    pair = pair_factory()
    pair.submit("x", prompt(4, 20), dict(GREEDY, max_new_tokens=8), to=("prefill",))
    for _ in range(3):
        pair.step()
    pair.abort("x", "prefill")
    step_until(pair, lambda: "x" in pair.prefill_h.results and pair.prefill_h.results["x"].finish_reason is not None)
    pair.submit("x", prompt(4, 20), dict(GREEDY, max_new_tokens=8), to=("decode",))  # the same room
    finish = pair.run(["x"], timeout_s=20)["x"].finish_reason
    assert finish["type"] == "abort" and not finish.get("status_code"), finish  # an abort, not an error
    pair.submit("y", prompt(5, 10), dict(GREEDY, max_new_tokens=3))
    assert pair.run(["y"])["y"].output_ids == reference(prompt(5, 10), 3)


def test_a_full_decode_queue_refuses_with_503_and_the_prefill_half_ends_too(pair_factory):
    # --max-queued-requests counts the pre-allocation queue; a refused request's prefill half is told to end
    # (it would otherwise wait for the decode side's destination until the bootstrap timeout)
    pair = pair_factory(decode_args={"max_queued_requests": 1})
    for i in range(4):
        pair.submit(f"r{i}", prompt(30 + i, 30), dict(GREEDY, max_new_tokens=20))
    results = pair.run(timeout_s=20)
    refused = sorted(rid for rid, r in results.items() if r.finish_reason.get("status_code") == 503)
    assert refused == ["r1", "r2", "r3"], {rid: r.finish_reason for rid, r in results.items()}
    assert all("queue is full" in results[rid].finish_reason["message"] for rid in refused)
    assert results["r0"].output_ids == reference(prompt(30, 30), 20)
    for rid in refused:
        assert pair.prefill_h.results[rid].finish_reason["type"] == "abort"


def test_an_abort_on_both_servers_at_once_frees_the_decode_slots_at_once(pair_factory):
    # The router's client aborts on both servers. Found by the abort storm: the decode half, aborted while its
    # transfer was pending, keeps its slots until the prefill side lets go of the room; the prefill server's own
    # abort made it forget the room before it sent that notice, so the slots stayed held until the drain bound
    # (the transfer timeout + 5 s: 65 s)
    pair = pair_factory(prefill_args={"chunked_prefill_size": 4, "max_running_requests": 1})
    pair.submit("x", prompt(4, 40), dict(GREEDY, max_new_tokens=8))
    step_until(pair, lambda: bool(pair.decode.side.transfer))  # its destination is sent; 10 chunks to go
    assert "x" not in pair.prefill_h.results
    pair.abort("x", "decode")
    pair.decode_h.loop.run_once()  # the decode half drains; its agent tells the prefill entry
    assert pair.decode.side.draining
    time.sleep(0.3)  # the prefill agent has queued the peer's abort as an event for its scheduler ...
    pair.abort("x", "prefill")  # ... which sees the client's own abort first, and forgets the room
    started = time.monotonic()
    step_until(pair, lambda: not pair.decode.side.draining)
    assert time.monotonic() - started < 5, "the decode slots were held until the drain bound"
    assert pair.decode.side.failed == pair.prefill.side.failed == 0  # client aborts, no failed transfer
    pair.submit("y", prompt(5, 10), dict(GREEDY, max_new_tokens=3))
    assert pair.run(["y"], timeout_s=20)["y"].output_ids == reference(prompt(5, 10), 3)



def test_a_room_draining_after_a_client_abort_keeps_its_slots_when_it_then_fails_while_writes_may_run(pair_factory):
    # The client aborts on the decode server mid-transfer (the room drains: its slots wait for the prefill side to
    # let go); then the room fails while a prefill write may still run (the decode entry saw a writer fail): the
    # slots must still wait, not be freed at once under a write that may land in them
    pair = pair_factory()
    writing = threading.Event()

    def hold(runs: list[tuple[int, int, int]]) -> bool:
        writing.set()
        return True
    pair.prefill.engine.hold_when = hold  # the room's (only) write is held until the gate opens
    pair.submit("x", prompt(4, 20), dict(GREEDY, max_new_tokens=8))
    step_until(pair, writing.is_set)
    room = pair.rooms["x"]
    pair.abort("x", "decode")
    pair.decode_h.loop.run_once()  # (the prefill loop is not stepped: its let-go would wait for the held write)
    assert room in pair.decode.side.draining
    pair.decode_h.inbox.send(TransferEvent(room, "failed", "a prefill rank's write failed", {"writes_may_run": True}))
    pair.decode_h.loop.run_once()
    assert room in pair.decode.side.draining, "the slots were freed while a write may still land in them"
    pair.decode_h._collect()
    assert pair.decode_h.results["x"].finish_reason["type"] == "abort"
    pair.prefill.engine.gate.set()
    pair.run(["x"])  # the write ends, the prefill side lets go: both sides idle with full pools
    pair.submit("y", prompt(5, 10), dict(GREEDY, max_new_tokens=3))
    assert pair.run(["y"])["y"].output_ids == reference(prompt(5, 10), 3)


def test_a_rooms_failure_counts_once_however_many_notices_of_it_come(pair_factory):
    # a late notice of a room the decode side already failed and forgot (a bootstrap answer after the room's
    # timeout, a prefill abort after a drain's bound) finds nothing to end and counts nothing
    pair = pair_factory(prefill_args={"page_size": 4}, decode_args={"page_size": 1})
    pair.submit("x", prompt(8, 10), dict(GREEDY, max_new_tokens=4))
    assert "page size mismatch" in pair.run(["x"])["x"].finish_reason["message"]
    assert pair.decode.side.info()["num_failed_transfer_reqs"] == 1
    pair.decode_h.inbox.send(TransferEvent(pair.rooms["x"], "failed", "a late notice"))
    pair.run(["x"])
    assert pair.decode.side.info()["num_failed_transfer_reqs"] == 1


class FakeMatcher:
    """A grammar matcher that records the tokens it accepted and refuses those in `refuse`."""

    def __init__(self, refuse: set[int]) -> None:
        self.accepted: list[int] = []
        self.refuse = refuse

    def fill(self, bitmask: Any, row: int) -> None:  # the fake worker samples without masks
        pass

    def accept(self, token: int) -> bool:
        if token in self.refuse:
            return False
        self.accepted.append(token)
        return True

    def is_terminated(self) -> bool:
        return False

    def rollback(self, n: int) -> None:
        del self.accepted[len(self.accepted) - n:]


class FakeGrammarBackend:
    """Compiles any regex but "bad" (a `GrammarError` naming it); its matchers refuse the tokens in `refuse`."""

    name = "fake"

    def __init__(self) -> None:
        self.compiled: list[str] = []
        self.matchers: list[FakeMatcher] = []
        self.refuse: set[int] = set()

    def compile(self, spec: Any) -> str:
        from tokenloom.grammar.spec import GrammarError

        self.compiled.append(spec.text)
        if spec.text.startswith("bad"):
            raise GrammarError(f"invalid regex: {spec.text} does not compile here")
        return spec.text

    def new_matcher(self, compiled: str) -> FakeMatcher:
        self.matchers.append(FakeMatcher(self.refuse))
        return self.matchers[-1]


def _fake_grammars(pair: PDPair) -> tuple[FakeGrammarBackend, FakeGrammarBackend]:
    from tokenloom.scheduler.grammar_queue import GrammarQueue

    backends = FakeGrammarBackend(), FakeGrammarBackend()
    for h, backend in zip((pair.prefill_h, pair.decode_h), backends, strict=True):
        h.scheduler.grammar_queue = GrammarQueue(lambda b=backend: b, 5.0)
    return backends


def test_a_grammar_compiles_on_both_sides_and_decode_continues_from_the_prefill_token(pair_factory):
    pair = pair_factory(decode_args={"overlap_schedule": "on"})
    prefill_g, decode_g = _fake_grammars(pair)
    ids = prompt(9, 12)
    pair.submit("g", ids, dict(GREEDY, max_new_tokens=5, regex="[a-z]+"))
    results = pair.run()
    assert results["g"].output_ids == reference(ids, 5)
    assert prefill_g.compiled == ["[a-z]+"] and decode_g.compiled == ["[a-z]+"]
    # the prefill matcher saw nothing here (the fake worker advances none); the decode one took the prefill
    # side's first token before any decode step, on the scheduling thread
    assert decode_g.matchers[0].accepted == reference(ids, 1)


@pytest.mark.parametrize("bad_on", ["prefill", "decode"])
def test_a_grammar_failing_on_either_side_is_a_400_on_both_with_nothing_held(pair_factory, bad_on):
    pair = pair_factory()
    backends = dict(zip(("prefill", "decode"), _fake_grammars(pair), strict=True))
    backends[bad_on].compile = lambda spec, b=backends[bad_on]: FakeGrammarBackend.compile(
        b, type(spec)(spec.kind, "bad " + spec.text))
    pair.submit("g", prompt(9, 12), dict(GREEDY, max_new_tokens=5, regex="[a-z]+"))
    results = pair.run(["g"])
    step_until(pair, lambda: pair.prefill_h.results.get("g") is not None
               and pair.prefill_h.results["g"].finish_reason is not None)
    for res in (results["g"], pair.prefill_h.results["g"]):
        assert res.finish_reason["status_code"] == 400, res.finish_reason
        assert "does not compile here" in res.finish_reason["message"], res.finish_reason
    pair.submit("y", prompt(5, 10), dict(GREEDY, max_new_tokens=3))  # pools full (run checks), still serving
    assert pair.run(["y"])["y"].output_ids == reference(prompt(5, 10), 3)


def test_a_first_token_the_decode_grammar_refuses_is_a_500_naming_it(pair_factory):
    pair = pair_factory()
    _, decode_g = _fake_grammars(pair)
    ids = prompt(9, 12)
    decode_g.refuse = {reference(ids, 1)[0]}  # the prefill side (no mask in the fake) sampled it anyway
    pair.submit("g", ids, dict(GREEDY, max_new_tokens=5, regex="[a-z]+"))
    finish = pair.run(["g"])["g"].finish_reason
    assert finish["status_code"] == 500 and "not allowed by the request's grammar" in finish["message"], finish
    pair.submit("y", prompt(5, 10), dict(GREEDY, max_new_tokens=3))
    assert pair.run(["y"])["y"].output_ids == reference(prompt(5, 10), 3)


def test_an_abort_while_the_grammar_compiles_ends_both_halves(pair_factory):
    pair = pair_factory()
    prefill_g, _ = _fake_grammars(pair)
    release = threading.Event()
    slow = prefill_g.compile
    prefill_g.compile = lambda spec: (release.wait(10), slow(spec))[1]
    pair.submit("g", prompt(9, 12), dict(GREEDY, max_new_tokens=5, regex="[a-z]+"))
    step_until(pair, lambda: len(pair.prefill_h.scheduler.grammar_queue) == 1)
    pair.abort("g", "prefill")
    step_until(pair, lambda: pair.prefill_h.results.get("g") is not None)
    release.set()
    assert pair.prefill_h.results["g"].finish_reason["type"] == "abort"
    assert pair.run(["g"])["g"].finish_reason["type"] == "abort"  # the decode half ended too, pools full
    pair.submit("y", prompt(5, 10), dict(GREEDY, max_new_tokens=3))
    assert pair.run(["y"])["y"].output_ids == reference(prompt(5, 10), 3)
