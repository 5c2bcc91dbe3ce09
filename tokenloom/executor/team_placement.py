"""A rank's forward threads bound to cores, one each, when it runs exactly as many threads as it has cores
(part of `--cpu-threads-policy adaptive`, the default). SGLang binds its CPU ranks' OpenMP threads one to a core
too (`SGLANG_CPU_OMP_THREADS_BIND`, its `init_cpu_threads_env`).

Why: every parallel region of a step ends in a barrier both threads must reach. When a kernel thread or another
process runs for a few milliseconds on one of two cores, the forward thread it displaces is moved to the other
core, beside its peer, and the two then take turns in ~0.25 ms slices until the load balancer separates them,
which it does only after ~15 ms (a task that ran within the last 0.5 ms counts as cache-hot and stays). Bound,
the displaced thread waits on its own core for the few milliseconds instead. Served batch-1 on the AMD EPYC
(SmolLM2 Q8_0, two servers alternating, 16 rounds; docs/benchmarks.md, issue 30 session 49): max ITL 0.54-0.59x,
p99 ITL 0.87-0.91x, mean per-token time 0.966x (0.995x as the median of requests, which leaves spiky ones out);
with a busy process beside the server, level with unbound threads.

What is bound: the team's workers (members 1..n-1) to cores[1..n-1], for as long as the thread count stays n;
the master (member 0, the thread that runs the steps) to cores[0] only while a step runs (`step_started` /
`step_finished`), so a thread it starts between steps (a grammar compiler, a transfer agent) inherits the whole
mask, as it would without binding. At any other count (the adaptive policy keeps one thread while a busy
process holds a core) every member gets the whole mask back: one thread must be free to move away from it.

Invariants: binding never leaves the cores the rank started with; between steps the master's mask is all of
them; nothing is bound when the user set libgomp's own binding (`BINDING_VARS`) or the native kernels are not
built; a failed bind (a core taken out of the rank's cpuset meanwhile) releases what it bound, logs once and
turns placement off, never failing the step; `close()`, or the placement being collected, releases its workers.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import weakref
from collections.abc import Callable, Iterable, Mapping

logger = logging.getLogger(__name__)

# libgomp's own thread binding: when the user set one of these, theirs wins and the rank binds nothing.
BINDING_VARS = ("OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY")

Members = Callable[[int], list[int]]
SetAffinity = Callable[[int, set[int]], None]


def team_members(threads: int) -> list[int]:
    """Kernel thread ids of the calling thread's OpenMP team of `threads` members (member 0: the caller), from
    csrc/omp_team.c; shorter when libgomp gives fewer threads."""
    from tokenloom.kernels.cpu_build import load_library

    lib = load_library("kernels")
    tids = (ctypes.c_int64 * threads)()
    cpus = (ctypes.c_int * threads)()
    size = lib.omp_team_members(threads, tids, cpus)
    return [int(tids[i]) for i in range(size)]


class TeamPlacement:
    """Binds the team of the thread that runs the steps (see the module docstring). Every method runs on that
    thread."""

    def __init__(self, cores: Iterable[int], members: Members = team_members,
                 set_affinity: SetAffinity = os.sched_setaffinity) -> None:
        self.cores = sorted(cores)
        self._members = members
        self._set_affinity = set_affinity
        self.threads: int | None = None  # the count the team was last placed for
        self.bound_workers: list[int] = []  # kernel thread ids of the workers bound now (changed in place)
        self.enabled = True
        # a harness that drops its loop leaves no worker bound for the rest of its process
        self.close = weakref.finalize(self, _release_workers, self.bound_workers, self.cores, set_affinity)

    @property
    def bound(self) -> bool:
        return bool(self.bound_workers)

    def apply(self, threads: int) -> None:
        """Place a team of `threads` members: one core each when there are exactly as many cores, else none
        bound. A no-op when the count is the one last placed."""
        if not self.enabled or threads == self.threads:
            return
        self.threads = threads
        try:
            self._release()
            if threads > 1 and threads == len(self.cores):
                tids = self._members(threads)
                if len(tids) == threads:
                    for core, tid in zip(self.cores[1:], tids[1:], strict=True):
                        self._set_affinity(tid, {core})
                        self.bound_workers.append(tid)
        except OSError as exc:
            self._give_up(exc)

    def step_started(self) -> None:
        """Before a step: the master onto its core (while workers are bound)."""
        if self.bound_workers:
            try:
                self._set_affinity(0, {self.cores[0]})
            except OSError as exc:
                self._give_up(exc)

    def step_finished(self) -> None:
        """After a step: the master's whole mask back."""
        if self.bound_workers:
            try:
                self._set_affinity(0, set(self.cores))
            except OSError as exc:
                self._give_up(exc)

    def _release(self) -> None:
        while self.bound_workers:
            self._set_affinity(self.bound_workers[-1], set(self.cores))
            self.bound_workers.pop()

    def _give_up(self, exc: OSError) -> None:
        logger.warning("binding the forward threads to cores %s failed (%s); they stay unbound", self.cores, exc)
        self.enabled = False
        with contextlib.suppress(OSError):
            self._set_affinity(0, set(self.cores))
        _release_workers(self.bound_workers, self.cores, self._set_affinity)


def _release_workers(workers: list[int], cores: list[int], set_affinity: SetAffinity) -> None:
    """Every worker in `workers` back on all `cores` (emptying the list); one that is gone, or a core that left
    the cpuset, is skipped: nothing more to release."""
    for tid in workers:
        with contextlib.suppress(OSError):
            set_affinity(tid, set(cores))
    workers.clear()


def team_placement(cores: Iterable[int], environ: Mapping[str, str] | None = None) -> TeamPlacement | None:
    """The rank's placement over `cores` (its affinity mask at start), or None where it binds nothing: the user
    set libgomp's binding, fewer than two cores, or no native kernels."""
    from tokenloom.kernels.cpu_build import load_library

    env = os.environ if environ is None else environ
    cores = sorted(cores)
    if any(name in env for name in BINDING_VARS) or len(cores) < 2 or load_library("kernels") is None:
        return None
    return TeamPlacement(cores)
