"""executor/team_placement.py: which forward threads get bound to which core and when (fake team and affinity
calls), giving up cleanly when a bind fails, the cases that bind nothing, the adaptive policy driving it around
each step, and a real OpenMP team bound and released in a process of its own (each member's CPU as the kernel
reports it)."""

from __future__ import annotations

import gc
import multiprocessing as mp
import os

import pytest

from tokenloom.executor.cpu_threads import AdaptiveThreads
from tokenloom.executor.team_placement import TeamPlacement, team_placement


class FakeTeam:
    """A team of kernel threads 100, 101, ... (member 0 is the caller: id 0 in affinity calls)."""

    def __init__(self, fail_on: int | None = None) -> None:
        self.masks: dict[int, set[int]] = {}
        self.calls: list[tuple[int, frozenset[int]]] = []
        self.fail_on = fail_on

    def members(self, threads: int) -> list[int]:
        return [0] + [100 + i for i in range(1, threads)]

    def set_affinity(self, tid: int, cores: set[int]) -> None:
        self.calls.append((tid, frozenset(cores)))
        if tid == self.fail_on:
            raise OSError(22, "Invalid argument")
        self.masks[tid] = set(cores)


def placement(cores: list[int], team: FakeTeam) -> TeamPlacement:
    return TeamPlacement(cores, members=team.members, set_affinity=team.set_affinity)


def test_one_thread_a_core_while_the_count_equals_the_cores():
    team = FakeTeam()
    p = placement([3, 1], team)
    p.apply(2)
    assert p.cores == [1, 3] and team.masks == {101: {3}} and p.bound  # the worker bound for good
    p.step_started()
    assert team.masks[0] == {1}  # the master only while a step runs
    p.step_finished()
    assert team.masks == {0: {1, 3}, 101: {3}}
    calls = len(team.calls)
    p.apply(2)  # the same count: nothing to do
    assert len(team.calls) == calls
    p.apply(1)  # a busy process took a core: everything free to move again
    assert team.masks == {0: {1, 3}, 101: {1, 3}} and not p.bound
    p.step_started()
    p.step_finished()
    assert len(team.calls) == calls + 1  # no master binding while nothing is bound
    p.apply(2)
    assert team.masks[101] == {3} and p.bound


def test_a_dropped_or_closed_placement_releases_its_workers():
    team = FakeTeam()
    p = placement([0, 1], team)
    p.apply(2)
    assert team.masks == {101: {1}}
    del p
    gc.collect()
    assert team.masks == {101: {0, 1}}
    p = placement([0, 1], team)
    p.apply(2)
    p.close()
    assert team.masks == {101: {0, 1}} and not p.bound


def test_no_binding_when_threads_and_cores_differ():
    team = FakeTeam()
    p = placement([0, 1, 2, 3], team)
    p.apply(2)  # two threads on four cores: the kernel places them
    p.step_started()
    p.step_finished()
    assert team.calls == [] and not p.bound
    p.apply(4)
    assert team.masks == {101: {1}, 102: {2}, 103: {3}}


def test_a_failed_bind_releases_and_turns_placement_off(caplog):
    team = FakeTeam(fail_on=101)
    p = placement([0, 1], team)
    with caplog.at_level("WARNING"):
        p.apply(2)
    assert not p.enabled and not p.bound and "stay unbound" in caplog.text
    assert team.masks[0] == {0, 1}  # the master released too
    calls = len(team.calls)
    p.apply(1)
    p.step_started()
    p.step_finished()
    assert len(team.calls) == calls  # off for good


def test_the_users_binding_or_one_core_binds_nothing():
    assert team_placement([0, 1], environ={"OMP_PROC_BIND": "close"}) is None
    assert team_placement([0, 1], environ={"GOMP_CPU_AFFINITY": "0-1"}) is None
    assert team_placement([0], environ={}) is None
    on = team_placement([1, 0], environ={})
    assert on is not None and on.cores == [0, 1]


class FakeShare:
    cores = {0, 1}

    def __init__(self) -> None:
        self.value = 0.0

    def others(self) -> float:
        return self.value


def test_the_adaptive_policy_places_the_team_around_each_step():
    team = FakeTeam()
    share, counts = FakeShare(), []
    threads = AdaptiveThreads(2, share, set_threads=counts.append, placement=placement([0, 1], team))
    threads.before_step()
    assert team.masks == {101: {1}, 0: {0}}
    threads.after_step()
    assert team.masks[0] == {0, 1}
    share.value = 1.0
    threads.measure()
    threads.before_step()  # one thread from this step on: released before it runs
    assert counts == [1] and team.masks == {0: {0, 1}, 101: {0, 1}}
    threads.after_step()


def _bind_a_real_team(queue) -> None:
    import ctypes

    import torch

    from tokenloom.kernels.cpu_build import load_library

    cores = sorted(os.sched_getaffinity(0))[:2]
    os.sched_setaffinity(0, set(cores))
    torch.set_num_threads(2)
    lib = load_library("kernels")
    tids, cpus = (ctypes.c_int64 * 2)(), (ctypes.c_int * 2)()

    def team() -> tuple[int, list[int], list[int]]:
        size = lib.omp_team_members(2, tids, cpus)
        return size, list(tids), list(cpus)

    p = team_placement(cores, environ={})
    p.apply(2)
    p.step_started()
    seen = [team() for _ in range(20)]  # the same kernel threads every region, each on its own core
    in_step = os.sched_getaffinity(0)
    p.step_finished()
    after = os.sched_getaffinity(0)
    worker = seen[0][1][1]
    bound = os.sched_getaffinity(worker)
    p.apply(1)
    queue.put((cores, seen, in_step, after, bound, os.sched_getaffinity(worker)))


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_a_real_team_is_bound_one_thread_a_core():
    queue = mp.get_context("spawn").Queue()
    proc = mp.get_context("spawn").Process(target=_bind_a_real_team, args=(queue,))
    proc.start()
    cores, seen, in_step, after, bound, released = queue.get(timeout=120)
    proc.join(timeout=30)
    assert proc.exitcode == 0
    assert all(size == 2 and tids == seen[0][1] for size, tids, _ in seen)
    assert all(cpus == cores for _, _, cpus in seen)
    assert in_step == {cores[0]} and bound == {cores[1]}
    assert after == set(cores) and released == set(cores)
