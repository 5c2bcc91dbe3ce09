"""`GrammarCompiler`: compiles grammars off the scheduler's critical path, with a cache keyed by the spec.

`submit(spec)` returns a Future of the compiled grammar: the cached one when the same (kind, text) was asked
for before (compiled or still compiling: requests share one compile), else a new job on a single worker
thread (the native compilers release the GIL, so the scheduler keeps planning and running other requests'
steps meanwhile). A failed compile is cached too (the same bad grammar fails fast), and so is nothing else:
the cache holds at most `max_entries` specs, least recently used evicted first.

The scheduler polls the futures of the requests that wait for their grammar (scheduler/grammar_queue.py);
a request whose grammar is not ready within the compile timeout is ended with an error, while its compile
may go on in the background (its result then serves the next request with that grammar).

Test hook (tests/e2e only; not reachable by clients, who cannot set a server's environment):
`TOKENLOOM_TEST_SLOW_GRAMMAR="SECONDS:TEXT"` makes each compile of a grammar whose text contains TEXT sleep
SECONDS first, so a test can hold one grammar in compilation while other requests run.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from tokenloom.grammar.backends import GrammarBackend, Matcher
from tokenloom.grammar.spec import GrammarSpec

SLOW_GRAMMAR_ENV = "TOKENLOOM_TEST_SLOW_GRAMMAR"


def slow_grammar_hook(value: str | None) -> tuple[float, str] | None:
    """(seconds, text) of `SLOW_GRAMMAR_ENV`'s "SECONDS:TEXT", or None when unset."""
    if not value:
        return None
    seconds, sep, text = value.partition(":")
    try:
        delay = float(seconds)
    except ValueError:
        delay = -1.0
    if not sep or not text or not delay >= 0:
        raise ValueError(f"{SLOW_GRAMMAR_ENV} must be SECONDS:TEXT (a delay >= 0 and a non-empty text), "
                         f"got {value!r}")
    return delay, text


class GrammarCompiler:
    def __init__(self, make_backend: Callable[[], GrammarBackend], max_entries: int = 512) -> None:
        """`make_backend` is called once, on the worker thread, before the first compile (building a
        backend indexes the vocabulary: ~0.2-0.5 s that must not stall the scheduler either)."""
        self._make_backend = make_backend
        self.backend: GrammarBackend | None = None
        self.max_entries = max_entries
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tokenloom-grammar")
        self._cache: OrderedDict[GrammarSpec, Future] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.compile_s = 0.0  # seconds spent compiling (cold compiles only)
        self._slow = slow_grammar_hook(os.environ.get(SLOW_GRAMMAR_ENV))  # the test hook (module docstring)

    def submit(self, spec: GrammarSpec) -> Future:
        with self._lock:
            future = self._cache.get(spec)
            if future is not None:
                self._cache.move_to_end(spec)
                self.hits += 1
                return future
            self.misses += 1
            future = self._pool.submit(self._compile, spec)
            self._cache[spec] = future
            while len(self._cache) > self.max_entries:
                self._cache.popitem(last=False)
            return future

    def _compile(self, spec: GrammarSpec) -> Any:
        if self.backend is None:
            self.backend = self._make_backend()
        start = time.perf_counter()
        try:
            if self._slow is not None and self._slow[1] in spec.text:
                time.sleep(self._slow[0])
            return self.backend.compile(spec)
        finally:
            self.compile_s += time.perf_counter() - start

    def new_matcher(self, compiled: Any) -> Matcher:
        """A matcher of a grammar `submit`'s future delivered (the backend exists by then)."""
        return self.backend.new_matcher(compiled)

    def info(self) -> dict[str, Any]:
        return { "grammar_cache_hits": self.hits,
                "grammar_cache_misses": self.misses, "grammar_compile_s": self.compile_s}

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
