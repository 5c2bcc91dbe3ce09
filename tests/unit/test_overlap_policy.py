"""`AdaptiveOverlap` (scheduler/overlap_policy.py) on scripted step timings: it picks the mode with the lower
median time per token, a single stretched step (a preemption) does not decide, a probe that confirms the
held mode doubles the next hold up to `MAX_HOLD_STEPS`, and a changed decision or a drifted batch size
starts the hold again from `HOLD_STEPS`."""

from __future__ import annotations

from tokenloom.scheduler import overlap_policy
from tokenloom.scheduler.overlap_policy import HOLD_STEPS, MAX_HOLD_STEPS, PROBE_STEPS, SETTLE_STEPS, AdaptiveOverlap
from tokenloom.scheduler.step_profile import StepTiming

WINDOW = SETTLE_STEPS + PROBE_STEPS


def step(policy: AdaptiveOverlap, period_ms: float, batch: int = 1) -> None:
    policy.record(StepTiming(forward=period_ms / 2e3, period=period_ms / 1e3, batch_size=batch, is_decode=True,
                             overlapped=policy.overlap_now()))


def probe(policy: AdaptiveOverlap, overlap_ms: float, normal_ms: float, batch: int = 1,
          stretched: dict[int, float] | None = None) -> None:
    """Run one probe (its four windows); `stretched`: step index within the probe -> a period used instead."""
    assert policy.probing
    for i in range(WINDOW * len(AdaptiveOverlap.PROBE_ORDER)):
        base = overlap_ms if policy.overlap_now() else normal_ms
        step(policy, (stretched or {}).get(i, base), batch)
    assert not policy.probing


def hold(policy: AdaptiveOverlap, batch: int = 1) -> None:
    while not policy.probing:
        step(policy, 5.0, batch)


def test_the_faster_mode_wins_and_ties_go_to_normal():
    policy = AdaptiveOverlap()
    probe(policy, overlap_ms=5.0, normal_ms=6.0)
    assert policy.overlap_now() and policy.decision["chosen"] == "overlap"
    policy = AdaptiveOverlap()
    probe(policy, overlap_ms=6.0, normal_ms=5.0)
    assert not policy.overlap_now() and policy.decision["chosen"] == "normal"
    policy = AdaptiveOverlap()
    probe(policy, overlap_ms=5.0, normal_ms=5.0 * (1 + overlap_policy.MARGIN / 2))
    assert not policy.overlap_now()  # within the margin: normal


def test_one_stretched_step_does_not_decide():
    policy = AdaptiveOverlap()
    # normal is faster by 1 ms a step, but one normal step was preempted for 40 ms: the mean would pick overlap
    last_normal = WINDOW * 3 + SETTLE_STEPS + 1
    probe(policy, overlap_ms=6.0, normal_ms=5.0, stretched={last_normal: 40.0})
    assert policy.decision["chosen"] == "normal"
    assert policy.decision["normal_ms_per_token"] == 5.0


def test_confirmed_decisions_hold_longer_and_a_change_starts_over():
    policy = AdaptiveOverlap()
    probe(policy, overlap_ms=6.0, normal_ms=5.0)
    assert policy.hold == HOLD_STEPS
    holds = []
    for _ in range(6):
        hold(policy)
        probe(policy, overlap_ms=6.0, normal_ms=5.0)
        holds.append(policy.hold)
    assert holds == [min(MAX_HOLD_STEPS, HOLD_STEPS * 2 ** (i + 1)) for i in range(6)]
    assert holds[-1] == MAX_HOLD_STEPS
    hold(policy)
    probe(policy, overlap_ms=4.0, normal_ms=5.0)  # the other mode wins now
    assert policy.decision["chosen"] == "overlap" and policy.hold == HOLD_STEPS


def test_a_drifted_batch_reprobes_at_once_and_starts_the_hold_over():
    policy = AdaptiveOverlap()
    probe(policy, overlap_ms=6.0, normal_ms=5.0)
    hold(policy)
    probe(policy, overlap_ms=6.0, normal_ms=5.0)
    assert policy.hold == 2 * HOLD_STEPS
    steps = 0
    while not policy.probing:  # the batch grows from 1 to 8: the drift is seen within PROBE_STEPS steps
        step(policy, 5.0, batch=8)
        steps += 1
    assert steps <= PROBE_STEPS
    probe(policy, overlap_ms=6.0, normal_ms=5.0, batch=8)
    assert policy.decision["chosen"] == "normal" and policy.hold == HOLD_STEPS
