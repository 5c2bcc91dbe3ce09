"""`keep_this_thread_single_threaded`: a helper thread's torch ops must not start a second OpenMP team (which
makes libgomp throttle the forward's spin-waits), and must not change the caller's intra-op thread count."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from tokenloom.device import keep_this_thread_single_threaded


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")
def test_single_threaded_helper_starts_no_team_and_leaves_main_alone():
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        x = torch.randn(512, 512)
        x @ x  # the main thread's team exists now
        counts = {}

        def helper(limit: bool) -> None:
            if limit:
                keep_this_thread_single_threaded()
            before = _threads()
            y = torch.randn(512, 512)
            for _ in range(3):
                y @ y
            counts[limit] = _threads() - before

        for limit in (True, False):
            t = threading.Thread(target=helper, args=(limit,))
            t.start()
            t.join()
        assert counts[True] == 0  # no OpenMP workers were started for the limited thread
        assert counts[False] >= 1  # control: an unlimited thread does start its own team
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(old)
