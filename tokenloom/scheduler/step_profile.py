"""Per-step timings of the event loops: schedule, prepare, forward, sample and output processing.

Every loop measures each step (a few `perf_counter` calls); the adaptive overlap policy reads the
measurements. With `--enable-step-profile` (or `TOKENLOOM_STEP_PROFILE=1`) the profiler also keeps the
recent steps and summarises them: `summary()` is served in `/get_server_info` under `step_profile`, logged
every `LOG_EVERY_STEPS` steps, and printed by `python -m tokenloom.scheduler.step_profile --url URL`.

Phases: `schedule` = receiving messages and choosing the batch; `prepare` = building the forward batch,
request-table writes, attention metadata and sampling tensors; `forward` and `sample` run on the forward
thread (overlap) or inline; `process` = applying results, stop checks, releasing KV, sending outputs.
`cpu_outside_forward` = schedule + prepare + process: the scheduler's own work per step.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import urllib.request
from collections import deque
from dataclasses import dataclass

logger = logging.getLogger(__name__)

PHASES = ("schedule", "prepare", "forward", "sample", "process")
LOG_EVERY_STEPS = 500
KEEP_STEPS = 4096


@dataclass
class StepTiming:
    schedule: float = 0.0
    prepare: float = 0.0
    forward: float = 0.0
    sample: float = 0.0
    process: float = 0.0
    batch_size: int = 0
    is_decode: bool = False
    overlapped: bool = False
    period: float = 0.0  # wall time since the previous step's results were processed

    @property
    def cpu_outside_forward(self) -> float:
        return self.schedule + self.prepare + self.process


def profiling_requested(flag: bool) -> bool:
    return flag or os.environ.get("TOKENLOOM_STEP_PROFILE", "") not in ("", "0")


class StepProfiler:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.steps: deque[StepTiming] = deque(maxlen=KEEP_STEPS)
        self.total_steps = 0

    def record(self, timing: StepTiming) -> None:
        self.total_steps += 1
        if not self.enabled:
            return
        self.steps.append(timing)
        if self.total_steps % LOG_EVERY_STEPS == 0:
            logger.info("step profile: %s", format_summary(self.summary()))

    def summary(self) -> dict:
        """Mean / median / p99 milliseconds per phase over the kept steps, split by decode and extend, plus
        `largest_batch`: the decode steps whose batch is at least 90% of the largest decode batch kept."""
        out: dict = {"enabled": self.enabled, "total_steps": self.total_steps}
        if not self.enabled:
            return out
        decode = [s for s in self.steps if s.is_decode and s.period > 0]
        top = max((s.batch_size for s in decode), default=0)
        groups = (("decode", decode), ("extend", [s for s in self.steps if not s.is_decode]),
                  ("largest_batch", [s for s in decode if s.batch_size >= 0.9 * top]))
        for kind, steps in groups:
            if not steps:
                continue
            part: dict = {"steps": len(steps), "mean_batch_size": statistics.fmean(s.batch_size for s in steps),
                          "overlapped_steps": sum(s.overlapped for s in steps)}
            for name in (*PHASES, "cpu_outside_forward", "period"):
                values = sorted(getattr(s, name) * 1e3 for s in steps)
                part[name] = {"mean_ms": statistics.fmean(values), "median_ms": values[len(values) // 2],
                              "p99_ms": values[min(len(values) - 1, int(len(values) * 0.99))]}
            period = part["period"]["mean_ms"]
            part["cpu_outside_forward_share"] = part["cpu_outside_forward"]["mean_ms"] / period if period else 0.0
            out[kind] = part
        return out


def format_summary(summary: dict) -> str:
    """One line per step kind: mean ms of each phase and the step period."""
    lines = []
    for kind in ("decode", "extend"):
        part = summary.get(kind)
        if not part:
            continue
        phases = ", ".join(f"{name} {part[name]['mean_ms']:.2f}" for name in PHASES)
        lines.append(f"{kind}: {part['steps']} steps, batch {part['mean_batch_size']:.1f}, mean ms: {phases}; "
                     f"period {part['period']['mean_ms']:.2f}, cpu outside forward "
                     f"{100 * part['cpu_outside_forward_share']:.1f}% of the period")
    return " | ".join(lines) if lines else "no steps recorded (is --enable-step-profile on?)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Print a running server's step profile "
                                     "(start it with --enable-step-profile).")
    parser.add_argument("--url", default="http://127.0.0.1:30000", help="server base URL")
    parser.add_argument("--json", action="store_true", help="print the raw summary as JSON")
    ns = parser.parse_args(argv)
    try:
        with urllib.request.urlopen(ns.url.rstrip("/") + "/get_server_info", timeout=10) as resp:
            info = json.loads(resp.read())
    except OSError as e:
        print(f"error: cannot reach {ns.url}: {e}", file=sys.stderr)
        return 1
    summary = info.get("step_profile")
    if summary is None:
        print("error: the server reports no step profile", file=sys.stderr)
        return 1
    print(json.dumps(summary, indent=2) if ns.json else format_summary(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
