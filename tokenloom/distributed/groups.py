"""Joining the tp × pp world: the rendezvous, torch.distributed's default group, and every rank's groups.

`init_distributed` runs once per scheduler rank, before the model is built:
1. Rendezvous on a TCP store at `--dist-init-addr host:port`, hosted by global rank 0 (node 0). Every rank
   writes an arrival key and waits for all of them, under a deadline; a rank that never comes makes the
   others fail with an error naming the missing ranks and the address, instead of hanging. Arrival keys carry
   each rank's tp/pp sizes, so nodes launched with different sizes fail clearly too.
2. `init_process_group` on that store with the compute backend (`device.distributed_backend`: gloo on the CPU,
   NCCL on CUDA).
3. Groups, created on every rank in the same order (torch requires it, members or not): each stage's compute TP
   group, each stage's gloo CPU control group, then one gloo group of the whole world.
4. On the CPU, a TP group whose ranks all arrived from this host gets a shared-memory communicator
   (`distributed/shm_comm.py`), which the layers' all-reduces and all-gathers then use. Which thread uses
   which group, and why they are separate: `parallel_state.py`.
At world size 1 nothing is initialised: the context is `SINGLE_PROCESS`-equivalent and torch.distributed is
never touched. `destroy_distributed` undoes steps 2 and 3 (the store goes with the default group; the
communicator with its context).
Across hosts gloo picks its interface from the host name; set GLOO_SOCKET_IFNAME where that resolves wrongly.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import tokenloom.device as device_util
from tokenloom.distributed import topology
from tokenloom.distributed.parallel_state import ParallelContext
from tokenloom.distributed.shm_comm import DEFAULT_TIMEOUT_S, ShmCommunicator

logger = logging.getLogger(__name__)

_ARRIVED = "tokenloom/arrived/"
_READ = "tokenloom/read/"
_FAILED = "tokenloom/failed"
_FAILED_SEEN = "tokenloom/failed_seen/"
_POLL_S = 0.02
_GRACE_S = 2.0  # how long rank 0 keeps the store up for the others to read a failure


class DistributedInitError(RuntimeError):
    """The world could not be assembled (a rank missing, the address unusable, sizes that disagree)."""


def init_distributed(tp_size: int, pp_size: int, rank: int, dist_init_addr: str | None,
                     device: torch.device | str, *, init_timeout_s: float = 120.0,
                     op_timeout_s: float | None = None, shared_memory: bool = True) -> ParallelContext:
    """Join the world as global `rank` and return this rank's `ParallelContext`.

    `init_timeout_s` bounds the rendezvous (every rank must arrive within it). `op_timeout_s` is the groups'
    collective timeout (None: torch's default); it must cover the slowest legitimate wait between ranks, such as
    one rank still loading weights while the others wait in the start-up MIN-reduce. `shared_memory`: give
    a TP group whose ranks share this host a shared-memory communicator (`ParallelContext.tp_comm`); False
    (--disable-custom-all-reduce) keeps every collective on torch.distributed.
    """
    tp_rank, pp_rank = topology.rank_coords(rank, tp_size, pp_size)
    world = tp_size * pp_size
    if world == 1:
        return ParallelContext()
    if dist_init_addr is None:
        raise ValueError(f"a world of {world} ranks needs --dist-init-addr host:port for its rendezvous")
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this process; call destroy_distributed first")
    host, port = topology.parse_dist_init_addr(dist_init_addr)
    device = torch.device(device)
    backend = device_util.distributed_backend(device)
    device_util.set_process_device(device)
    sizes = f"tp_size={tp_size} pp_size={pp_size} backend={backend}"

    store, arrivals = _rendezvous(host, port, rank, world, sizes, init_timeout_s)
    timeout = {} if op_timeout_s is None else {"timeout": timedelta(seconds=op_timeout_s)}
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, **timeout)
    try:
        mine: dict[str, object] = {}
        if tp_size > 1:
            for name, group_backend in (("tp_group", backend), ("tp_cpu_group", "gloo")):
                for ranks in topology.all_tp_groups(tp_size, pp_size):
                    group = dist.new_group(ranks, backend=group_backend, **timeout)
                    if rank in ranks:
                        mine[name] = group
        mine["world_cpu_group"] = dist.new_group(list(range(world)), backend="gloo", **timeout)
        ctx = ParallelContext(tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size, **mine)
        if tp_size > 1 and shared_memory and device.type == "cpu" \
                and _one_host(arrivals, topology.tp_group_ranks(pp_rank, tp_size)):
            comm = ShmCommunicator.create(ctx, timeout_s=op_timeout_s or DEFAULT_TIMEOUT_S)
            if comm is not None:
                ctx = dataclasses.replace(ctx, tp_comm=comm)
                logger.info("tensor-parallel collectives: shared memory (%d ranks on this host)", tp_size)
    except BaseException:
        dist.destroy_process_group()
        raise
    return ctx


def _one_host(arrivals: list[str], ranks: list[int]) -> bool:
    """Whether every rank of `ranks` arrived from the same host (the `host=` field of its arrival text).
    Every rank reads the same arrivals, so every rank of a group decides alike."""
    hosts = {next((f for f in arrivals[r].split() if f.startswith("host=")), "") for r in ranks}
    return len(hosts) == 1


def destroy_distributed() -> None:
    """Tear down every group of this process (idempotent; a no-op when nothing was initialised)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def _rendezvous(host: str, port: int, rank: int, world: int, sizes: str,
                timeout_s: float) -> tuple[dist.TCPStore, list[str]]:
    deadline = time.monotonic() + timeout_s
    where = f"--dist-init-addr {host}:{port}"
    store_timeout = timedelta(seconds=timeout_s)
    if rank == 0:
        try:
            store = dist.TCPStore(host, port, world, is_master=True, timeout=store_timeout, wait_for_workers=False)
        except dist.DistError as e:
            raise DistributedInitError(f"rank 0 cannot host the rendezvous at {where}: "
                                       f"{str(e).splitlines()[0]}") from None
    else:
        _wait_for_listener(host, port, deadline, f"rank {rank}: nothing listens at {where} after {timeout_s:g}s; "
                           f"global rank 0 (on node 0) hosts the rendezvous: is it running, with the same address?")
        store = dist.TCPStore(host, port, world, is_master=False, timeout=store_timeout, wait_for_workers=False)

    try:
        arrivals = _arrive(store, rank, world, f"{sizes} host={socket.gethostname()} pid={os.getpid()}",
                           deadline, f"rendezvous at {where} within {timeout_s:g}s")
    except dist.DistError as e:
        raise DistributedInitError(f"rank {rank}: lost the rendezvous store at {where} (rank 0 exited?): "
                                   f"{str(e).splitlines()[0]}") from None
    disagree = [f"rank {r}: {a}" for r, a in enumerate(arrivals) if not a.startswith(sizes + " ")]
    if disagree:
        raise DistributedInitError(f"rank {rank} ({sizes}): ranks were launched with different sizes: "
                                   + "; ".join(disagree))
    return store, arrivals


def _arrive(store: dist.TCPStore, rank: int, world: int, arrival: str, deadline: float, what: str) -> list[str]:
    """Announce this rank, wait for all, and return every rank's arrival text.

    Two rounds, so that rank 0 — whose exit takes the store down — never leaves before the others have read
    what they need: everyone reads the arrivals, then says so; on a timeout rank 0 publishes the missing ranks
    and waits (briefly) for the others present to read them, so every rank can name the missing ones.
    """
    arrived = [f"{_ARRIVED}{r}" for r in range(world)]
    store.set(arrived[rank], arrival)
    _wait_all(store, rank, arrived, deadline, what)
    arrivals = [store.get(k).decode() for k in arrived]
    read = [f"{_READ}{r}" for r in range(world)]
    store.set(read[rank], "1")
    _wait_all(store, rank, read, deadline + _GRACE_S, what)
    return arrivals


def _wait_all(store: dist.TCPStore, rank: int, keys: list[str], deadline: float, what: str) -> None:
    while not store.check(keys):
        if rank != 0 and store.check([_FAILED]):
            store.set(f"{_FAILED_SEEN}{rank}", "1")
            raise DistributedInitError(f"rank {rank}: {store.get(_FAILED).decode()}")
        if time.monotonic() > deadline:
            missing = [r for r, k in enumerate(keys) if not store.check([k])]
            names = f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))}"
            message = f"{names} of {len(keys)} did not reach the {what} (did every node start, " \
                      f"with the same --dist-init-addr?)"
            if rank == 0:
                _publish_failure(store, message, [r for r in range(1, len(keys)) if r not in missing])
            raise DistributedInitError(f"rank {rank}: {message}")
        time.sleep(_POLL_S)


def _publish_failure(store: dist.TCPStore, message: str, present: list[int]) -> None:
    """Rank 0 gave up: tell the ranks that came, and keep the store up until they have read it."""
    store.set(_FAILED, f"rank 0 gave up: {message}")
    seen = [f"{_FAILED_SEEN}{r}" for r in present]
    until = time.monotonic() + _GRACE_S
    while seen and not store.check(seen) and time.monotonic() < until:
        time.sleep(_POLL_S)


def _wait_for_listener(host: str, port: int, deadline: float, message: str) -> None:
    """Wait until something accepts TCP connections at host:port (the store's host started), up to `deadline`.

    Probing with a plain socket keeps the bound exact; TCPStore's own client retries overshoot it by about
    twice its timeout and print C++ stack traces while doing so."""
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise DistributedInitError(message)
        try:
            with socket.create_connection((host, port), timeout=min(1.0, remaining)):
                return
        except OSError:
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
