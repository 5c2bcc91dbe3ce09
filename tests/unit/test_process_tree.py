"""executor/process_tree.py: /proc/<pid>/stat parsing (command names with spaces and parentheses), the members
of a process tree (descendants found, others not, ended ones dropped) on a fake /proc, the running total on
this machine's real /proc against a child that spins, and the server root taken from the environment only
when it is an ancestor."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tokenloom.executor.process_tree import SERVER_PID_ENV, ProcessTree, is_ancestor, parse_stat, server_root_pid


def stat_line(pid: int, ppid: int, utime: int, stime: int, comm: str = "python") -> str:
    # pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime cutime ...
    return f"{pid} ({comm}) S {ppid} {pid} {pid} 0 -1 4194560 10 0 0 0 {utime} {stime} 99 99 20 0 1 0 5 0\n"


def test_parse_stat_counts_fields_after_the_command_name():
    assert parse_stat(stat_line(7, 3, 120, 30)) == (3, 150)
    assert parse_stat(stat_line(7, 3, 5, 6, comm="a b) c (d")) == (3, 11)  # cutime/cstime not added


class FakeProc:
    def __init__(self, root: str) -> None:
        self.root = root
        self.t = 0.0

    def put(self, pid: int, ppid: int, ticks: int) -> None:
        os.makedirs(f"{self.root}/{pid}", exist_ok=True)
        with open(f"{self.root}/{pid}/stat", "w") as f:
            f.write(stat_line(pid, ppid, ticks, 0))

    def remove(self, pid: int) -> None:
        os.remove(f"{self.root}/{pid}/stat")
        os.rmdir(f"{self.root}/{pid}")


def test_tree_members_and_running_total(tmp_path):
    proc = FakeProc(str(tmp_path))
    proc.put(1, 0, 1000)       # init: not a member
    proc.put(10, 1, 100)       # the server
    proc.put(11, 10, 200)      # its rank
    proc.put(12, 11, 50)       # a grandchild
    proc.put(20, 1, 5000)      # another process
    os.makedirs(tmp_path / "self")  # non-numeric entries are skipped
    tree = ProcessTree(10, proc_dir=str(tmp_path), rescan_s=10.0, clock=lambda: proc.t, ticks_per_s=100)
    assert tree.members == {10, 11, 12} and tree.seconds() == 0.0
    proc.put(11, 10, 260)
    proc.put(20, 1, 9000)
    proc.put(13, 10, 40)  # started after the scan: not counted until the next one
    assert tree.seconds() == pytest.approx(0.6)
    proc.remove(12)  # ended: dropped
    proc.put(10, 0, 110)
    assert tree.seconds() == pytest.approx(0.7) and tree.members == {10, 11}
    proc.t = 10.0  # the next scan finds 13, counted from here on
    assert tree.seconds() == pytest.approx(0.7) and tree.members == {10, 11, 13}
    proc.put(13, 10, 90)
    assert tree.seconds() == pytest.approx(1.2)
    proc.put(13, 10, 10)  # a pid reused by a process with fewer ticks: never counted backwards
    assert tree.seconds() == pytest.approx(1.2)


def test_tree_of_a_missing_root_is_empty(tmp_path):
    proc = FakeProc(str(tmp_path))
    proc.put(20, 1, 5000)
    tree = ProcessTree(10, proc_dir=str(tmp_path), ticks_per_s=100)
    assert tree.members == set() and tree.seconds() == 0.0


def test_tree_counts_a_spinning_child_on_the_real_proc():
    tree = ProcessTree(os.getpid(), cores=set(os.sched_getaffinity(0)), rescan_s=0.0)
    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 3: pass"])
    try:
        deadline = time.monotonic() + 10
        while child.pid not in tree.members and time.monotonic() < deadline:
            tree.seconds()
            time.sleep(0.05)
        start = tree.seconds()
        time.sleep(1.0)
        used = tree.seconds() - start
    finally:
        child.kill()
        child.wait()
    # the child spun for the whole second (one core; a loaded machine may give it less, never more than ~1)
    assert 0.3 <= used <= 1.3


def test_tree_leaves_out_members_bound_to_other_cores():
    cores = set(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs two cores")
    mine, other = min(cores), max(cores)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        os.sched_setaffinity(child.pid, {other})
        assert child.pid in ProcessTree(os.getpid(), cores=cores).members
        assert child.pid not in ProcessTree(os.getpid(), cores={mine}).members
    finally:
        child.kill()
        child.wait()


def test_server_root_is_an_ancestor_or_this_process():
    own, parent = os.getpid(), os.getppid()
    assert is_ancestor(own, own) and is_ancestor(parent, own) and not is_ancestor(own, parent)
    assert server_root_pid({SERVER_PID_ENV: str(parent)}) == parent
    assert server_root_pid({}) == own
    assert server_root_pid({SERVER_PID_ENV: "not a pid"}) == own
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"]) as unrelated:
        try:
            assert server_root_pid({SERVER_PID_ENV: str(unrelated.pid)}) == own
        finally:
            unrelated.kill()
