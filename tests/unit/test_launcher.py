"""`RuntimeLauncher`'s start-up wait and supervision, over stand-in child processes (forked, no model):
a rank that reports an error, exits, or never reports ready is named within the bound; a dead child is
named with its exit code; `stop_all` ends the rest; threads per rank follow the local rank count."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest

from tokenloom.config import ConfigError, ServerArgs
from tokenloom.entrypoints.launcher import RuntimeLauncher
from tokenloom.model_config import ModelConfig
from tokenloom.models.loader import ModelSource


def _ready(pipe) -> None:
    pipe.send({"status": "ready", "max_total_num_tokens": 64})
    time.sleep(60)


def _exits(pipe) -> None:
    os._exit(3)


def _hangs(pipe) -> None:
    time.sleep(60)


def _fails(pipe) -> None:
    pipe.send({"status": "error", "error": "RuntimeError: no memory"})
    time.sleep(60)


def _launcher(targets: dict, timeout_s: float = 30.0) -> tuple[RuntimeLauncher, dict]:
    launcher = RuntimeLauncher.__new__(RuntimeLauncher)  # the wait and supervision only, no real ranks
    launcher.startup_timeout_s = timeout_s
    launcher.processes, launcher.labels, launcher.scheduler_info = {}, {}, {}
    launcher.board, launcher.rank_of, launcher._reported, launcher.ranks = None, {}, set(), range(len(targets))
    ctx = mp.get_context("fork")
    pipes = {}
    for rank, (key, target) in enumerate(targets.items()):
        reader, writer = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=target, args=(writer,), daemon=True)
        proc.start()
        writer.close()
        launcher.processes[key], pipes[key] = proc, reader
        launcher.rank_of[key] = rank
        launcher.labels[key] = f"scheduler rank {rank} (tp {rank}, pp 0)"
    launcher._pipes = pipes
    return launcher, pipes


@pytest.mark.parametrize("bad, message", [
    (_exits, r"scheduler rank 1 \(tp 1, pp 0\) exited during startup \(exit code 3\)"),
    (_fails, r"scheduler rank 1 \(tp 1, pp 0\) failed to start: RuntimeError: no memory"),
])
def test_a_rank_that_fails_at_start_is_named(bad, message):
    launcher, pipes = _launcher({"scheduler": _ready, "scheduler1": bad})
    try:
        with pytest.raises(RuntimeError, match=message):
            launcher._wait_ready(pipes)
    finally:
        launcher.stop_all()
    assert not any(p.is_alive() for p in launcher.processes.values())


def test_a_rank_that_hangs_at_start_is_named_after_the_bound():
    launcher, pipes = _launcher({"scheduler": _ready, "scheduler1": _hangs}, timeout_s=1.5)
    start = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match=r"not ready after 1.5 s: scheduler rank 1 \(tp 1, pp 0\)$"):
            launcher._wait_ready(pipes)
        assert time.monotonic() - start < 5
        assert launcher.scheduler_info["max_total_num_tokens"] == 64  # rank 0 did report
    finally:
        launcher.stop_all()


def test_a_dead_rank_is_named_with_its_exit_code():
    launcher, pipes = _launcher({"scheduler": _ready, "scheduler1": _ready})
    try:
        launcher._wait_ready(pipes)
        assert launcher.dead() is None
        launcher.processes["scheduler1"].kill()
        launcher.processes["scheduler1"].join(5)
        assert launcher.dead() == "scheduler rank 1 (tp 1, pp 0) died (exit code -9)"
        assert launcher.dead_besides("scheduler rank 0 (tp 0, pp 0)") == [launcher.dead()]
        assert launcher.dead_besides("scheduler rank 1 (tp 1, pp 0)") == []
    finally:
        launcher.stop_all()
    assert not any(p.is_alive() for p in launcher.processes.values())


def _fails_after_ready(pipe) -> None:
    pipe.send({"status": "ready"})
    time.sleep(0.3)
    pipe.send({"status": "error", "error": "RuntimeError: lost its peer"})
    raise SystemExit(1)


class _Board:
    """A world board in memory: what the launcher publishes and reads."""

    def __init__(self, remote: dict[int, str]) -> None:
        self.published: dict[int, str] = {}
        self.remote = remote

    def report_death(self, rank: int, text: str) -> None:
        self.published.setdefault(rank, text)

    def deaths(self, ranks) -> list[str]:
        return [self.remote[r] for r in ranks if r in self.remote]


def test_a_rank_that_fails_later_is_named_with_its_error_and_published_once():
    launcher, pipes = _launcher({"scheduler": _ready, "scheduler1": _fails_after_ready})
    launcher.board, launcher.world = _Board({}), 2
    try:
        launcher._wait_ready(pipes)
        launcher.processes["scheduler1"].join(5)
        reason = "scheduler rank 1 (tp 1, pp 0) failed (exit code 1): RuntimeError: lost its peer"
        assert launcher.dead() == reason
        assert launcher.board.published == {1: reason}
        launcher.dead()
        assert launcher.board.published == {1: reason}
    finally:
        launcher.stop_all()


def test_deaths_published_by_other_nodes_are_reported():
    launcher, pipes = _launcher({"scheduler": _ready})
    launcher.world = 2  # rank 1 runs on another node
    launcher.board = _Board({1: "scheduler rank 1 (tp 1, pp 0) on node 1 died (exit code -9)"})
    try:
        launcher._wait_ready(pipes)
        assert launcher.dead() == "scheduler rank 1 (tp 1, pp 0) on node 1 died (exit code -9)"
        assert launcher.dead_besides("scheduler rank 0 (tp 0, pp 0)") == [launcher.dead()]
    finally:
        launcher.stop_all()


def _source(**sizes) -> ModelSource:
    """What the launcher reads of a model before any rank starts: the shapes `check_parallel_fits` splits."""
    shape = {**dict(num_attention_heads=4, num_key_value_heads=1, intermediate_size=128), **sizes}
    config = ModelConfig(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=64, num_hidden_layers=2,
                         head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=128,
                         tie_word_embeddings=True, attention_bias=False, **shape)
    return ModelSource(kind="hf", path="unused", config=config, load_format="dummy")


@pytest.mark.parametrize("flags, threads", [({}, None), ({"tp_size": 2}, max(1, len(os.sched_getaffinity(0)) // 2)),
                                             ({"tp_size": 2, "num_threads": 3}, 3)])
def test_threads_per_rank(flags, threads):
    launcher = RuntimeLauncher(ServerArgs(**flags), _source(), addresses=None)
    assert launcher.rank_args().num_threads == threads
    assert (launcher.dist_init_addr is not None) == (flags.get("tp_size", 1) > 1)


def test_a_model_that_does_not_split_is_refused_before_any_rank_starts():
    with pytest.raises(ConfigError, match="--tp-size 2 cannot split the model: its 3 attention heads"):
        RuntimeLauncher(ServerArgs(tp_size=2), _source(num_attention_heads=3), addresses=None)


@pytest.mark.parametrize("setting, flags, expected", [
    (None, {"tp_size": 2}, [[c] for c in sorted(os.sched_getaffinity(0))[:2]]
     if len(os.sched_getaffinity(0)) == 2 else None),
    ("nobind", {"tp_size": 2}, None),
    (None, {}, None),  # one rank keeps the whole machine
])
def test_each_local_rank_gets_its_own_cores(monkeypatch, setting, flags, expected):
    if setting is None:
        monkeypatch.delenv("TOKENLOOM_CPU_OMP_THREADS_BIND", raising=False)
    else:
        monkeypatch.setenv("TOKENLOOM_CPU_OMP_THREADS_BIND", setting)
    launcher = RuntimeLauncher(ServerArgs(**flags), _source(), addresses=None)
    assert launcher.rank_cores == expected


def test_a_bad_core_binding_is_refused_before_any_rank_starts(monkeypatch):
    monkeypatch.setenv("TOKENLOOM_CPU_OMP_THREADS_BIND", "0|0")
    with pytest.raises(ValueError, match=r"cores \[0\] are in two ranks' groups"):
        RuntimeLauncher(ServerArgs(tp_size=2), _source(), addresses=None)


def _mask(monkeypatch, cores) -> None:
    """This process's affinity mask as `taskset -c` would leave it (what the launcher reads)."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(cores))


def test_auto_binds_within_this_process_mask(monkeypatch):
    """Two servers on one host started under disjoint masks (taskset) get disjoint blocks, one thread per core."""
    monkeypatch.delenv("TOKENLOOM_CPU_OMP_THREADS_BIND", raising=False)
    blocks = []
    for mask in (range(4, 8), range(0, 4)):
        _mask(monkeypatch, mask)
        launcher = RuntimeLauncher(ServerArgs(tp_size=2), _source(), addresses=None)
        blocks.append(launcher.rank_cores)
        assert [launcher.rank_args(i).num_threads for i in range(2)] == [2, 2]
    assert blocks == [[[4, 5], [6, 7]], [[0, 1], [2, 3]]]


def test_a_rank_bound_to_an_explicit_group_runs_a_thread_per_core(monkeypatch):
    _mask(monkeypatch, range(4))
    monkeypatch.setenv("TOKENLOOM_CPU_OMP_THREADS_BIND", "0|1-3")
    launcher = RuntimeLauncher(ServerArgs(tp_size=2), _source(), addresses=None)
    assert launcher.rank_cores == [[0], [1, 2, 3]]
    assert [launcher.rank_args(i).num_threads for i in range(2)] == [1, 3]
    launcher = RuntimeLauncher(ServerArgs(tp_size=2, num_threads=1), _source(), addresses=None)
    assert [launcher.rank_args(i).num_threads for i in range(2)] == [1, 1]
    with pytest.raises(ValueError, match=r"--num-threads 2 is more than the 1 cores of local rank 0's group \[0\]"):
        RuntimeLauncher(ServerArgs(tp_size=2, num_threads=2), _source(), addresses=None)


def test_an_unreadable_mask_leaves_the_ranks_unbound(monkeypatch):
    def fails(pid):
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(os, "sched_getaffinity", fails)
    monkeypatch.delenv("TOKENLOOM_CPU_OMP_THREADS_BIND", raising=False)
    launcher = RuntimeLauncher(ServerArgs(tp_size=2), _source(), addresses=None)
    assert launcher.rank_cores is None
    assert launcher.rank_args(0).num_threads == max(1, (os.cpu_count() or 1) // 2)


def test_a_rank_that_cannot_bind_ends_the_launch_with_the_reason():
    """A core outside the rank's mask (a cpuset narrowed after the launcher checked): the real rank process
    reports why through its ready pipe, as any start-up failure, and the launch fails naming it and the cores.
    Node 1 of 2: no detokenizer, and the rank fails before it would meet its peers."""
    args = ServerArgs(tp_size=2, nnodes=2, node_rank=1, dist_init_addr="127.0.0.1:1")
    launcher = RuntimeLauncher(args, _source(), addresses=None, startup_timeout_s=120)
    outside = max(os.sched_getaffinity(0)) + 1000
    launcher.rank_cores = [[outside]]
    with pytest.raises(RuntimeError, match=rf"scheduler rank 1 \(tp 1, pp 0\) on node 1 failed to start: "
                                           rf"CoreBindingError: TOKENLOOM_CPU_OMP_THREADS_BIND: cores \[{outside}\] "
                                           rf"of this rank's set \[{outside}\] are outside the cores this process"):
        launcher.start()
    assert list(launcher.processes) == ["scheduler1"]
    assert not launcher.processes["scheduler1"].is_alive()
