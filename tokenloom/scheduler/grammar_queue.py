"""`GrammarQueue`: requests that wait for their grammar to compile, held apart from the waiting queue.

A request with a grammar (json_schema, regex, ebnf, structural_tag) joins this queue on arrival and its
grammar is submitted to the `GrammarCompiler` (a worker thread, cached by spec). Each scheduling round
`poll()` returns the requests whose grammar is ready, each with its own matcher (`req.grammar`), which the
scheduler then lets in (its request port: a disaggregated server's side; or the waiting queue), and those
whose compile failed or did not finish within the timeout (`--grammar-compile-timeout`) with the reason; the
scheduler refuses them with a 400 (a disaggregated request's peer server is told) and keeps serving. Other
requests never wait for a compile. SGLang's grammar queue plays the same role (a request is scheduled only once
its grammar is ready). On a prefill/decode pair both servers compile a request's grammar, each at arrival: the
prefill server samples the first token under it, the decode server's matcher takes that token
(`Scheduler.apply_token`) and decodes on.

With several ranks (TP, PP; `lockstep`, set by scheduler/grammar_sync.py) no rank polls: the entry rank's
`decide()` turns the outcomes of its own compiles into a `GrammarDecision`, which every rank, the entry
included, applies with `follow()` at the same iteration. Invariant there: a request leaves the queue only by
`follow` (or an abort), so every rank's queue holds the same requests at every iteration.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable
from typing import Any

from tokenloom.grammar.backends import GrammarBackend
from tokenloom.grammar.compiler import GrammarCompiler
from tokenloom.grammar.spec import GrammarSpec, spec_from_params
from tokenloom.protocol import GrammarDecision
from tokenloom.scheduler.req import Req

logger = logging.getLogger(__name__)

# How long an otherwise idle scheduler blocks on a compile before polling its inbox again.
IDLE_WAIT_S = 0.005

Pending = tuple[Req, concurrent.futures.Future, float]  # a request, its compile, its deadline
Refusal = tuple[Req, str, int]  # a request to end, the reason, the HTTP status


class GrammarQueue:
    def __init__(self, make_backend: Callable[[], GrammarBackend], timeout_s: float) -> None:
        self.compiler = GrammarCompiler(make_backend)
        self.timeout_s = timeout_s
        self.pending: list[Pending] = []
        # Lockstep ranks (grammar_sync.lockstep_grammar): requests leave by the entry rank's decisions only;
        # `gather(obj)` returns every rank's obj on every rank (called at the same point on all of them).
        self.lockstep = False
        self.gather: Callable[[Any], list[Any]] | None = None
        self._decided: set[str] = set()  # the entry rank: rids whose decision is on its way to every rank

    @staticmethod
    def spec_of(req: Req) -> GrammarSpec | None:
        p = req.sampling_params
        return spec_from_params(p.json_schema, p.regex, p.ebnf, p.structural_tag)

    def add(self, req: Req, spec: GrammarSpec) -> None:
        self.pending.append((req, self.compiler.submit(spec), time.perf_counter() + self.timeout_s))

    def __len__(self) -> int:
        return len(self.pending)

    def remove(self, rid: str) -> Req | None:
        for i, (req, _, _) in enumerate(self.pending):
            if req.rid == rid:
                del self.pending[i]
                self._decided.discard(rid)
                return req
        return None

    # --- one rank --------------------------------------------------------------------------------------
    def poll(self, idle: bool = False) -> tuple[list[Req], list[Refusal]]:
        """(requests whose grammar is ready, each with `req.grammar` set; failures, each a 400 with its
        reason). `idle`: nothing else to run, so wait briefly for a compile instead of returning at once."""
        if not self.pending:
            return [], []
        if idle:
            self._wait_any(self.pending)
        ready, failed, still = [], [], []
        now = time.perf_counter()
        for req, future, deadline in self.pending:
            outcome = self._outcome(req, future, deadline, now)
            if outcome is None:
                still.append((req, future, deadline))
            elif outcome:
                failed.append((req, outcome, 400))
            else:
                ready.append(req)
        self.pending = still
        return ready, failed

    # --- ranks in lockstep: the entry rank decides, every rank follows -----------------------------------
    def has_undecided(self) -> bool:
        return len(self._decided) < len(self.pending)

    def decide(self, idle: bool = False) -> GrammarDecision | None:
        """The entry rank: the requests whose compile ended or timed out since its last decision (those ready
        get their matcher now), as the message every rank follows; None when there is none. Nothing leaves
        the queue here: `follow` takes them out, on every rank alike. `idle`: wait briefly for a compile."""
        undecided = [p for p in self.pending if p[0].rid not in self._decided]
        if not undecided:
            return None
        if idle:
            self._wait_any(undecided)
        ready, failed = [], []
        now = time.perf_counter()
        for req, future, deadline in undecided:
            outcome = self._outcome(req, future, deadline, now)
            if outcome is None:
                continue
            self._decided.add(req.rid)
            if outcome:
                failed.append((req.rid, outcome))
            else:
                ready.append(req.rid)
        return GrammarDecision(tuple(ready), tuple(failed)) if ready or failed else None

    def follow(self, decision: GrammarDecision) -> tuple[list[Req], list[Refusal]]:
        """Every rank, at the same point: (the requests `decision` admits, each with its matcher; those to end).
        A rank other than the entry waits for its own compile of an admitted request's grammar (started when
        the request arrived; up to the compile timeout). A request some rank could not make a matcher for is
        ended on every rank with a 500 naming that rank (grammar_sync.py says why); `decision.failed` ones
        with the entry's reason (400). A rid no longer queued (aborted meanwhile, on every rank alike) is
        skipped."""
        admitted: list[Req] = []
        mine: dict[str, str] = {}  # rid -> why this rank has no matcher for it
        for rid in decision.ready:
            pending = self._take(rid)
            if pending is None:
                continue
            req, future, _ = pending
            if req.grammar is None:  # not the entry rank, whose `decide` made the matcher
                concurrent.futures.wait([future], timeout=self.timeout_s)
                why = self._matcher(req, future) if future.done() else (
                    f"its grammar did not compile within {self.timeout_s:g} s (--grammar-compile-timeout)")
                if why:
                    mine[rid] = why
            admitted.append(req)
        everyone = self.gather(mine) if decision.ready and self.gather is not None else [mine]
        broken: dict[str, str] = {}
        for rank, theirs in enumerate(everyone):
            for rid, why in theirs.items():
                broken.setdefault(rid, f"The request's grammar compiled on the entry rank but not on scheduler "
                                       f"rank {rank}: {why}")
        failed: list[Refusal] = []
        for req in admitted:
            if req.rid in broken:
                logger.error("request %s: %s", req.rid, broken[req.rid])
                req.grammar = None
                failed.append((req, broken[req.rid], 500))
        for rid, reason in decision.failed:
            pending = self._take(rid)
            if pending is not None:
                failed.append((pending[0], reason, 400))
        return [r for r in admitted if r.rid not in broken], failed

    # --- helpers -----------------------------------------------------------------------------------------
    def _take(self, rid: str) -> Pending | None:
        for i, pending in enumerate(self.pending):
            if pending[0].rid == rid:
                del self.pending[i]
                self._decided.discard(rid)
                return pending
        return None

    @staticmethod
    def _wait_any(pending: list[Pending]) -> None:
        concurrent.futures.wait([f for _, f, _ in pending], timeout=IDLE_WAIT_S,
                                return_when=concurrent.futures.FIRST_COMPLETED)

    def _outcome(self, req: Req, future: concurrent.futures.Future, deadline: float, now: float) -> str | None:
        """None: still compiling; "": ready (`req.grammar` set); else why the request fails."""
        if future.done():
            return self._matcher(req, future)
        if now > deadline:
            return f"grammar compilation did not finish within {self.timeout_s:g} s (--grammar-compile-timeout)"
        return None

    def _matcher(self, req: Req, future: concurrent.futures.Future) -> str:
        """Give `req` a matcher of its compiled grammar (`future` is done): "" or why it cannot have one."""
        error = future.exception()
        if error is not None:
            return (isinstance(error, ValueError) and str(error)) or f"grammar compilation failed: {error!r}"
        try:
            req.grammar = self.compiler.new_matcher(future.result())
        except ValueError as e:
            return str(e) or f"grammar compilation failed: {e!r}"
        return ""

    def info(self) -> dict[str, Any]:
        return {**self.compiler.info(), "num_grammar_queue_reqs": len(self.pending)}
