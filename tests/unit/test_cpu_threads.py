"""executor/cpu_threads.py: the thread count from the free cores (hysteresis, bounds), the busy time of a
core set from /proc/stat text (checked against the kernel's own all-CPU line on this machine), the others'
share with fake clocks, the per-interval adaptation, and the rank environment's libgomp wait settings."""

from __future__ import annotations

import os
import threading
import time

import pytest

from tokenloom.entrypoints.launcher import child_environment
from tokenloom.executor import cpu_threads
from tokenloom.executor.cpu_threads import AdaptiveThreads, CpuShare, busy_ticks, choose_threads

STAT = """cpu  300 50 60 1000 5 1 2 3 0 0
cpu0 100 40 20 500 3 1 1 2 0 0
cpu1 200 10 40 500 2 0 1 1 0 0
intr 12345
ctxt 999
"""


@pytest.mark.parametrize("current, max_threads, free, expected", [
    (2, 2, 2.0, 2), (2, 2, 1.6, 2), (2, 2, 1.45, 1),      # a busy neighbour takes half a core or more: drop
    (1, 2, 1.45, 1), (1, 2, 1.69, 1), (1, 2, 1.7, 2),     # raise only once ~0.7 of a core is back (hysteresis)
    (8, 8, 5.2, 5), (8, 8, 5.6, 6), (4, 8, 7.9, 8), (3, 8, 0.0, 1),       # several steps at once; never below 1
    (2, 2, 5.0, 2),                                        # never above the configured count
    (4, 4, 2.0, 2),                                        # more threads than cores: down to the cores
])
def test_choose_threads(current, max_threads, free, expected):
    assert choose_threads(current, max_threads, free) == expected


def test_busy_ticks_of_a_core_set():
    # user + system + irq + softirq + steal; nice only when asked
    assert busy_ticks(STAT, {0}, count_nice=False) == 100 + 20 + 1 + 1 + 2
    assert busy_ticks(STAT, {1}, count_nice=False) == 200 + 40 + 0 + 1 + 1
    assert busy_ticks(STAT, {0, 1}, count_nice=True) == 124 + 242 + 40 + 10
    assert busy_ticks(STAT, {5}, count_nice=False) == 0


def test_busy_ticks_match_the_kernels_total_line():
    with open("/proc/stat") as f:
        text = f.read()
    cores = {int(line.split()[0][3:]) for line in text.splitlines() if line[:3] == "cpu" and line[3].isdigit()}
    total = [int(v) for v in text.splitlines()[0].split()[1:]]
    expected = sum(total[i] for i in (0, 2, 5, 6, 7))
    # the per-CPU lines and the total line are read at one instant; they may differ by rounding per CPU and
    # per summed field (user, system, irq, softirq, steal: five)
    assert abs(busy_ticks(text, cores, count_nice=False) - expected) <= 5 * len(cores)


class Fake:
    def __init__(self) -> None:
        self.t, self.ticks, self.own = 0.0, 0, 0.0

    def stat(self) -> str:
        return f"cpu  0 0 0 0\ncpu0 {self.ticks} 7 0 0 0 0 0 0\ncpu1 0 0 0 0 0 0 0 0\n"


def test_cpu_share_subtracts_this_process():
    fake = Fake()
    share = CpuShare({0, 1}, fake.stat, lambda: fake.own, lambda: fake.t, ticks_per_s=100, count_nice=False)
    fake.t, fake.ticks, fake.own = 2.0, 300, 1.0  # 3 core-seconds busy in 2 s, 1 of them ours
    assert share.others() == pytest.approx(1.0)
    fake.t, fake.ticks, fake.own = 3.0, 400, 2.0  # 1 busy second, all ours
    assert share.others() == pytest.approx(0.0)
    fake.t, fake.ticks, fake.own = 4.0, 1400, 2.0  # more than the cores (a racy read): capped
    assert share.others() == 2.0


class Share:
    cores = {0, 1}
    value = 0.0

    def others(self) -> float:
        return self.value


def test_adaptive_threads_measure_then_apply_on_the_step():
    share, calls = Share(), []
    threads = AdaptiveThreads(2, share, set_threads=calls.append)
    threads.before_step()  # nothing measured: nothing set
    assert (threads.threads, calls) == (2, [])
    share.value = 1.0
    assert threads.measure() == 1 and (threads.threads, calls) == (2, [])  # chosen, not yet applied
    threads.before_step()
    assert (threads.threads, calls) == (1, [1])
    threads.before_step()  # applied once
    assert calls == [1]
    share.value = 0.4  # 1.6 free: below the hysteresis' 1.7 to raise
    threads.measure()
    share.value = 0.0
    threads.measure()
    threads.before_step()
    assert (threads.threads, calls, threads.changes) == (2, [1, 2], 2)


def test_adaptive_threads_measure_on_their_own_thread():
    share, calls = Share(), []
    share.value = 2.0
    before = set(threading.enumerate())
    threads = AdaptiveThreads(2, share, interval_s=0.01, set_threads=calls.append).start()
    (sampler,) = [t for t in threading.enumerate() if t not in before and t.name == "tokenloom-cpu-share"]
    try:
        deadline = time.monotonic() + 10
        while threads.target != 1 and time.monotonic() < deadline:  # no step needed to measure
            time.sleep(0.01)
        assert threads.target == 1 and calls == []
        threads.before_step()
        assert calls == [1]
    finally:
        threads.close()
    sampler.join(timeout=5)
    assert not sampler.is_alive()


def test_adaptive_threads_off_where_nothing_adapts():
    assert cpu_threads.adaptive_threads("fixed", "cpu", 4) is None
    assert cpu_threads.adaptive_threads("adaptive", "cuda", 4) is None
    assert cpu_threads.adaptive_threads("adaptive", "cpu", 1) is None
    on = cpu_threads.adaptive_threads("adaptive", "cpu", 2)
    assert on is not None and on.max_threads == 2 and on.share.cores == set(os.sched_getaffinity(0))
    with pytest.raises(ValueError, match="--cpu-threads-policy must be one of adaptive, fixed; got 'x'"):
        cpu_threads.adaptive_threads("x", "cpu", 2)


def test_rank_omp_env_leaves_the_users_settings():
    assert cpu_threads.rank_omp_env({}) == {"GOMP_SPINCOUNT": str(cpu_threads.SPIN_COUNT)}
    assert cpu_threads.rank_omp_env({"OMP_WAIT_POLICY": "PASSIVE"}) == {}
    assert cpu_threads.rank_omp_env({"GOMP_SPINCOUNT": "0"}) == {}
    assert cpu_threads.rank_omp_env({"GOMP_SPINCOUNT": "0"}, "fixed") == {}


def test_rank_omp_env_spins_less_with_fixed_threads():
    # fixed threads meet a preempted peer at every barrier: a short spin; the adaptive count drops that peer
    assert cpu_threads.rank_omp_env({}, "adaptive") == {"GOMP_SPINCOUNT": "10000"}
    assert cpu_threads.rank_omp_env({}, "fixed") == {"GOMP_SPINCOUNT": "1000"}


def test_child_environment_restores(monkeypatch):
    monkeypatch.setenv("TL_TEST_A", "old")
    monkeypatch.delenv("TL_TEST_B", raising=False)
    with child_environment({"TL_TEST_A": "new", "TL_TEST_B": "b"}):
        assert (os.environ["TL_TEST_A"], os.environ["TL_TEST_B"]) == ("new", "b")
    assert os.environ["TL_TEST_A"] == "old" and "TL_TEST_B" not in os.environ
