"""When the overlap loop overlaps: always (`--overlap-schedule on`) or when measurement says it pays (`auto`).

Overlap hides the scheduler's CPU work (schedule, prepare, process) behind the forward, but on a CPU the two
threads share the cores and the GIL, so on a small model it can be slower than running each step to completion
(SGLang users saw overlap lose on small models too: sgl-project/sglang#2558). `AdaptiveOverlap` therefore
measures instead of guessing: it runs short probe windows of decode steps in each mode, alternating (overlap,
normal, overlap, normal), compares the median wall time per generated token (a median: one step stretched by
a preemption on a shared machine must not decide), and keeps the faster mode for a hold of decode steps, or
until the batch size drifts far from the one it measured at; then it probes again. Ties (within `MARGIN`) go
to normal scheduling, which has no extra step of latency. A probe that confirms the mode held before doubles
the next hold (from `HOLD_STEPS` up to `MAX_HOLD_STEPS`); a changed decision or a drifted batch starts again
from `HOLD_STEPS`. Probing is not free: at batch 1 of the default model the overlapped windows ran ~10-18%
slower per token, and with a re-probe every 600 steps `auto` was ~4% slower than `off` over a batch-1 stream
(bench/serve_vs_peers.py's (d) shape). Per-step CPU time outside the forward and forward time are recorded
alongside and reported with each decision.

Switching is free of token loss by construction: the loop only changes how many launched batches it keeps
in flight; every launched batch is processed exactly once.
"""

from __future__ import annotations

import logging
import math
import statistics

from tokenloom.scheduler.step_profile import StepTiming

logger = logging.getLogger(__name__)

PROBE_STEPS = 12  # decode steps measured per probe window
SETTLE_STEPS = 2  # steps skipped after each switch (the pipeline fills or drains)
HOLD_STEPS = 600  # decode steps a new decision is kept
MAX_HOLD_STEPS = 9600  # the longest hold, after four probes in a row confirmed the mode
MARGIN = 0.03  # overlap must be this much faster per token to be chosen
BATCH_DRIFT = 0.5  # re-probe when the mean batch size moves this far (relative) from the probed one


class FixedOverlap:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def overlap_now(self) -> bool:
        return self.enabled

    def record(self, timing: StepTiming) -> None:
        pass

    def info(self) -> dict:
        return {"overlap_schedule": "on" if self.enabled else "off", "overlap_active": self.enabled}


class AdaptiveOverlap:
    PROBE_ORDER = (True, False, True, False)

    def __init__(self) -> None:
        self.active = True
        self.decision: dict | None = None
        self.decisions = 0
        self.hold = HOLD_STEPS  # decode steps the current decision is kept
        self.drift_probe = False  # the running probe was started by a drifted batch size
        self.probe_batch = 0.0  # the mean batch size of the last decision's probe
        self._start_probe()

    # --- state machine ---------------------------------------------------------------------------------
    def _start_probe(self) -> None:
        self.probing = True
        self.window = 0
        self.active = self.PROBE_ORDER[0]
        self.samples: dict[bool, list[StepTiming]] = {True: [], False: []}
        self.window_steps = 0
        self.hold_left = 0
        self.recent_batch: list[int] = []

    def overlap_now(self) -> bool:
        return self.active

    def record(self, timing: StepTiming) -> None:
        if not timing.is_decode or timing.period <= 0:
            return
        if self.probing:
            self._record_probe(timing)
        else:
            self._record_hold(timing)

    def _record_probe(self, timing: StepTiming) -> None:
        self.window_steps += 1
        if timing.overlapped != self.active or self.window_steps <= SETTLE_STEPS:
            return
        self.samples[self.active].append(timing)
        if self.window_steps < SETTLE_STEPS + PROBE_STEPS:
            return
        self.window += 1
        self.window_steps = 0
        if self.window < len(self.PROBE_ORDER):
            self.active = self.PROBE_ORDER[self.window]
            return
        self._decide()

    def _decide(self) -> None:
        on, off = self.samples[True], self.samples[False]
        per_token = {mode: statistics.median(s.period / max(1, s.batch_size) for s in steps) if steps else math.inf
                     for mode, steps in ((True, on), (False, off))}
        previous = None if self.decision is None else self.decision["chosen"] == "overlap"
        self.active = per_token[True] < per_token[False] * (1 - MARGIN)  # no samples of a mode: not chosen
        steps = on + off
        batch = statistics.fmean(s.batch_size for s in steps)
        drifted = abs(batch - self.probe_batch) > BATCH_DRIFT * max(self.probe_batch, 1.0)
        self.hold = (min(MAX_HOLD_STEPS, 2 * self.hold) if previous == self.active and not self.drift_probe
                     and not drifted else HOLD_STEPS)
        self.probe_batch = batch
        normal_cpu = [s.cpu_outside_forward / s.period for s in off]
        self.decision = {
            "chosen": "overlap" if self.active else "normal",
            "overlap_ms_per_token": 1e3 * per_token[True] if on else None,
            "normal_ms_per_token": 1e3 * per_token[False] if off else None,
            "probe_batch_size": self.probe_batch,
            "normal_cpu_outside_forward_share": statistics.fmean(normal_cpu) if off else 0.0,
            "normal_forward_ms": 1e3 * statistics.fmean(s.forward + s.sample for s in off) if off else 0.0,
            "hold_steps": self.hold,
        }
        self.decisions += 1
        self.probing = False
        self.hold_left = self.hold
        self.drift_probe = False
        self.recent_batch = []
        logger.info("overlap schedule (auto): %s for %d steps; median %.3f ms/token overlapped vs %.3f normal at "
                    "batch %.0f (normal: CPU outside the forward %.1f%% of the step, forward %.1f ms)",
                    self.decision["chosen"], self.hold, 1e3 * per_token[True], 1e3 * per_token[False],
                    self.probe_batch, 100 * self.decision["normal_cpu_outside_forward_share"],
                    self.decision["normal_forward_ms"])

    def _record_hold(self, timing: StepTiming) -> None:
        self.hold_left -= 1
        self.recent_batch.append(timing.batch_size)
        drifted = False
        if len(self.recent_batch) >= PROBE_STEPS:
            mean = statistics.fmean(self.recent_batch)
            drifted = abs(mean - self.probe_batch) > BATCH_DRIFT * max(self.probe_batch, 1.0)
            self.recent_batch = []
        if self.hold_left <= 0 or drifted:
            self.drift_probe = drifted
            self._start_probe()

    def info(self) -> dict:
        return {"overlap_schedule": "auto", "overlap_active": self.active, "overlap_probing": self.probing,
                "overlap_decision": self.decision, "overlap_decisions": self.decisions}
