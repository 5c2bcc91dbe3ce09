"""Running a test's world of rank processes: spawn one process per rank, collect what each reports, and
leave nothing running. Each target is called as `target(rank, *args, port, results)` and puts exactly one
`(rank, dict)` on `results` — `{"error": traceback}` when it failed — either as the tuple itself or as its
`pickle.dumps` bytes. Bytes are the safe form when the dict holds torch tensors: torch's queue pickler shares a
tensor's storage through a file descriptor the receiver must fetch from the still-living sender, and a rank
that exits right after `put` leaves the receiver a dangling socket path (FileNotFoundError)."""

from __future__ import annotations

import pickle
import queue
import socket
import time
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(target: Callable[..., None], world: int, *args: Any, join_s: float = 60.0
              ) -> tuple[dict[int, dict], list[int | None]]:
    """Every rank's report (asserting none failed and all reported) and the processes' exit codes."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, *args, port, results)) for r in range(world)]
    for p in procs:
        p.start()
    got: dict[int, dict] = {}
    try:
        deadline = time.monotonic() + join_s
        while len(got) < world and time.monotonic() < deadline:
            try:
                item = results.get(timeout=1)
                rank, out = pickle.loads(item) if isinstance(item, bytes) else item
                got[rank] = out
            except queue.Empty:
                if all(p.exitcode is not None for p in procs) and results.empty():
                    break
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    errors = {r: o["error"] for r, o in got.items() if "error" in o}
    assert not errors, errors
    assert sorted(got) == list(range(world)), f"ranks that reported: {sorted(got)}"
    return got, [p.exitcode for p in procs]


def report_from_world(rank: int, tp: int, pp: int, port: int, results: Any,
                      body: Callable[[Any], dict]) -> None:
    """Inside a rank process: join the tp x pp world on loopback (1 thread), put `(rank, body(ctx))` on
    `results` — or `(rank, {"error": traceback})` — and leave the world."""
    import pickle
    import traceback

    import torch

    from tokenloom.distributed.groups import destroy_distributed, init_distributed

    torch.set_num_threads(1)
    try:
        ctx = init_distributed(tp, pp, rank, f"127.0.0.1:{port}", "cpu", init_timeout_s=30, op_timeout_s=30)
        try:
            out = body(ctx)
        finally:
            destroy_distributed()
        results.put(pickle.dumps((rank, out)))  # by value: see the module docstring
    except BaseException:
        results.put(pickle.dumps((rank, {"error": traceback.format_exc()})))
        raise
