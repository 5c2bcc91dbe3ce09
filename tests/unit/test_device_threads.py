"""`keep_this_thread_single_threaded`: a helper thread's torch ops must not start a second OpenMP team (which
makes libgomp throttle the forward's spin-waits), and must not change the caller's intra-op thread count.

libgomp keeps the team size per thread (its nthreads ICV), so the check reads `omp_get_max_threads()` in each
thread and the size of the team a parallel torch op really runs with (`torch.get_num_threads()` inside an
aten-parallel op is not observable, so the team is probed with `omp_get_num_threads` through a native
parallel region: libgomp's own `GOMP_parallel` with a callback). Counting OS threads is not reliable: BLAS
libraries start and stop threads of their own differently per CPU vendor.
"""

from __future__ import annotations

import ctypes
import glob
import os
import threading

import pytest
import torch

from tokenloom.device import keep_this_thread_single_threaded


def _libgomp() -> ctypes.CDLL | None:
    if getattr(ctypes.CDLL(None), "omp_get_max_threads", None) is not None:
        return ctypes.CDLL(None)
    libs = glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp*"))
    return ctypes.CDLL(libs[0]) if libs else None


GOMP = _libgomp()


def _team_size() -> int:
    """Threads in the team a parallel region started on the calling thread gets."""
    seen = []
    callback = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(lambda _: seen.append(GOMP.omp_get_num_threads()))
    GOMP.GOMP_parallel(callback, None, ctypes.c_uint(0), ctypes.c_uint(0))
    return max(seen)


@pytest.mark.skipif(GOMP is None, reason="torch is not linked with libgomp here")
def test_single_threaded_helper_runs_teams_of_one_and_leaves_main_alone():
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        seen = {}

        def helper(limit: bool) -> None:
            if limit:
                keep_this_thread_single_threaded()
            z = torch.randn(2_000_000)
            (z * 2).sum()  # an aten-parallel op runs on this thread's team
            seen[limit] = (GOMP.omp_get_max_threads(), _team_size())

        for limit in (True, False):
            t = threading.Thread(target=helper, args=(limit,))
            t.start()
            t.join()
        assert seen[True] == (1, 1)  # the limited thread's parallel regions run on it alone
        assert seen[False][0] >= 2 and seen[False][1] >= 2  # control: an unlimited thread gets a team
        assert torch.get_num_threads() == 2 and GOMP.omp_get_max_threads() == 2  # the caller is untouched
    finally:
        torch.set_num_threads(old)
