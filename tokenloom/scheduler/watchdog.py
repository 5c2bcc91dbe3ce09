"""`ForwardWatchdog`: a scheduler rank's guard against a forward step that never returns (`--watchdog-timeout`,
SGLang's flag and default, 300 s).

A hung kernel or a deadlocked collective leaves the rank's forward blocked forever while the server still
looks alive; the watchdog turns that into a failure with a reason. The forward side marks each step's start
and end (`step_started` / `step_finished`, executor/forward_thread.py `StepGuard`, the one place every loop's
forward runs through); a daemon thread wakes every `poll_s` and, when the step in progress started more than
`timeout_s` ago, calls `on_hang(reason)` once and stops watching. The rank's `on_hang`
(entrypoints/scheduler_process.py) reports the reason to the engine as a `ProcessFailed` and exits the process non-zero.

Invariants: only a step in progress can trip it (an idle rank waiting for requests, or the scheduling side
waiting on its inbox, is never a hang); the hot path is two attribute stores, no lock (the watcher reads the
one attribute once per wake-up; a step that ends and the next that starts between two reads only moves the
start time forward); a trip happens no earlier than `timeout_s` after the step began and no later than
`timeout_s + poll_s`. A hang that holds the GIL (a C call that never releases it) stops this thread too;
that one only the peers' `--dist-timeout` or an outside supervisor can catch.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

MAX_POLL_S = 1.0


class ForwardWatchdog:
    def __init__(self, timeout_s: float, on_hang: Callable[[str], None], poll_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if timeout_s <= 0:
            raise ValueError(f"the watchdog timeout must be > 0 seconds; got {timeout_s}")
        self.timeout_s = timeout_s
        self.poll_s = poll_s if poll_s is not None else min(MAX_POLL_S, timeout_s / 4)
        self.on_hang = on_hang
        self._clock = clock
        self._step_start: float | None = None  # when the step in progress began; None between steps
        self._thread: threading.Thread | None = None
        self.tripped = False

    def step_started(self) -> None:
        self._step_start = self._clock()

    def step_finished(self) -> None:
        self._step_start = None

    def hung_for(self) -> float | None:
        """Seconds the step in progress has run beyond the timeout (None when no step has)."""
        start = self._step_start
        if start is None:
            return None
        elapsed = self._clock() - start
        return elapsed if elapsed > self.timeout_s else None

    def start(self) -> ForwardWatchdog:
        self._thread = threading.Thread(target=self._watch, name="tokenloom-forward-watchdog", daemon=True)
        self._thread.start()
        return self

    def _watch(self) -> None:
        while True:
            time.sleep(self.poll_s)
            if self.hung_for() is not None:
                self.tripped = True
                self.on_hang(f"watchdog: a forward step has not returned for {self.timeout_s:g} s "
                             f"(--watchdog-timeout {self.timeout_s:g})")
                return
