"""TP=2 all-reduce latency on one host: gloo over loopback (`dist.all_reduce`) vs the shared-memory
communicator (`tokenloom.distributed.shm_comm.ShmCommunicator`, csrc/shm_allreduce.c), bf16, side by side in
one run.

Two rank processes (torch.multiprocessing spawn, 1 torch thread each, gloo joined by
`tokenloom.distributed.groups.init_distributed`). Per size, after a warm-up, the ranks alternate call by call
— gloo, shm, gloo, shm, ... — so both see the same machine conditions; each call is timed on its own on
rank 0 (this includes waiting for rank 1, as in a forward pass). Before each timed call an untimed 1-element
shm all-reduce lines the ranks up (skew ~1 us), so no call absorbs the previous call's skew between ranks
(gloo returns on the two ranks up to tens of microseconds apart). Reports the median microseconds per call of
each and gloo / shm. Before timing, each size's shm result is checked against gloo's (a sum of two bf16
values rounded once is the same either way). Sizes (elements): 576 (one decode token's hidden state of
SmolLM2-135M), 576*16, 576*64 (decode batches), 2048*64, 576*2048 (a prefill chunk).

Usage:
    .venv/bin/python bench/allreduce.py           # 400 timed calls of each per size
    .venv/bin/python bench/allreduce.py --quick   # 60
The last line of stdout is one JSON object. "other_cpu" is the share of the machine's CPU time used by other
processes during the run (0 = quiet); on a shared 2-core machine, read the numbers with it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import sys
import time

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SIZES = [576, 576 * 16, 576 * 64, 2048 * 64, 576 * 2048]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, calls: int, warmup: int, results) -> None:
    import torch.distributed as dist

    from tokenloom.distributed.comm import broadcast_pyobj
    from tokenloom.distributed.groups import destroy_distributed, init_distributed
    from tokenloom.distributed.shm_comm import ShmCommunicator

    torch.set_num_threads(1)
    ctx = init_distributed(2, 1, rank, f"127.0.0.1:{port}", "cpu", init_timeout_s=60, op_timeout_s=60)
    comm = ShmCommunicator.create(ctx)
    if comm is None:
        results.put({"error": "shared-memory communicator unavailable (native kernels did not build)"})
        destroy_distributed()
        return
    rows = []
    gen = torch.Generator().manual_seed(rank)
    for n in SIZES:
        x = torch.randn(n, generator=gen).to(torch.bfloat16)
        a, b = x.clone(), x.clone()
        dist.all_reduce(a, group=ctx.tp_group)
        comm.all_reduce_(b)
        if not torch.equal(a, b):
            raise AssertionError(f"n={n}: shm and gloo sums differ in {int((a != b).sum())} elements")
        times: dict[str, list[float]] = {"gloo": [], "shm": []}
        sync = torch.zeros(1, dtype=torch.bfloat16)
        for i in range(warmup + calls):
            for name in ("gloo", "shm"):
                y = x.clone()
                comm.all_reduce_(sync)  # start together: a call must not absorb the previous one's skew
                t0 = time.perf_counter()
                if name == "gloo":
                    dist.all_reduce(y, group=ctx.tp_group)
                else:
                    comm.all_reduce_(y)
                if i >= warmup:
                    times[name].append(time.perf_counter() - t0)
        rows.append({"elements": n, "bytes": 2 * n,
                     "gloo_us": 1e6 * statistics.median(times["gloo"]),
                     "shm_us": 1e6 * statistics.median(times["shm"])})
    broadcast_pyobj("done", ctx)
    comm.close()
    destroy_distributed()
    if rank == 0:
        results.put({"rows": rows})


def _busy_s() -> float:
    """CPU seconds the whole machine has spent busy since boot (from /proc/stat)."""
    with open("/proc/stat") as f:
        fields = [float(v) for v in f.readline().split()[1:9]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="60 timed calls of each per size instead of 400")
    args = p.parse_args(argv)
    calls, warmup = (60, 10) if args.quick else (400, 40)

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    t0, busy0 = time.perf_counter(), _busy_s()
    own0 = resource.getrusage(resource.RUSAGE_SELF)
    kids0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    procs = [ctx.Process(target=_rank, args=(r, port, calls, warmup, results)) for r in range(2)]
    for proc in procs:
        proc.start()
    try:
        out = results.get(timeout=600)
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    if "error" in out:
        sys.exit(out["error"])
    own1 = resource.getrusage(resource.RUSAGE_SELF)
    kids1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    ours = sum(getattr(b, f) - getattr(a, f) for a, b in ((own0, own1), (kids0, kids1))
               for f in ("ru_utime", "ru_stime"))
    wall = (time.perf_counter() - t0) * (os.cpu_count() or 1)
    other = max(0.0, _busy_s() - busy0 - ours) / wall

    print(f"TP=2 bf16 all-reduce, median us per call on rank 0 ({calls} calls each, alternating)")
    print(f"{'elements':>10} {'KiB':>8} {'gloo us':>10} {'shm us':>10} {'gloo/shm':>9}")
    for row in out["rows"]:
        row["ratio"] = row["gloo_us"] / row["shm_us"]
        print(f"{row['elements']:>10} {row['bytes'] / 1024:>8.1f} {row['gloo_us']:>10.1f} {row['shm_us']:>10.1f} "
              f"{row['ratio']:>9.1f}")
    print(f"other processes used {100 * other:.0f}% of the CPUs during the run")
    print(json.dumps({"bench": "allreduce", "calls": calls, "other_cpu": round(other, 3), "rows": out["rows"]}))


if __name__ == "__main__":
    main()
