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
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable
from typing import Any

from tokenloom.grammar.backends import GrammarBackend
from tokenloom.grammar.compiler import GrammarCompiler
from tokenloom.grammar.spec import GrammarSpec, spec_from_params
from tokenloom.scheduler.req import Req

# How long an otherwise idle scheduler blocks on a compile before polling its inbox again.
IDLE_WAIT_S = 0.005


class GrammarQueue:
    def __init__(self, make_backend: Callable[[], GrammarBackend], timeout_s: float) -> None:
        self.compiler = GrammarCompiler(make_backend)
        self.timeout_s = timeout_s
        self.pending: list[tuple[Req, concurrent.futures.Future, float]] = []

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
                return req
        return None

    def poll(self, idle: bool = False, block: bool = False) -> tuple[list[Req], list[tuple[Req, str]]]:
        """(requests whose grammar is ready, each with `req.grammar` set; (request, reason) of failures).
        `idle`: nothing else to run, so wait briefly for a compile instead of returning at once. `block`:
        wait for every pending compile (up to its deadline), so that ranks deciding in lockstep agree."""
        if not self.pending:
            return [], []
        if block:
            for _, future, deadline in self.pending:
                concurrent.futures.wait([future], timeout=max(0.0, deadline - time.perf_counter()))
        elif idle:
            concurrent.futures.wait([f for _, f, _ in self.pending], timeout=IDLE_WAIT_S,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        ready, failed, still = [], [], []
        now = time.perf_counter()
        for req, future, deadline in self.pending:
            if future.done():
                error = future.exception()
                if error is None:
                    try:
                        req.grammar = self.compiler.new_matcher(future.result())
                        ready.append(req)
                    except ValueError as e:
                        failed.append((req, str(e)))
                else:
                    failed.append((req, str(error) if isinstance(error, ValueError)
                                   else f"grammar compilation failed: {error!r}"))
            elif now > deadline:
                failed.append((req, f"grammar compilation did not finish within {self.timeout_s:g} s "
                                    f"(--grammar-compile-timeout)"))
            else:
                still.append((req, future, deadline))
        self.pending = still
        return ready, failed

    def info(self) -> dict[str, Any]:
        return {**self.compiler.info(), "num_grammar_queue_reqs": len(self.pending)}
