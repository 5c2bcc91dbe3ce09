"""A rank's forward on a shared machine: how long libgomp's threads spin before they sleep (set for every rank
process), and a thread count that follows the cores other processes leave free (`--cpu-threads-policy
adaptive`, the default; `fixed` keeps the configured count).

Why: every parallel region of a forward (torch's and our C kernels', all on torch's libgomp) ends in a barrier
that waits for its slowest thread, and a decode step runs hundreds of regions. libgomp's default wait spins
300k rounds of `pause` before it sleeps: ~30 ms on this machine's cores (measured ~110 ns a pause). With a busy
process beside the server, the kernel preempts one of the threads and the other spends its time slice
spinning for it, at every barrier: decode fell 10-30x (issue 30).

The wait policy: a rank's libgomp reads OMP_WAIT_POLICY / GOMP_SPINCOUNT once, when torch loads it, so the
launcher puts `GOMP_SPINCOUNT=SPIN_COUNT` in the environment its rank processes start with (`rank_omp_env`),
unless the user set either variable. 10000 rounds (~1 ms) keep a thread spinning through the waits of one step
(its regions are microseconds apart, a thread's share of a matmul ends up to a few hundred microseconds before its
peer's, the step's Python work between two native calls takes ~1 ms) and put it to sleep soon when its peer is
not running or the server has no step to run. Why not less: a sleeping thread is woken through the kernel, and
on a virtual machine through the hypervisor (its idle core halted), tens of microseconds each time. With 1000
rounds (~0.1 ms; sessions 25-45) a ~1B Q4_K_M batch-1 step made ~33 context switches and left the cores idle
~9% of the served step; 10000 rounds: served batch-1 ITL 0.938x (~1B Q4_K_M) and 0.927x (the default model),
50000 level with 10000 (bench/ab_serve.py --new-env GOMP_SPINCOUNT=..., session 46, AMD EPYC Zen 3). Why not
libgomp's default (300k rounds, ~30 ms): before the adaptive thread count (below), bench/shared_machine.py
measured with the machine loaded by other work and one more busy process libgomp's default 2 tok/s, 10k rounds
21-28, 1000 rounds 127-172, no spinning (PASSIVE) 56-198; with the adaptive count, which leaves one thread (no
barrier to wait at) while another process keeps a core busy, 10k rounds slow the one-hog run no more than 1000
do (session 46: throughput 1.77x / ITL 1.33x against 1.66x / 1.48x, medians of 3 rounds; the target is 2.5x).
With `--cpu-threads-policy fixed` both threads stay while a busy process holds one core, so the running thread
meets its preempted peer at every barrier and spins for it: the ranks get `SPIN_COUNT_FIXED` (1000 rounds)
instead. bench/shared_machine.py on the AMD EPYC Zen 4, one busy process, fixed threads (session 47, medians of
3 rounds): 10000 rounds slowed throughput 5.7-6.0x and batch-1 ITL 19x, 3000 2.85x / 7.0x, 1000 1.81x / 3.6x;
the adaptive default 1.68x / 1.22x, and unloaded the two spins served level there (bench/ab_serve.py,
--base-env GOMP_SPINCOUNT=1000: 0.985x the default model, 1.011x the ~1B Q4_K_M).

The adaptive thread count (the default; `fixed` keeps the configured count): every `INTERVAL_S`, on a
thread of its own, `CpuShare` measures how much of this process's cores (its affinity mask) other processes
kept busy since the last measure: the cores' busy time from /proc/stat (user, system, irq, softirq, steal)
minus the CPU time of this server's own processes allowed on those cores (process_tree.py: the server
process, its ranks, its detokenizer), over the wall time. Processes at a positive nice value are not counted
(their time is /proc/stat's separate nice column): the scheduler gives them a small share against ours (nice
19: ~1.5%) (unless this process is itself niced; then they count). `choose_threads` turns the free cores into
a thread count with hysteresis, so a measure near a boundary does not flip the count every interval; the
count is set on the forward thread before its next step (`torch.set_num_threads`, which every C kernel reads
per call; the default model's logits are bitwise the same at 1 and 2 threads). While the count equals the
rank's cores, its forward threads are bound one to a core (team_placement.py; released at any other count).

Why it is the default (bench/shared_machine.py, two cores, medians of 3 rounds, session 26): with one busy
process beside the server, batch-1 ITL slowed 1.40x and 8-request throughput 1.52x, against 2.54x and 2.03x
with the fixed count; with four busy processes (each its own session, so four shares of the CPU) ITL 1.50x
against 2.53x, throughput 45 against 51 tok/s (0.88x, inside the fixed count's 39-71 spread over rounds);
unloaded, within the run's noise of the fixed count (243 vs 257 tok/s, 8.1 vs 8.4 ms). Two threads on two
shared cores stall at every barrier when one is preempted; one thread runs on. Until session 26 it was
opt-in: it counted the server's own tokenizer, detokenizer and HTTP work as another process's and measured
at the steps, over windows that spanned idle stretches, and dropped a thread on an idle machine.

Invariants: the count stays within [1, the configured count]; without /proc/stat (not Linux) the policy is
off; a rank with one configured thread has nothing to adapt and gets no policy.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Callable

from tokenloom.config import CPU_THREADS_POLICIES
from tokenloom.executor.process_tree import ProcessTree, server_root_pid
from tokenloom.executor.team_placement import TeamPlacement, team_placement

logger = logging.getLogger(__name__)

INTERVAL_S = 0.5
# Drop a thread when the free cores fall below `threads - DROP_BELOW`; add one when they reach `threads + 1 -
# RAISE_SHORT`. A busy process on one of two cores leaves ~0.7-1.0 free (below 2 - 0.5): one thread; once it
# ends, ~1.8-2.0 free (at least 1 + 1 - 0.3): two again. The gap between the two keeps a measure near one
# boundary from flipping the count.
DROP_BELOW = 0.5
RAISE_SHORT = 0.3
PROC_STAT = "/proc/stat"
SPIN_COUNT = 10000  # libgomp's spin rounds for the rank processes under the adaptive thread count
SPIN_COUNT_FIXED = 1000  # ... and under --cpu-threads-policy fixed (see the module docstring)
OMP_WAIT_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
# /proc/stat's per-CPU columns after the name: user nice system idle iowait irq softirq steal guest guest_nice
_BUSY_COLUMNS = (0, 2, 5, 6, 7)
_NICE_COLUMN = 1


def choose_threads(current: int, max_threads: int, free_cores: float) -> int:
    """The thread count for the next interval, from the current one and the cores others left free."""
    threads = current
    while threads > 1 and free_cores < threads - DROP_BELOW:
        threads -= 1
    while threads < max_threads and free_cores >= threads + 1 - RAISE_SHORT:
        threads += 1
    return max(1, min(max_threads, threads))


def busy_ticks(stat_text: str, cores: set[int], count_nice: bool) -> int:
    """Clock ticks the given cores spent busy, summed, from the text of /proc/stat."""
    total = 0
    for line in stat_text.splitlines():
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cores:
            continue
        values = [int(v) for v in rest.split()]
        total += sum(values[i] for i in _BUSY_COLUMNS if i < len(values))
        if count_nice:
            total += values[_NICE_COLUMN]
    return total


def _read_stat() -> str:
    with open(PROC_STAT) as f:
        return f.read()


class CpuShare:
    """Cores kept busy by other processes between two calls of `others()` (the first call: since creation)."""

    def __init__(self, cores: set[int], read_stat: Callable[[], str] = _read_stat,
                 own_cpu_s: Callable[[], float] = time.process_time, clock: Callable[[], float] = time.monotonic,
                 ticks_per_s: float | None = None, count_nice: bool | None = None) -> None:
        self.cores = cores
        self._read_stat, self._own_cpu_s, self._clock = read_stat, own_cpu_s, clock
        self.ticks_per_s = ticks_per_s or float(os.sysconf("SC_CLK_TCK"))
        # a niced process's own time lands in the nice column: count that column then (so our own time is in
        # the busy time we subtract it from, and other niced processes compete with us on equal terms)
        self.count_nice = count_nice if count_nice is not None else os.getpriority(os.PRIO_PROCESS, 0) > 0
        self._last = self._sample()

    def _sample(self) -> tuple[float, int, float]:
        return self._clock(), busy_ticks(self._read_stat(), self.cores, self.count_nice), self._own_cpu_s()

    def others(self) -> float:
        """Mean cores (of `cores`) other processes kept busy since the last call, in [0, len(cores)]."""
        now = self._sample()
        (t0, busy0, own0), (t1, busy1, own1) = self._last, now
        self._last = now
        wall = t1 - t0
        if wall <= 0:
            return 0.0
        others = ((busy1 - busy0) / self.ticks_per_s - (own1 - own0)) / wall
        return min(float(len(self.cores)), max(0.0, others))


class AdaptiveThreads:
    """The thread count of a rank's forward steps. `measure()` turns the cores other processes kept busy over
    the last interval into a target count (every `interval_s`, on a daemon thread once `start()`ed);
    `before_step()`, on the thread that runs the forward (`StepGuard`), applies it. Measured off the step
    path, the window is always the last interval whether or not steps ran: measured at the steps, a window
    spanning an idle stretch carried a busy process that had ended meanwhile into the next burst of steps
    (one thread for its first interval: 0.8-0.9x unloaded throughput in bench/shared_machine.py)."""

    def __init__(self, max_threads: int, share: CpuShare, interval_s: float = INTERVAL_S,
                 set_threads: Callable[[int], None] | None = None, placement: TeamPlacement | None = None) -> None:
        import torch

        self.placement = placement  # one forward thread a core while the count equals the cores (team_placement)
        self.max_threads = max_threads
        self.threads = max_threads  # the count the forward thread runs with
        self.target = max_threads   # the count the last measure chose
        self.share = share
        self.interval_s = interval_s
        self._set_threads = set_threads or torch.set_num_threads
        self._stop = threading.Event()
        self.changes = 0

    def measure(self) -> int:
        """Choose the target count from the cores others kept busy since the last measure."""
        others = self.share.others()
        target = choose_threads(self.target, self.max_threads, len(self.share.cores) - others)
        if target != self.target:
            logger.info("other processes keep %.1f of this rank's %d cores busy: %d forward threads (was %d)",
                        others, len(self.share.cores), target, self.target)
        self.target = target
        return target

    def before_step(self) -> None:
        target = self.target
        if target != self.threads:
            self._set_threads(target)
            self.threads = target
            self.changes += 1
        if self.placement is not None:
            self.placement.apply(self.threads)
            self.placement.step_started()

    def after_step(self) -> None:
        if self.placement is not None:
            self.placement.step_finished()

    def start(self) -> AdaptiveThreads:
        """Measure every interval on a daemon thread, until `close()` or this object is collected."""
        threading.Thread(target=_measure_every_interval, args=(weakref.ref(self), self.interval_s, self._stop),
                         name="tokenloom-cpu-share", daemon=True).start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self.placement is not None:
            self.placement.close()


def _measure_every_interval(ref: weakref.ref[AdaptiveThreads], interval_s: float, stop: threading.Event) -> None:
    while not stop.wait(interval_s):
        threads = ref()  # held only for the measure: the sampler never keeps its policy alive
        if threads is None:
            return
        try:
            threads.measure()
        except (OSError, ValueError) as exc:  # /proc unreadable from now on: keep the last count
            logger.warning("--cpu-threads-policy adaptive stops measuring: %s", exc)
            return
        del threads


def adaptive_threads(policy: str, device_type: str, max_threads: int) -> AdaptiveThreads | None:
    """The rank's policy object for `--cpu-threads-policy`, or None where there is nothing to adapt (fixed,
    not the CPU, one thread, no /proc/stat or affinity mask to read)."""
    if policy not in CPU_THREADS_POLICIES:
        raise ValueError(f"--cpu-threads-policy must be one of {', '.join(CPU_THREADS_POLICIES)}; got {policy!r}")
    if policy == "fixed" or device_type != "cpu" or max_threads < 2:
        return None
    try:
        cores = set(os.sched_getaffinity(0))
        share = CpuShare(cores, own_cpu_s=ProcessTree(server_root_pid(), cores).seconds)
    except (AttributeError, OSError, ValueError):
        return None
    return AdaptiveThreads(max_threads, share, placement=team_placement(cores)).start()


def rank_omp_env(environ: dict[str, str] | os._Environ, policy: str = "adaptive") -> dict[str, str]:
    """Environment variables to add for the rank processes (libgomp's wait policy), given the launcher's
    environment and `--cpu-threads-policy`: none when the user set OMP_WAIT_POLICY or GOMP_SPINCOUNT (theirs
    wins); else the spin for that policy (SPIN_COUNT, or SPIN_COUNT_FIXED for fixed threads)."""
    if any(name in environ for name in OMP_WAIT_VARS):
        return {}
    return {"GOMP_SPINCOUNT": str(SPIN_COUNT_FIXED if policy == "fixed" else SPIN_COUNT)}
