"""`KVPoll` semantics (SGLang's): a room only moves forward, Failed wins and stays; over several ranks a room
is as far as its least advanced rank, and Failed as soon as one rank failed."""

from __future__ import annotations

import pytest

from tokenloom.disaggregation.kv_poll import KVPoll, RoomPoll, advance, combine


def test_advance_moves_forward_only_and_failed_wins():
    assert advance(KVPoll.Transferring, KVPoll.WaitingForInput) is KVPoll.Transferring
    assert advance(KVPoll.WaitingForInput, KVPoll.Success) is KVPoll.Success
    assert advance(KVPoll.Success, KVPoll.Failed) is KVPoll.Failed
    assert advance(KVPoll.Failed, KVPoll.Success) is KVPoll.Failed
    assert [int(s) for s in KVPoll] == [0, 1, 2, 3, 4]  # SGLang's values


def test_combine_is_the_least_advanced():
    assert combine([KVPoll.Success, KVPoll.Transferring, KVPoll.Success]) is KVPoll.Transferring
    assert combine([KVPoll.Success, KVPoll.Failed]) is KVPoll.Failed


@pytest.mark.parametrize("order", [[0, 1, 2], [2, 0, 1]])
def test_room_poll_succeeds_only_when_every_rank_did(order):
    poll = RoomPoll(3)
    states = [poll.report(rank, KVPoll.Success) for rank in order]
    assert states == [KVPoll.Bootstrapping, KVPoll.Bootstrapping, KVPoll.Success]
    assert poll.report(1, KVPoll.Transferring) is KVPoll.Success  # a late, older report does not go back


def test_room_poll_fails_at_the_first_failure_and_keeps_its_reason():
    poll = RoomPoll(2)
    assert poll.report(0, KVPoll.Failed, "peer gone") is KVPoll.Failed
    assert poll.report(1, KVPoll.Success) is KVPoll.Failed
    assert poll.detail == "peer gone"
