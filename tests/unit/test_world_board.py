"""The world board and the heartbeat on a real TCPStore (hosted in this process, as rank 0 hosts it)."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from tests.e2e.server_process import free_port
from tokenloom.distributed.heartbeat import Heartbeat, name_silent_peers
from tokenloom.distributed.world_board import BoardUnreachable, WorldBoard


@pytest.fixture
def store_addr():
    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, None, is_master=True, timeout=timedelta(seconds=5),
                           wait_for_workers=False)
    yield f"127.0.0.1:{port}", master
    del master


def test_deaths_first_report_wins_and_shutdown_is_acknowledged(store_addr):
    addr, _master = store_addr
    node0, node1 = WorldBoard(addr, world=4), WorldBoard(addr, world=4)
    assert node0.deaths() == [] and not node1.shutdown_announced()
    node1.report_death(3, "scheduler rank 3 died (exit code -9)")
    node1.report_death(3, "a later report")
    node1.report_death(2, "scheduler rank 2 died (exit code 1)")
    assert node0.deaths() == ["scheduler rank 2 died (exit code 1)", "scheduler rank 3 died (exit code -9)"]
    assert node0.deaths([3]) == ["scheduler rank 3 died (exit code -9)"]
    start = time.monotonic()
    node0.announce_shutdown(nnodes=2, wait_s=0.3)  # nobody acknowledges: gives up after wait_s
    assert 0.25 < time.monotonic() - start < 2
    assert node1.shutdown_announced()
    node1.acknowledge_shutdown(1)
    start = time.monotonic()
    node0.announce_shutdown(nnodes=2, wait_s=5)
    assert time.monotonic() - start < 1


def test_board_reports_the_store_going_away():
    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, None, is_master=True, timeout=timedelta(seconds=5),
                           wait_for_workers=False)
    board = WorldBoard(f"127.0.0.1:{port}", world=2)
    assert not board.shutdown_announced()
    del master
    with pytest.raises(BoardUnreachable, match="went away"):
        board.shutdown_announced()
    board.report_death(1, "best effort: no error")
    with pytest.raises(BoardUnreachable, match="unreachable"):
        WorldBoard(f"127.0.0.1:{port}", world=2, timeout_s=1)


def test_heartbeat_names_the_silent_peer(store_addr):
    addr, _master = store_addr
    beating = Heartbeat(addr, rank=1, period_s=0.1).start()
    stopped = Heartbeat(addr, rank=2, period_s=0.1).start()
    stopped.stop()
    me = Heartbeat(addr, rank=0, period_s=0.1).start()
    try:
        assert me.silent_peers([0, 1, 2]) == [2]
        error = name_silent_peers(me, range(3), lambda r: f"rank {r}", RuntimeError("Timed out"))
        assert "rank 2 stopped responding" in str(error) and "Timed out" in str(error)
        assert "rank 1" not in str(error)
        original = ValueError("not a hang")
        beating_only = name_silent_peers(me, [1], str, original)
        assert beating_only is original
    finally:
        for hb in (beating, stopped, me):
            hb.stop()
