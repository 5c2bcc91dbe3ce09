"""`TOKENLOOM_CPU_OMP_THREADS_BIND`: the cores each local rank gets (within the affinity mask, explicit groups
against `--num-threads`), reading the mask, and binding a real process to them (a core outside the mask
refused with the reason)."""

from __future__ import annotations

import multiprocessing as mp
import os
import threading

import pytest

from tokenloom.distributed import cpu_binding
from tokenloom.distributed.cpu_binding import (
    CoreBindingError,
    allowed_cores,
    bind_this_process,
    parse_core_list,
    rank_cores,
)


def test_auto_gives_each_rank_its_own_block_of_cores():
    assert rank_cores(None, 2, [0, 1], num_threads=1) == [[0], [1]]
    assert rank_cores(None, 2, [0, 1, 2, 3]) == [[0, 1], [2, 3]]  # no --num-threads: a block per rank
    assert rank_cores("auto", 2, [3, 2, 1, 0], num_threads=2) == [[0, 1], [2, 3]]
    assert rank_cores("", 3, list(range(7)), num_threads=2) == [[0, 1], [2, 3], [4, 5]]  # core 6 unused


@pytest.mark.parametrize("local_ranks, cores, threads, device", [
    (1, [0, 1], 2, "cpu"),  # one rank alone keeps the whole machine
    (3, [0, 1], 1, "cpu"),  # more ranks than cores: they must share
    (2, [0, 1], 2, "cpu"),  # --num-threads above a rank's block: binding would stack its threads
    (2, [0, 1], 1, "cuda"),  # ranks on GPUs
    (2, None, None, "cpu"),  # the mask could not be read
])
def test_auto_leaves_the_kernel_to_place_threads_when_blocks_do_not_fit(local_ranks, cores, threads, device):
    assert rank_cores("auto", local_ranks, cores, num_threads=threads, device_type=device) is None


def test_nobind_and_explicit_groups():
    assert rank_cores("nobind", 2, [0, 1], 1) is None
    assert rank_cores("all", 2, [0, 1], 1) is None
    assert rank_cores("0-1|2,3", 2, [0, 1, 2, 3], 2) == [[0, 1], [2, 3]]
    assert rank_cores("3,2,2|0", 2, [0, 1, 2, 3]) == [[2, 3], [0]]  # sorted, a core named twice counted once
    assert rank_cores("0|1-3", 2, None) == [[0], [1, 2, 3]]  # unknown mask: each rank checks when it binds
    assert parse_core_list("0-2,5") == [0, 1, 2, 5]


def test_explicit_groups_refuse_more_threads_than_cores():
    assert rank_cores("0|1-3", 2, [0, 1, 2, 3], num_threads=1) == [[0], [1, 2, 3]]
    with pytest.raises(ValueError, match=r"--num-threads 2 is more than the 1 cores of local rank 0's group \[0\], "
                                         r"so its threads would share cores; give --num-threads 1 or less"):
        rank_cores("0|1-3", 2, [0, 1, 2, 3], num_threads=2)


@pytest.mark.parametrize("spec, message", [
    ("0|1|2", "names 3 core groups; this node runs 2 ranks"),
    ("0|9", "cores [9] are not available"),
    ("0-1|1", "cores [1] are in two ranks' groups"),
    ("0|a", "'a' is not a core number"),
    ("1-0|0", "runs backwards"),
])
def test_bad_explicit_groups_are_refused_with_the_reason(spec, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        rank_cores(spec, 2, [0, 1], 1)


def test_allowed_cores_is_the_mask_or_none_when_unreadable(monkeypatch):
    assert allowed_cores() == sorted(os.sched_getaffinity(0))

    def fails(pid):
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(os, "sched_getaffinity", fails)
    assert allowed_cores() is None
    monkeypatch.delattr(os, "sched_getaffinity")
    assert allowed_cores() is None


def test_binding_to_a_core_outside_the_mask_is_refused_with_the_reason():
    mask = os.sched_getaffinity(0)
    outside = max(mask) + 1000
    with pytest.raises(CoreBindingError, match=rf"cores \[{outside}\] of this rank's set \[{min(mask)}, {outside}\] "
                                               rf"are outside the cores this process may run on"):
        bind_this_process([min(mask), outside])
    assert os.sched_getaffinity(0) == mask  # refused before anything was bound


def test_a_kernel_refusal_is_a_binding_error(monkeypatch):
    def refuses(pid, cores):
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(cpu_binding.os, "sched_setaffinity", refuses)
    core = min(os.sched_getaffinity(0))
    with pytest.raises(CoreBindingError, match=rf"binding this rank to cores \[{core}\] failed: Invalid argument"):
        bind_this_process([core])


def _report_mask(conn):
    conn.send(allowed_cores())


def test_a_child_started_under_a_narrower_mask_sees_only_it():
    """What `taskset -c N` does to a server: its launcher reads the narrower mask, and cuts blocks from it."""
    core = sorted(os.sched_getaffinity(0))[-1]
    parent, child = mp.get_context("spawn").Pipe()
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {core})  # inherited by the child at its start, as under taskset
    try:
        proc = mp.get_context("spawn").Process(target=_report_mask, args=(child,))
        proc.start()
    finally:
        os.sched_setaffinity(0, before)
    assert parent.recv() == [core]
    proc.join(10)


def _bind_and_report(cores, conn):
    started = threading.Event()
    release = threading.Event()

    def existing_thread():
        started.set()
        release.wait(10)

    before = threading.Thread(target=existing_thread)
    before.start()
    started.wait(10)
    bind_this_process(cores)
    later: list[set[int]] = []
    after = threading.Thread(target=lambda: later.append(os.sched_getaffinity(0)))
    after.start()
    after.join()
    seen = {int(t): os.sched_getaffinity(int(t)) for t in os.listdir("/proc/self/task")}
    release.set()
    before.join()
    conn.send((os.sched_getaffinity(0), later[0], set().union(*seen.values())))


def test_binding_covers_threads_started_before_and_after():
    core = sorted(os.sched_getaffinity(0))[-1]
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=_bind_and_report, args=([core], child))
    proc.start()
    main, started_later, every_thread = parent.recv()
    proc.join(10)
    assert main == started_later == every_thread == {core}
