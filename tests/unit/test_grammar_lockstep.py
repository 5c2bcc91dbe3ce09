"""Grammar admission on two ranks in lockstep (scheduler/grammar_sync.py): the entry rank decides, the other
follows. Two real `Scheduler`s with the fake worker of test_scheduler_fake_runner.py run on two threads,
joined as TP ranks are: each iteration the entry's message list (its `DecidingInbox`'s, grammar decisions
included) is pickled and handed to both (`FakeTP.broadcast`, as `BroadcastInbox` does over gloo), and the
ranks' failure reports meet in `FakeTP.gather` (as `all_gather_pyobj` does). Each rank compiles with its own
fake backend, whose compiles a test holds or fails per rank.

Judges: a request without a grammar decodes on both ranks while a grammar is held in compilation; both ranks'
queues, running requests and outputs are equal after every iteration (so they admit and refuse at the same
iteration); the outputs equal the fake worker's reference; the follower never decides; every failure ends
the request on both ranks with the same status and message; the pools end full.
"""

from __future__ import annotations

import pickle
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.scheduler_harness import LoopHarness
from tests.unit.test_scheduler_fake_runner import CONTEXT, GREEDY, VOCAB, FakeWorker, prompt, reference
from tokenloom.cache.kv_memory import KVMemory
from tokenloom.config import ServerArgs
from tokenloom.grammar.compiler import slow_grammar_hook
from tokenloom.grammar.spec import GrammarError
from tokenloom.protocol import GrammarDecision
from tokenloom.scheduler.grammar_queue import GrammarQueue
from tokenloom.scheduler.grammar_sync import lockstep_grammar
from tokenloom.scheduler.loops import NormalLoop


class FakeTP:
    """Two rank threads' broadcast (rank 0's object, pickled) and all-gather; a barrier pairs each call."""

    def __init__(self) -> None:
        self.barrier = threading.Barrier(2, timeout=30)
        self.slots: list[bytes] = [b"", b""]
        self.gathers = 0

    def broadcast(self, rank: int, obj: Any) -> Any:
        if rank == 0:
            self.slots[0] = pickle.dumps(obj)
        self.barrier.wait()
        out = pickle.loads(self.slots[0])
        self.barrier.wait()
        return out

    def gather(self, rank: int, obj: Any) -> list[Any]:
        self.slots[rank] = pickle.dumps(obj)
        self.barrier.wait()
        out = [pickle.loads(s) for s in self.slots]
        self.barrier.wait()
        self.gathers += rank == 0
        return out


class BroadcastInbox:
    def __init__(self, inbox: Any, tp: FakeTP, rank: int) -> None:
        self.inbox, self.tp, self.rank = inbox, tp, rank

    def recv_all(self, timeout_ms: int = 0) -> list[Any]:
        return self.tp.broadcast(self.rank, self.inbox.recv_all(0) if self.inbox is not None else None)


class FakeMatcher:
    def fill(self, bitmask: Any, row: int) -> None:  # the fake worker samples without masks
        pass

    def accept(self, token: int) -> bool:
        return True

    def is_terminated(self) -> bool:
        return False

    def rollback(self, n: int) -> None:
        pass


class GatedBackend:
    """Compiles any grammar; one whose text is in `gates` waits for its event first, one in `fails` fails."""

    name = "fake"

    def __init__(self) -> None:
        self.gates: dict[str, threading.Event] = {}
        self.fails: set[str] = set()
        self.compiled: list[str] = []

    def compile(self, spec: Any) -> str:
        gate = self.gates.get(spec.text)
        if gate is not None:
            assert gate.wait(20), f"{spec.text} was never released"
        self.compiled.append(spec.text)
        if spec.text in self.fails:
            raise GrammarError(f"invalid regex: {spec.text} does not compile here")
        return spec.text

    def new_matcher(self, compiled: str) -> FakeMatcher:
        return FakeMatcher()


class Ranks:
    """An entry rank (0) and a follower (1), each a `LoopHarness` (real scheduler, normal loop, fake worker)."""

    def __init__(self, timeout_s: float = 20.0) -> None:
        self.tp = FakeTP()
        self.backends = [GatedBackend(), GatedBackend()]
        self.harnesses = [self._rank(rank, timeout_s) for rank in (0, 1)]
        self.traces: list[list[tuple]] = [[], []]
        self.decisions: list[GrammarDecision] = []

    def _rank(self, rank: int, timeout_s: float) -> LoopHarness:
        args = ServerArgs(max_total_tokens=512, max_running_requests=8, overlap_schedule="off",
                          grammar_compile_timeout=timeout_s)
        memory = KVMemory.build(tokens=512, request_slots=8, context_len=CONTEXT, page_size=1, num_kv_heads=1,
                                head_dim=1, dtype=torch.float32, device=torch.device("cpu"), start_layer=0,
                                end_layer=1, disable_radix_cache=False)

        def make_loop(scheduler: Any, inbox: Any) -> NormalLoop:
            scheduler.grammar_queue = GrammarQueue(lambda: self.backends[rank], timeout_s)
            if rank == 1:
                scheduler.grammar_queue.decide = lambda *a, **k: pytest.fail("the follower decided")
            mine = lockstep_grammar(scheduler, inbox if rank == 0 else None, rank == 0,
                                    lambda obj: self.tp.gather(rank, obj))
            return NormalLoop(scheduler, BroadcastInbox(mine, self.tp, rank))

        return LoopHarness(args, FakeWorker(memory), memory, VOCAB, make_loop=make_loop)

    def run(self, script: Callable[[int], bool], max_iterations: int = 2000) -> None:
        """Iterate both ranks together; before iteration i the entry's thread calls `script(i)` (it may submit
        requests, release compiles) and the ranks stop once it returns False and both are idle."""
        errors: list[BaseException] = []

        def rank_thread(rank: int) -> None:
            h = self.harnesses[rank]
            try:
                for i in range(max_iterations):
                    go = (script(i) or not h.scheduler.is_idle()) if rank == 0 else None  # the entry's call
                    if not self.tp.broadcast(rank, go):
                        return
                    h.loop.run_once()
                    h._collect()
                    s = h.scheduler
                    self.traces[rank].append((
                        [r.rid for r, _, _ in s.grammar_queue.pending], [r.rid for r in s.waiting_queue],
                        sorted(r.rid for r in s.running),
                        {rid: (len(res.output_ids), res.finish_reason) for rid, res in h.results.items()}))
                raise AssertionError("the ranks did not go idle")
            except BaseException as e:  # noqa: BLE001 - re-raised on the test's thread
                errors.append(e)
                self.tp.barrier.abort()

        threads = [threading.Thread(target=rank_thread, args=(rank,)) for rank in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads), "a rank thread hung"
        if errors:
            raise errors[0]
        assert self.traces[0] == self.traces[1], "the ranks diverged"
        for h in self.harnesses:
            h.assert_pools_full()

    def results(self, rid: str) -> list:
        first, second = (h.results[rid] for h in self.harnesses)
        assert (first.output_ids, first.finish_reason) == (second.output_ids, second.finish_reason)
        return first


def submit(ranks: Ranks, rid: str, seed: int, n: int, **params: Any) -> list[int]:
    ids = prompt(seed, 8)
    ranks.harnesses[0].submit(rid, ids, dict(GREEDY, max_new_tokens=n, **params), stream=True)
    return ids


def test_a_slow_compile_stalls_no_rank_and_both_admit_it_at_the_same_iteration():
    ranks = Ranks()
    gates = [threading.Event(), threading.Event()]
    for backend, gate in zip(ranks.backends, gates, strict=True):
        backend.gates["slow"] = gate
    held: dict[str, int] = {}

    def script(i: int) -> bool:
        if i == 0:
            held["plain_ids"] = submit(ranks, "plain", 1, 60)
            held["g_ids"] = submit(ranks, "g", 2, 5, regex="slow")
        if i == 30:  # the entry's compile ends; the follower's a moment later (it waits for it in `follow`)
            held["tokens_while_held"] = len(ranks.harnesses[0].results["plain"].output_ids)
            gates[0].set()
            threading.Timer(0.3, gates[1].set).start()
        return i <= 30

    ranks.run(script)
    # 30 iterations with the grammar held in compilation: "plain" decoded on every one (prefill, then a
    # token per step), the way a single rank decodes while it polls
    assert held["tokens_while_held"] >= 29, held
    admitted = [i for i, (pending, *_) in enumerate(ranks.traces[0]) if "g" not in pending]
    assert admitted[0] >= 30, "g was let in before its compile was released"
    assert ranks.results("plain").output_ids == reference(held["plain_ids"], 60)
    g = ranks.results("g")
    assert g.output_ids == reference(held["g_ids"], 5) and g.finish_reason["type"] == "length"
    assert ranks.backends[1].compiled == ["slow"]  # the follower used its own compile
    assert ranks.tp.gathers == 1  # one report exchange: for the one decision that admitted a request


def test_failures_end_the_request_on_every_rank_and_serving_goes_on():
    """A compile failing on both ranks and a compile timing out on the entry (its compile held; the
    follower's done) are 400s with the entry's reason on both; a compile failing on the follower only
    (the entry's succeeded) is a 500 naming rank 1 on both. Then a plain request runs as usual."""
    ranks = Ranks(timeout_s=0.5)
    release = threading.Event()
    ranks.backends[0].gates["late"] = release
    for backend in ranks.backends:
        backend.fails.add("bad")
    ranks.backends[1].fails.add("odd")
    held: dict[str, Any] = {}

    def script(i: int) -> bool:
        if i == 0:
            submit(ranks, "bad", 1, 4, regex="bad")
            submit(ranks, "odd", 3, 4, regex="odd")  # before "late", whose compile holds the entry's compile thread
            submit(ranks, "late", 2, 4, regex="late")
        if i > 0 and "plain" not in held and all(
                r in ranks.harnesses[0].results for r in ("bad", "late", "odd")):
            release.set()
            held["plain"] = submit(ranks, "plain", 4, 6)
        return "plain" not in held or "plain" not in ranks.harnesses[0].results

    ranks.run(script)
    release.set()
    for rid, status, words in (("bad", 400, "bad does not compile here"),
                               ("late", 400, "did not finish within 0.5 s (--grammar-compile-timeout)"),
                               ("odd", 500, "compiled on the entry rank but not on scheduler rank 1: invalid "
                                            "regex: odd does not compile here")):
        finish = ranks.results(rid).finish_reason
        assert finish["type"] == "abort" and finish["status_code"] == status and words in finish["message"], finish
        assert ranks.results(rid).output_ids == []
    assert ranks.results("plain").output_ids == reference(held["plain"], 6)


def test_a_decision_pickles_and_the_test_hook_names_its_format():
    decision = GrammarDecision(("a", "b"), (("c", "invalid regex"),))
    assert pickle.loads(pickle.dumps(decision)) == decision
    assert slow_grammar_hook(None) is None and slow_grammar_hook("2.5:slow") == (2.5, "slow")
    for bad in ("2.5", "x:slow", "-1:slow", "3:"):
        with pytest.raises(ValueError, match="TOKENLOOM_TEST_SLOW_GRAMMAR must be SECONDS:TEXT"):
            slow_grammar_hook(bad)
