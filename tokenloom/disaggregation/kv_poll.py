"""`KVPoll`: the states of one room's transfer, SGLang's values, and how they combine.

A room only moves forward (Bootstrapping → WaitingForInput → Transferring → Success), except that Failed
wins over everything and stays. Across the ranks of a server a room is as far as its least advanced rank
(`combine` is the MIN, Failed being 0), which is how every rank comes to act on the same state.
"""

from __future__ import annotations

from enum import IntEnum


class KVPoll(IntEnum):
    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


def advance(old: KVPoll, new: KVPoll) -> KVPoll:
    """The state after reporting `new` in state `old`: forward only, Failed wins and is final."""
    if old is KVPoll.Failed or new is KVPoll.Failed:
        return KVPoll.Failed
    return max(old, new)


def combine(states: list[KVPoll]) -> KVPoll:
    """A room's state over several ranks: the least advanced (Failed if any failed)."""
    return min(states) if states else KVPoll.Bootstrapping


class RoomPoll:
    """One room's state on each of `num_ranks` ranks (those not heard from yet are Bootstrapping), and the
    room's state over all of them (`state`: the least advanced; Failed as soon as one failed)."""

    def __init__(self, num_ranks: int) -> None:
        self.num_ranks = num_ranks
        self.ranks: dict[int, KVPoll] = {}
        self.detail = ""

    def report(self, rank: int, state: KVPoll, detail: str = "") -> KVPoll:
        """Record `rank`'s news; returns the room's state after it."""
        self.ranks[rank] = advance(self.ranks.get(rank, KVPoll.Bootstrapping), state)
        if state is KVPoll.Failed and not self.detail:
            self.detail = detail
        return self.state()

    def state(self) -> KVPoll:
        if any(s is KVPoll.Failed for s in self.ranks.values()):
            return KVPoll.Failed
        if len(self.ranks) < self.num_ranks:
            return KVPoll.Bootstrapping
        return combine(list(self.ranks.values()))
