"""CPU time used by one server's processes on a set of cores: its root process (the server process, which starts
the ranks and the detokenizer) and every process descending from it that may run on those cores (its affinity
mask meets them), read from /proc/<pid>/stat (user + system time of all of a process's threads).

Why: a rank that adapts its thread count to the cores other processes leave free (cpu_threads.py) must not
count its own server's tokenizer, detokenizer and HTTP work as another process's: that work rises with the
load the rank serves, and counting it dropped a thread on an otherwise idle machine (0.86x the fixed count's
throughput, issue 30).

The launcher puts its pid in its children's environment (`SERVER_PID_ENV`); `server_root_pid()` uses it when
that process is an ancestor of this one, else this process is the root (an in-process scheduler). A rank
bound to its own cores (cpu_binding.py) does not count a sibling rank bound elsewhere; a member allowed on
more cores than the set counts whole (its share on the set is not known).

Invariants: `ProcessTree.seconds()` is a running total that never decreases. The members are found by one
pass over /proc at the first call and again every `rescan_s`; between passes only the members' own stat
files are read. A member that ends between two calls loses that interval's time, a new one counts from the
first call that finds it: each at most one interval of one process. Without /proc (not Linux) it is 0.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

SERVER_PID_ENV = "TOKENLOOM_SERVER_PID"
RESCAN_S = 5.0
PROC_DIR = "/proc"
# /proc/<pid>/stat after the ")" that closes the command name: state(3) ppid(4) ... utime(14) stime(15)
_PPID_AT, _UTIME_AT, _STIME_AT = 1, 11, 12


def parse_stat(text: str) -> tuple[int, int]:
    """(parent pid, user + system clock ticks) from the text of a /proc/<pid>/stat file. The command name
    (in parentheses, second field) may itself hold spaces and parentheses: fields are counted after the last
    ")"."""
    fields = text[text.rindex(")") + 1:].split()
    return int(fields[_PPID_AT]), int(fields[_UTIME_AT]) + int(fields[_STIME_AT])


def _read_stat(proc_dir: str, pid: int) -> tuple[int, int] | None:
    try:
        with open(f"{proc_dir}/{pid}/stat") as f:
            return parse_stat(f.read())
    except (OSError, ValueError, IndexError):
        return None  # ended, or not ours to read


def is_ancestor(pid: int, of: int, proc_dir: str = PROC_DIR) -> bool:
    """Whether process `pid` is `of` itself or one of its ancestors."""
    current = of
    for _ in range(4096):  # a chain of parents is short; the bound only guards against a malformed /proc
        if current == pid:
            return True
        stat = _read_stat(proc_dir, current)
        if stat is None or stat[0] <= 0:
            return False
        current = stat[0]
    return False


def server_root_pid(environ: dict[str, str] | os._Environ = os.environ, proc_dir: str = PROC_DIR) -> int:
    """The root of this server's processes: the launcher's pid from the environment when that process is an
    ancestor of this one, else this process."""
    own = os.getpid()
    value = environ.get(SERVER_PID_ENV, "")
    if value.isdigit() and is_ancestor(int(value), own, proc_dir):
        return int(value)
    return own


def _may_run_on(pid: int, cores: set[int] | None) -> bool:
    if cores is None:
        return True
    try:
        return not cores.isdisjoint(os.sched_getaffinity(pid))
    except OSError:
        return False  # ended


class ProcessTree:
    """The CPU seconds of process `root` and its descendants (those allowed on `cores`; None: all), summed
    since this object was made."""

    def __init__(self, root: int, cores: set[int] | None = None, proc_dir: str = PROC_DIR,
                 rescan_s: float = RESCAN_S, clock: Callable[[], float] = time.monotonic,
                 ticks_per_s: float | None = None) -> None:
        self.root = root
        self.cores = cores
        self.proc_dir = proc_dir
        self.rescan_s = rescan_s
        self._clock = clock
        self.ticks_per_s = ticks_per_s or float(os.sysconf("SC_CLK_TCK"))
        self._ticks: dict[int, int] = {}  # the members' ticks at the last call
        self._total_ticks = 0
        self._next_scan = clock()
        self.seconds()

    def _scan(self) -> dict[int, int]:
        """Every member's ticks, found by one pass over all processes."""
        parent_of: dict[int, int] = {}
        ticks: dict[int, int] = {}
        try:
            names = os.listdir(self.proc_dir)
        except OSError:
            return {}
        for name in names:
            if name.isdigit() and (stat := _read_stat(self.proc_dir, int(name))) is not None:
                parent_of[int(name)], ticks[int(name)] = stat
        children: dict[int, list[int]] = {}
        for pid, parent in parent_of.items():
            children.setdefault(parent, []).append(pid)
        members: dict[int, int] = {}
        seen, todo = set(), [self.root] if self.root in ticks else []
        while todo:
            pid = todo.pop()
            seen.add(pid)
            if _may_run_on(pid, self.cores):
                members[pid] = ticks[pid]
            todo += [c for c in children.get(pid, ()) if c not in seen]
        return members

    def _read_members(self) -> dict[int, int]:
        return {pid: stat[1] for pid in self._ticks if (stat := _read_stat(self.proc_dir, pid)) is not None}

    @property
    def members(self) -> set[int]:
        return set(self._ticks)

    def seconds(self) -> float:
        """The running total, in CPU seconds, after adding what every member used since the last call."""
        now = self._clock()
        if now >= self._next_scan:
            self._next_scan = now + self.rescan_s
            current = self._scan()
        else:
            current = self._read_members()
        self._total_ticks += sum(max(0, t - self._ticks[pid]) for pid, t in current.items() if pid in self._ticks)
        self._ticks = current
        return self._total_ticks / self.ticks_per_s
