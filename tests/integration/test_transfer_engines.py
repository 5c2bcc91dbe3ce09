"""The KV transfer engines with real processes on loopback: for Mooncake and NIXL, a writer process moves
runs (one large, several unaligned and scattered, 2500 small ones in one call, from two threads at once) into
a receiver's registered tensor, and the receiver compares its whole buffer with the copy it computes itself
(so bytes outside the runs must be untouched). Failures must surface as TransferError within a bound: an
address outside registered memory (remote or local), a receiver frozen with SIGSTOP (timeout_s 2), and a
killed receiver. Processes that finish their work must exit with status 0. The fake engine moves nothing."""

from __future__ import annotations

import importlib.util
import os
import signal
import sys
import threading
import time
import traceback
from typing import Any

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from tokenloom.disaggregation.transfer.base import Regions, TransferEngine, TransferError, checked_runs, make_engine

BUF = 4 << 20
SMALL_RUNS = 2500
REPLY_S = 60.0
ENGINE_MODULES = {"mooncake": "mooncake", "nixl": "nixl_cu12"}


def _source() -> torch.Tensor:
    return torch.randint(0, 256, (BUF,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1234))


def _run_sets() -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
    """(small, mixed) runs as (src offset, dst offset, bytes): 2500 runs of 1-256 bytes with gaps between them
    on the destination, and one 1 MiB run plus scattered unaligned ones. No two destinations overlap."""
    gen = torch.Generator().manual_seed(99)
    small = []
    dst = 2 << 20
    for n, src in zip(torch.randint(1, 257, (SMALL_RUNS,), generator=gen).tolist(),
                      torch.randint(0, BUF - 256, (SMALL_RUNS,), generator=gen).tolist(), strict=True):
        small.append((src, dst, n))
        dst += n + 1 + n % 7  # a gap of at least one untouched byte
    mixed = [(0, 0, 1 << 20), (3, (1 << 20) + 5, 12345), ((3 << 20) + 1, (1 << 20) + 20000, 777),
             (17, (1 << 20) + 40001, 65537), ((1 << 20) + 9, (1 << 20) + 200003, 300001)]
    assert dst < BUF and (1 << 20) + 200003 + 300001 < 2 << 20
    return small, mixed


def _expected() -> torch.Tensor:
    """The receiver's buffer after the runs: zeros with each run's source bytes copied in (plain indexing)."""
    src, out = _source(), torch.zeros(BUF, dtype=torch.uint8)
    small, mixed = _run_sets()
    for s, d, n in small + mixed:
        out[d: d + n] = src[s: s + n]
    return out


def _addressed(runs: list[tuple[int, int, int]], src_base: int, dst_base: int) -> list[tuple[int, int, int]]:
    return [(src_base + s, dst_base + d, n) for s, d, n in runs]


def _receiver(backend: str, peer_conn: Any, ctl: Any) -> None:
    """Registers a zeroed tensor, hands (descriptor, address) to the writer, answers the test's commands."""
    torch.set_num_threads(1)
    engine = make_engine(backend)
    dst = torch.zeros(BUF, dtype=torch.uint8)
    engine.register(dst.data_ptr(), dst.numel())
    engine.expect_incoming(True)
    peer_conn.send({"descriptor": engine.descriptor(), "addr": dst.data_ptr()})
    while (cmd := ctl.recv()) != "exit":
        if cmd == "check":
            ctl.send(int((dst != _expected()).sum()))
    engine.expect_incoming(False)
    engine.close()
    ctl.send("closed")


def _attempt(fn: Any) -> dict:
    t0 = time.monotonic()
    try:
        fn()
        error = detail = None
    except Exception as e:
        error, detail = type(e).__name__, str(e)
    return {"error": error, "detail": detail, "s": time.monotonic() - t0}


def _writer(backend: str, conn1: Any, conn2: Any, ctl: Any) -> None:
    """Writes into receiver 1 (correctness, bad addresses) and receiver 2 (frozen, killed) on command."""
    torch.set_num_threads(1)
    if backend == "nixl":  # the 2500-run call then spans three NIXL transfer requests
        from tokenloom.disaggregation.transfer import nixl

        nixl.BATCH_DESCS = 1000
    if backend == "mooncake":  # a frozen peer's write raises within its 2 s timeout here instead of waiting
        from tokenloom.disaggregation.transfer import mooncake  # for Mooncake's own 30 s (test_mooncake_settle.py)

        mooncake.SETTLE_S = 0.0
    try:
        src = _source()
        engine = make_engine(backend)
        engine.register(src.data_ptr(), src.numel())
        r1, r2 = conn1.recv(), conn2.recv()
        base = src.data_ptr()
        small, mixed = _run_sets()
        engines = [engine]
        ctl.send("ready")
    except Exception:
        ctl.send(traceback.format_exc())
        return

    def to(peer: dict, runs: list[tuple[int, int, int]], timeout_s: float, eng: TransferEngine = engine) -> Any:
        return lambda: eng.write(peer["descriptor"], _addressed(runs, base, peer["addr"]), timeout_s)

    def cold_engine() -> TransferEngine:
        fresh = make_engine(backend)
        fresh.register(src.data_ptr(), src.numel())
        engines.append(fresh)
        return fresh

    def correct() -> dict[str, dict]:
        """Two threads at once: the 2500 small runs in one call, and the mixed runs."""
        out: dict[str, dict] = {}

        def one(key: str, runs: list[tuple[int, int, int]]) -> None:
            out[key] = _attempt(to(r1, runs, 30.0))

        threads = [threading.Thread(target=one, args=item) for item in (("small", small), ("mixed", mixed))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out

    while (cmd := ctl.recv()) != "exit":
        if cmd == "correct":
            ctl.send(correct())
        elif cmd == "bad_addresses":
            ctl.send({"straddles_end": _attempt(to(r1, [(0, BUF - 100, 4096)], 10.0)),
                      "unregistered_remote": _attempt(to(r1, [(0, 1 << 40, 4096)], 10.0)),
                      "unregistered_local": _attempt(to(r1, [(BUF, 0, 64)], 10.0)),
                      "then_valid": _attempt(to(r1, mixed[:1], 10.0))})  # rewrites the same bytes
        elif cmd == "warm_r2":
            ctl.send(_attempt(to(r2, [(0, 0, 4096)], 10.0)))
        elif cmd == "frozen_warm":
            ctl.send(_attempt(to(r2, [(0, 0, 1 << 20)], 2.0)))
        elif cmd == "frozen_cold":  # a fresh engine: the first contact (handshake / connection) meets the frozen peer
            ctl.send(_attempt(to(r2, [(0, 0, 4096)], 2.0, cold_engine())))
        elif cmd == "dead":
            ctl.send(_attempt(to(r2, [(0, 0, 1 << 20)], 15.0)))
    for eng in engines:
        eng.close()
    ctl.send("closed")


class _World:
    """Receivers 1 and 2 and the writer, spawned; every process is gone when the block exits, pass or fail."""

    def __init__(self, backend: str) -> None:
        ctx = mp.get_context("spawn")
        self.ctl: dict[str, Any] = {}
        self.procs: dict[str, Any] = {}
        peer_ends = []
        for name in ("r1", "r2"):
            recv_end, send_end = ctx.Pipe()
            peer_ends.append(recv_end)
            self._spawn(ctx, name, _receiver, backend, send_end)
        self._spawn(ctx, "w", _writer, backend, *peer_ends)

    def _spawn(self, ctx: Any, name: str, target: Any, *args: Any) -> None:
        mine, theirs = ctx.Pipe()
        self.ctl[name] = mine
        self.procs[name] = ctx.Process(target=target, args=(*args, theirs), daemon=True)
        self.procs[name].start()

    def call(self, name: str, cmd: str) -> Any:
        self.ctl[name].send(cmd)
        return self.reply(name)

    def reply(self, name: str) -> Any:
        if not self.ctl[name].poll(REPLY_S):
            raise AssertionError(f"{name} did not answer within {REPLY_S} s (exit code {self.procs[name].exitcode})")
        return self.ctl[name].recv()

    def signal(self, name: str, sig: int) -> None:
        """Send `sig`; for SIGSTOP, return only once every thread of the process is stopped (the signal is
        asynchronous: a transfer thread returning from a syscall could otherwise still answer a write)."""
        pid = self.procs[name].pid
        os.kill(pid, sig)
        if sig != signal.SIGSTOP:
            return
        deadline = time.monotonic() + 10
        while not _all_threads_stopped(pid):
            assert time.monotonic() < deadline, f"{name} did not stop within 10 s"
            time.sleep(0.01)

    def finish(self, name: str) -> int | None:
        assert self.call(name, "exit") == "closed"
        self.procs[name].join(timeout=30)
        return self.procs[name].exitcode

    def __enter__(self) -> _World:
        return self

    def __exit__(self, *exc: Any) -> None:
        for p in self.procs.values():
            if p.is_alive():
                try:
                    os.kill(p.pid, signal.SIGCONT)
                    p.kill()
                except ProcessLookupError:
                    pass
        for p in self.procs.values():
            p.join(timeout=10)


def _all_threads_stopped(pid: int) -> bool:
    """Whether every thread of `pid` is in the stopped state ('T' in /proc/PID/task/TID/stat)."""
    states = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
        except FileNotFoundError:  # a thread that exited meanwhile
            continue
    return bool(states) and all(state in ("T", "t") for state in states)


def _no_error(result: dict) -> None:
    assert result["error"] is None, result


def _raised_within(result: dict, bound_s: float) -> None:
    assert result["error"] == "TransferError", result
    assert result["s"] < bound_s, result


@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
def test_engine_between_processes(backend):
    if importlib.util.find_spec(ENGINE_MODULES[backend]) is None:
        pytest.skip(f"{backend} is not installed")
    with _World(backend) as world:
        ready = world.reply("w")
        assert ready == "ready", ready

        out = world.call("w", "correct")
        _no_error(out["small"])
        _no_error(out["mixed"])
        assert world.call("r1", "check") == 0  # every byte in the runs right, every byte outside still zero

        bad = world.call("w", "bad_addresses")
        for case in ("straddles_end", "unregistered_remote", "unregistered_local"):
            _raised_within(bad[case], 10.0)
        _no_error(bad["then_valid"])
        assert world.call("r1", "check") == 0  # the refused writes left the receiver untouched
        assert world.finish("r1") == 0

        _no_error(world.call("w", "warm_r2"))
        world.signal("r2", signal.SIGSTOP)
        warm = world.call("w", "frozen_warm")
        if backend == "mooncake":
            _raised_within(warm, 5.0)  # the TCP receiver must take part
        else:  # CMA: the writer copies into the stopped process itself, so this may complete
            assert warm["error"] in (None, "TransferError") and warm["s"] < 5.0, warm
        _raised_within(world.call("w", "frozen_cold"), 5.0)
        world.signal("r2", signal.SIGKILL)
        world.procs["r2"].join(timeout=10)
        _raised_within(world.call("w", "dead"), 15.0)
        assert world.finish("w") == 0


def test_fake_engine_moves_nothing():
    engine = make_engine("fake")
    assert isinstance(engine, TransferEngine) and engine.backend == "fake" and engine.descriptor() == "fake"
    src, dst = torch.arange(4096, dtype=torch.int32), torch.zeros(4096, dtype=torch.int32)
    engine.register(dst.data_ptr(), dst.numel() * 4)
    t0 = time.monotonic()
    engine.write("fake", [(src.data_ptr(), dst.data_ptr(), 4096 * 4)] * 3000, timeout_s=5.0)
    assert time.monotonic() - t0 < 0.5
    assert torch.count_nonzero(dst) == 0
    engine.expect_incoming(True)
    engine.close()


def test_make_engine_errors(monkeypatch):
    with pytest.raises(ValueError, match="mooncake, nixl, fake"):
        make_engine("rdma")
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)  # an import of it now raises ImportError
    with pytest.raises(ImportError, match="pip install mooncake-transfer-engine-non-cuda.*libibverbs1"):
        make_engine("mooncake")
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")  # the NIXL engine sets it on loopback when unset
    monkeypatch.setitem(sys.modules, "nixl_cu12", None)
    with pytest.raises(ImportError, match="pip install nixl-cu12"):
        make_engine("nixl")


def test_run_checks():
    regions = Regions()
    regions.add(1000, 100)
    regions.add(900, 50)
    regions.add(990, 500)  # overlaps and outlasts the first
    assert regions.outside([(900, 0, 50), (1000, 0, 100), (1095, 0, 300)]) is None
    assert regions.outside([(900, 0, 50), (940, 0, 20)]) == (940, 0, 20)  # crosses 950 into a gap
    assert regions.outside([(1490, 0, 11)]) == (1490, 0, 11)
    assert regions.outside([(10, 0, 1)]) == (10, 0, 1)
    assert checked_runs([(1, 2, 3), (4, 5, 0), (np.int64(6), 7, 8)]) == [(1, 2, 3), (6, 7, 8)]
    with pytest.raises(TransferError):
        checked_runs([(1, 2)])
    with pytest.raises(TransferError):
        checked_runs([(1, 2, -3)])
    with pytest.raises(TransferError):
        checked_runs([(1.5, 2, 3)])
