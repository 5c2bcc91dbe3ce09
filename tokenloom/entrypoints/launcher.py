"""`RuntimeLauncher`: owns the process topology of one engine — spawns this node's scheduler ranks (tp × pp,
`topology.node_ranks`) and, on node 0 with --detokenizer-process, the detokenizer (by default the tokenizer
manager detokenizes); waits for every one to be ready under one deadline;
supervises them; stops them.

Ranks: each scheduler rank is a spawned process running `scheduler.process.run_scheduler_process` with its
global rank and the rendezvous address (`--dist-init-addr`, default 127.0.0.1 and a free port picked here).
Cores per rank (`TOKENLOOM_CPU_OMP_THREADS_BIND`, distributed/cpu_binding.py): by default, on the CPU, each
local rank is bound to its own block of this process's allowed cores; the rank binds itself first thing, so
every thread it starts runs there, and a rank that cannot bind fails its start-up like any other. Threads per
rank: `--num-threads` if given; else a bound rank runs one per core of its set, and unbound ranks sharing this
machine cores / local ranks each (`topology.threads_per_rank`), set in each rank before its model is built, so
ranks never oversubscribe the cores; one unbound rank alone keeps torch's default. Every child starts with
libgomp's wait policy in its environment (`cpu_threads.rank_omp_env`: GOMP_SPINCOUNT unless the user set it or
OMP_WAIT_POLICY), read once when the child imports torch; torch's and glibc's huge-page allocation
(`huge_pages.rank_memory_env`: THP_MEM_ALLOC_ENABLE=1 and glibc.malloc.hugetlb=1 in GLIBC_TUNABLES unless the user
set them); and this process's pid (`process_tree.SERVER_PID_ENV`: the adaptive thread policy counts this server's
processes as its own).

Supervision: `dead()` names the first child that exited ("scheduler rank 1 (tp 1, pp 0) died (exit code
-9)"); the tokenizer manager polls it and marks the engine dead. One dead rank leaves the others blocked in
their collectives, so `stop_all()` ends the rest. Start-up fails with the name of every rank that reported
an error, exited, or did not report ready in time. Children exit on their own when this process goes
(their parent watchdog, frontend/process_utils.py).

Several nodes (`--nnodes`): each node's launcher starts only its own ranks (node 0 also the detokenizer, if any; the
other nodes have no IPC addresses: their ranks talk to node 0 only through torch.distributed). Once its ranks
are up it joins the `WorldBoard` (distributed/world_board.py) on the rendezvous store: a launcher publishes
the death of one of its ranks there, and `dead()` / `dead_besides()` also report the deaths other nodes
published, so node 0 names a rank that died on node 1. `stop_all(clean=True)` on node 0 first announces the
shutdown, so the other nodes exit quietly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing as mp
import os
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

from tokenloom.config import ServerArgs, check_parallel_fits
from tokenloom.distributed import cpu_binding, topology
from tokenloom.distributed.world_board import BoardUnreachable, WorldBoard
from tokenloom.entrypoints.scheduler_process import rank_label, run_scheduler_process
from tokenloom.executor.cpu_threads import rank_omp_env
from tokenloom.executor.huge_pages import rank_memory_env
from tokenloom.executor.process_tree import SERVER_PID_ENV
from tokenloom.frontend.detokenizer import run_detokenizer_process
from tokenloom.ipc import IpcAddresses
from tokenloom.models.loader import ModelSource

STARTUP_TIMEOUT_S = 900
STOP_WAIT_S = 10


@contextlib.contextmanager
def child_environment(extra: dict[str, str]) -> Iterator[None]:
    """`extra` in os.environ while processes are spawned (a spawned child starts with this process's
    environment, before it imports anything), then the environment as it was."""
    saved = {name: os.environ.get(name) for name in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class RuntimeLauncher:
    def __init__(self, args: ServerArgs, source: ModelSource, addresses: IpcAddresses | None,
                 startup_timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        check_parallel_fits(args, source.config)
        if source.gguf is not None and source.quantization == "gguf" and args.tp_size > 1:
            source.gguf.check_tp_split(args.tp_size, args.moe_ep_size)
        self.args = args
        self.source = source
        self.addresses = addresses
        self.startup_timeout_s = startup_timeout_s
        self.ranks = topology.node_ranks(args.tp_size, args.pp_size, args.nnodes, args.node_rank)
        self.world = args.tp_size * args.pp_size
        self.dist_init_addr = args.dist_init_addr
        if self.world > 1 and self.dist_init_addr is None:
            self.dist_init_addr = f"127.0.0.1:{free_port()}"
        self.processes: dict[str, mp.Process] = {}  # key: "scheduler" (rank 0), "scheduler1", ..., "detokenizer"
        self.labels: dict[str, str] = {}
        self.scheduler_info: dict[str, Any] = {}  # the entry rank's ready message
        self.rank_of: dict[str, int] = {}  # process key -> global rank (scheduler ranks only)
        self.board: WorldBoard | None = None  # joined after start when the world spans several nodes
        self._pipes: dict[str, Any] = {}  # kept open: a rank that fails later reports its error through it
        self._reported: set[str] = set()  # local deaths already published on the board
        # each local rank's cores, in self.ranks' order (None: no binding); a bad setting fails here, at once
        self.rank_cores = cpu_binding.rank_cores(os.environ.get(cpu_binding.ENV), len(self.ranks),
                                                 cpu_binding.allowed_cores(), args.num_threads,
                                                 args.device.split(":")[0])

    def rank_args(self, index: int | None = None) -> ServerArgs:
        """The args local rank `index` (in self.ranks' order; None: an unbound rank) runs with: the thread
        count made explicit unless --num-threads gave it, as many as its cores when it is bound, else cores /
        local ranks when ranks share this machine."""
        if self.args.num_threads is not None:
            return self.args
        cores = self.rank_cores[index] if index is not None and self.rank_cores is not None else None
        if cores is not None:
            return dataclasses.replace(self.args, num_threads=len(cores))
        if len(self.ranks) == 1:
            return self.args
        return dataclasses.replace(self.args, num_threads=topology.threads_per_rank(len(self.ranks)))

    def start(self, cancelled: Callable[[], bool] | None = None) -> dict[str, Any]:
        """Spawn every local process and wait until all are ready; returns the entry rank's ready info.
        On any failure every child is stopped and RuntimeError names what failed; `cancelled()` turning true
        (a signal arrived) stops the wait the same way."""
        ctx = mp.get_context("spawn")
        pipes: dict[str, Any] = {}
        targets: list[tuple[str, str, Any, tuple, tuple]] = []  # key, label, target, args, args after the pipe
        for index, rank in enumerate(self.ranks):
            key = "scheduler" if rank == 0 else f"scheduler{rank}"
            cores = self.rank_cores[index] if self.rank_cores is not None else None
            label = rank_label(rank, self.args.tp_size, self.args.pp_size)
            if self.args.nnodes > 1:
                label += f" on node {self.args.node_rank}"
            self.rank_of[key] = rank
            targets.append((key, "scheduler process" if self.world == 1 else label, run_scheduler_process,
                            (self.rank_args(index), self.addresses), (rank, self.dist_init_addr, cores)))
        if self.args.node_rank == 0 and self.args.detokenizer_process:
            targets.append(("detokenizer", "detokenizer process", run_detokenizer_process,
                            (dataclasses.replace(self.source, gguf=None), self.args.tokenizer_path, self.addresses),
                            (self.args.log_level,)))
        try:
            for key, label, target, args, extra in targets:
                reader, writer = ctx.Pipe(duplex=False)
                proc = ctx.Process(target=target, args=(*args, writer, *extra), name=f"tokenloom-{key}", daemon=True)
                with child_environment({**rank_omp_env(os.environ, self.args.cpu_threads_policy),
                                        **rank_memory_env(os.environ),
                                        SERVER_PID_ENV: str(os.getpid())}):
                    proc.start()
                writer.close()
                self.processes[key], self.labels[key], pipes[key] = proc, label, reader
            self._pipes = pipes
            self._wait_ready(pipes, cancelled)
            if self.args.nnodes > 1:
                self.board = WorldBoard(self.dist_init_addr, self.world)
        except BaseException:
            self.stop_all()
            raise
        return self.scheduler_info

    def _wait_ready(self, pipes: dict[str, Any], cancelled: Callable[[], bool] | None = None) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        pending = dict(pipes)
        failures: list[str] = []
        while pending and time.monotonic() < deadline:
            if cancelled is not None and cancelled():
                raise RuntimeError("start-up cancelled before every process was ready")
            for key, pipe in list(pending.items()):
                proc, label = self.processes[key], self.labels[key]
                if pipe.poll(0.05):
                    try:
                        info = pipe.recv()
                    except EOFError:
                        info = None
                    if info is not None and info.get("status") == "ready":
                        if key == "scheduler":
                            self.scheduler_info = info
                        del pending[key]
                        continue
                    if info is not None:
                        failures.append(f"{label} failed to start: {info.get('error')}")
                        del pending[key]
                        continue
                if not proc.is_alive():
                    proc.join(timeout=2)
                    failures.append(f"{label} exited during startup (exit code {proc.exitcode}); see its log above "
                                    "(a script using the Engine needs an `if __name__ == '__main__':` guard)")
                    del pending[key]
            if failures:
                # one failed rank leaves its peers waiting in the rendezvous; name the cause, not the echoes
                raise RuntimeError("; ".join(failures))
        if pending:
            names = ", ".join(self.labels[k] for k in pending)
            raise RuntimeError(f"not ready after {self.startup_timeout_s:g} s: {names}")

    def label(self, key: str) -> str:
        return self.labels.get(key, key)

    def _exit_reason(self, key: str) -> str:
        """Why local child `key` is gone: its own error when it sent one through its pipe, else its exit code."""
        proc, pipe = self.processes[key], self._pipes.get(key)
        try:
            while pipe is not None and pipe.poll(0):
                info = pipe.recv()
                if isinstance(info, dict) and info.get("status") == "error":
                    return f"{self.labels[key]} failed (exit code {proc.exitcode}): {info.get('error')}"
        except (EOFError, OSError):
            pass
        return f"{self.labels[key]} died (exit code {proc.exitcode})"

    def local_deaths(self) -> list[str]:
        """This node's children that have exited, in launch order; scheduler ranks' deaths are published on
        the board (once each) for the other nodes."""
        found = []
        for key, proc in self.processes.items():
            if proc.is_alive():
                continue
            reason = self._exit_reason(key)
            found.append(reason)
            if self.board is not None and key in self.rank_of and key not in self._reported:
                self._reported.add(key)
                self.board.report_death(self.rank_of[key], reason)
        return found

    def remote_deaths(self) -> list[str]:
        """Deaths the other nodes' launchers published (empty on one node, or once the board is gone)."""
        if self.board is None:
            return []
        remote = [r for r in range(self.world) if r not in self.ranks]
        try:
            return self.board.deaths(remote)
        except BoardUnreachable:
            return []

    def dead(self) -> str | None:
        """Why the runtime cannot go on: the first local child (in launch order) that has exited, else the
        first rank another node reported dead, or None."""
        deaths = self.local_deaths() or self.remote_deaths()
        return deaths[0] if deaths else None

    def dead_besides(self, process_name: str) -> list[str]:
        """The children other than the one `process_name` names (a ProcessFailed's sender) that have exited,
        and the ranks other nodes reported dead."""
        local = [reason for reason in self.local_deaths() if not reason.startswith(process_name)]
        return local + self.remote_deaths()

    def stop_all(self, clean: bool = False) -> None:
        """Terminate every child that is still running (then kill it after a grace period); idempotent.
        `clean` on node 0: a deliberate shutdown, announced on the board first so the other nodes exit 0."""
        if clean and self.board is not None and self.args.node_rank == 0:
            self.board.announce_shutdown(self.args.nnodes)
        for proc in self.processes.values():
            if proc.is_alive():
                proc.terminate()
        deadline = time.monotonic() + STOP_WAIT_S  # one grace period for all of them, not one each
        for proc in self.processes.values():
            proc.join(timeout=max(deadline - time.monotonic(), 0))
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=2)
