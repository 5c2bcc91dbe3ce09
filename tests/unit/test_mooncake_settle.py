"""`settle_in_flight`: a failed Mooncake write waits for the runs it left in flight to resolve before it
raises (so none lands after the peer was told the write failed), oldest first, each resolution giving its
window slot back, and gives up on the rest at its timeout (they go to the reaper)."""

from __future__ import annotations

import time
from collections import deque

from tokenloom.disaggregation.transfer.mooncake import settle_in_flight


class FakeStatus:
    """Batch b answers 0 (pending) for its first `pending[b]` polls, then 1 (done) or -1 (failed)."""

    def __init__(self, pending: dict[int, int], final: int = 1) -> None:
        self.pending, self.final, self.polls = dict(pending), final, []

    def __call__(self, batch: int) -> int:
        self.polls.append(batch)
        if self.pending[batch] > 0:
            self.pending[batch] -= 1
            return 0
        return self.final


def test_waits_until_every_run_in_flight_resolved():
    status = FakeStatus({7: 3, 8: 0, 9: 5}, final=-1)
    inflight, released = deque([7, 8, 9]), []
    settle_in_flight(status, inflight, lambda: released.append(1), timeout_s=5.0, poll_s=0.001)
    assert not inflight and len(released) == 3
    assert status.polls[:4] == [7, 7, 7, 7]  # the oldest first, until it resolves


def test_gives_up_at_its_timeout_and_leaves_the_rest_in_flight():
    status = FakeStatus({1: 0, 2: 10**9})
    inflight, released = deque([1, 2]), []
    start = time.monotonic()
    settle_in_flight(status, inflight, lambda: released.append(1), timeout_s=0.05, poll_s=0.001)
    assert 0.05 <= time.monotonic() - start < 1.0
    assert list(inflight) == [2] and len(released) == 1


def test_a_zero_timeout_still_takes_what_already_resolved():
    inflight, released = deque([1, 2]), []
    settle_in_flight(FakeStatus({1: 0, 2: 0}), inflight, lambda: released.append(1), timeout_s=0.0)
    assert not inflight and len(released) == 2
