"""Prefill/decode disaggregation benchmarks, two modes: (1) `--mode transfer` (the default): KV transfer
throughput per transfer engine; (2) `--mode serve`: a prefill/decode pair behind SGLang's router against a
unified server on a mixed workload (`bench/disagg_serve.py` says what it runs and reports).

    .venv/bin/python bench/disagg.py                       # mooncake and nixl, 1k / 4k / 16k / 32k tokens
    .venv/bin/python bench/disagg.py --quick               # 256 tokens, 1 run
    .venv/bin/python bench/disagg.py --json-out F          # also write the rows as JSON
    .venv/bin/python bench/disagg.py --mode serve [--quick] [--backend nixl] [--json-out F]

(1) One request's KV moved from a prefill pool to a decode pool, shaped like SmolLM2-135M in bf16: 30 layers,
3 KV heads, head_dim 64. A pool is one registered buffer [layers, K/V, heads, rows, head_dim]
(`tokenloom.cache.kv_layout.KVLayout`); the request's tokens are a contiguous slot range on both sides
(slots from 1 on the prefill side, from 7 on the decode side; slot 0 is the pool's dummy), so
`transfer_runs` yields one run per (layer, K/V, head): 180 runs of tokens x 128 bytes, 23,040 bytes per token.
Two processes per backend: a receiver (registers its pool, expects incoming transfers) and a writer (registers
its pool, writes). Per size, after an untimed warm-up write (page faults, connection set-up), the writer
alternates a timed `engine.write` with a timed torch copy of the same 180 runs between two pools in its own
process (one strided `copy_` on one thread; the engines' copies are single-threaded too), and reports the
median of each. Every size is then checked: a CRC of the receiver's slots equals the CRC of the writer's (the
fake backend moves nothing and is not checked). "other_cpu" is the share of the machine's CPU time used by
other processes during the run (0 = quiet); on a shared 2-core machine, read the numbers with it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
import zlib
from typing import Any

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tokenloom.cache.kv_layout import KVLayout, transfer_runs  # noqa: E402

LAYERS, KV_HEADS, HEAD_DIM, ITEMSIZE = 30, 3, 64, 2  # SmolLM2-135M, bf16
SRC_FIRST_SLOT, DST_FIRST_SLOT = 1, 7
ROW_MARGIN = 8  # rows beyond the largest request: the dummy slot and the decode side's offset
TOKENS = [1024, 4096, 16384, 32768]
QUICK_TOKENS = [256]
REPLY_S = 600.0
MODES = ("transfer", "serve")


def bytes_per_token() -> int:
    return LAYERS * 2 * KV_HEADS * HEAD_DIM * ITEMSIZE


def pool_layout(base_addr: int, rows: int) -> KVLayout:
    return KVLayout(base_addr=base_addr, start_layer=0, end_layer=LAYERS, num_heads=KV_HEADS, head_start=0, rows=rows,
                    head_dim=HEAD_DIM, itemsize=ITEMSIZE, page_size=1, dtype="bfloat16")


def request_runs(src: KVLayout, dst: KVLayout, tokens: int) -> list[tuple[int, int, int]]:
    """The runs moving one request of `tokens` tokens from the prefill pool `src` to the decode pool `dst`."""
    return transfer_runs(src, dst, range(SRC_FIRST_SLOT, SRC_FIRST_SLOT + tokens),
                         range(DST_FIRST_SLOT, DST_FIRST_SLOT + tokens))


def _pool(rows: int) -> torch.Tensor:
    return torch.zeros(LAYERS, 2, KV_HEADS, rows, HEAD_DIM, dtype=torch.bfloat16)


def _crc(pool: torch.Tensor, first: int, tokens: int) -> int:
    """CRC-32 of the request's slots in every (layer, K/V, head) piece, in piece order."""
    crc = 0
    for layer in range(LAYERS):
        for kv in range(2):
            for head in range(KV_HEADS):
                piece = pool[layer, kv, head, first: first + tokens]  # contiguous: whole rows
                crc = zlib.crc32(piece.view(torch.int16).numpy().data, crc)
    return crc


def _receiver(backend: str, rows: int, conn: Any) -> None:
    from tokenloom.disaggregation.transfer.factory import make_engine

    torch.set_num_threads(1)
    engine = make_engine(backend)
    pool = _pool(rows)
    engine.register(pool.data_ptr(), pool.numel() * ITEMSIZE)
    engine.expect_incoming(True)
    conn.send({"descriptor": engine.descriptor(), "addr": pool.data_ptr()})
    while (msg := conn.recv()) != "exit":
        conn.send(_crc(pool, DST_FIRST_SLOT, msg))
    engine.expect_incoming(False)
    engine.close()
    conn.send("closed")


def _measure(backend: str, engine: Any, peer: dict, src: torch.Tensor, local: torch.Tensor, tokens: int,
             repeats: int, conn: Any) -> dict:
    rows = src.shape[3]
    src_layout = pool_layout(src.data_ptr(), rows)
    runs = request_runs(src_layout, pool_layout(peer["addr"], rows), tokens)
    s_lo, d_lo = SRC_FIRST_SLOT, DST_FIRST_SLOT
    src_view, local_view = src[:, :, :, s_lo: s_lo + tokens], local[:, :, :, d_lo: d_lo + tokens]

    def memcpy() -> None:
        local_view.copy_(src_view)  # one strided copy: the same 180 runs without per-run call overhead

    memcpy()
    engine.write(peer["descriptor"], runs, 600.0)  # warm-up: page faults, connection
    write_s, memcpy_s = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        memcpy()
        memcpy_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        engine.write(peer["descriptor"], runs, 600.0)
        write_s.append(time.perf_counter() - t0)
    verified = None
    if backend != "fake":
        conn.send(tokens)
        verified = conn.recv() == _crc(src, s_lo, tokens)
    nbytes = sum(n for _, _, n in runs)
    w, m = statistics.median(write_s), statistics.median(memcpy_s)
    return {"backend": backend, "tokens": tokens, "bytes": nbytes, "runs": len(runs), "repeats": repeats,
            "write_s": w, "memcpy_s": m, "gbps": nbytes / w / 1e9 if w > 0 else float("inf"),
            "memcpy_gbps": nbytes / m / 1e9, "vs_memcpy": m / w if w > 0 else float("inf"), "verified": verified,
            "write_all_s": write_s, "memcpy_all_s": memcpy_s}


def _writer(backend: str, rows: int, tokens: list[int], repeats: int, conn: Any, results: Any) -> None:
    import traceback

    from bench.common import _fill_random
    from tokenloom.disaggregation.transfer.factory import make_engine

    torch.set_num_threads(1)
    try:
        engine = make_engine(backend)
        src, local = _pool(rows), _pool(rows)
        _fill_random(src)
        engine.register(src.data_ptr(), src.numel() * ITEMSIZE)
        peer = conn.recv()
        out = [_measure(backend, engine, peer, src, local, t, repeats, conn) for t in tokens]
        conn.send("exit")
        conn.recv()
        engine.close()
        results.put({"rows": out})
    except BaseException:
        results.put({"error": traceback.format_exc()})


def run_backend(backend: str, tokens: list[int], repeats: int) -> list[dict]:
    """Spawn the receiver and the writer for `backend`, return the writer's rows; both processes are gone after."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    writer_end, receiver_end = ctx.Pipe()
    rows = max(tokens) + ROW_MARGIN
    procs = [ctx.Process(target=_receiver, args=(backend, rows, receiver_end), daemon=True),
             ctx.Process(target=_writer, args=(backend, rows, tokens, repeats, writer_end, results), daemon=True)]
    for p in procs:
        p.start()
    try:
        out = results.get(timeout=REPLY_S)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    if "error" in out:
        raise RuntimeError(f"{backend} writer failed:\n{out['error']}")
    return out["rows"]


def _busy_s() -> float:
    """CPU seconds the whole machine has spent busy since boot (from /proc/stat)."""
    with open("/proc/stat") as f:
        fields = [float(v) for v in f.readline().split()[1:9]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    return sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
               for f in ("ru_utime", "ru_stime"))


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from e
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _backend_list(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    bad = [n for n in names if n not in ("mooncake", "nixl", "fake")]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"backends are mooncake, nixl, fake; got {text!r}")
    return names


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags of the mode `--mode` names (`ns.mode`); `--mode serve`'s are `bench.disagg_serve`'s."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--mode", choices=MODES, default="transfer")
    if pre.parse_known_args(argv)[0].mode == "serve":
        from bench.disagg_serve import parse_args as parse_serve_args

        return parse_serve_args(argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=MODES, default="transfer",
                   help="transfer: KV transfer throughput; serve: PD behind the router vs a unified server "
                        "(`--mode serve --help` for its flags)")
    p.add_argument("--backends", type=_backend_list, default=["mooncake", "nixl"], help="comma-separated")
    p.add_argument("--tokens", type=_int_list, default=None, help=f"request sizes (default {TOKENS})")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per size, median reported (at least 3)")
    p.add_argument("--quick", action="store_true", help=f"{QUICK_TOKENS} tokens, 1 run")
    p.add_argument("--json-out", default=None, help="write the rows to this file as JSON")
    ns = p.parse_args(argv)
    if ns.quick:
        ns.tokens, ns.repeats = ns.tokens or QUICK_TOKENS, 1
    elif ns.repeats < 3:
        p.error("--repeats must be at least 3 (a median of fewer says little); use --quick for a smoke run")
    ns.tokens = ns.tokens or TOKENS
    return ns


def main(argv: list[str] | None = None) -> dict:
    ns = parse_args(argv)
    if ns.mode == "serve":
        from bench.disagg_serve import main as serve_main

        return serve_main(ns)
    t0, busy0, own0 = time.perf_counter(), _busy_s(), _own_cpu_s()
    rows = [row for backend in ns.backends for row in run_backend(backend, ns.tokens, ns.repeats)]
    wall = (time.perf_counter() - t0) * (os.cpu_count() or 1)
    other = max(0.0, _busy_s() - busy0 - (_own_cpu_s() - own0)) / wall
    print(f"KV transfer of one request, SmolLM2-135M bf16 ({bytes_per_token()} B/token), median of {ns.repeats}")
    print(f"{'backend':>9} {'tokens':>7} {'MB':>8} {'runs':>5} {'write ms':>9} {'GB/s':>7} {'memcpy GB/s':>12} "
          f"{'vs memcpy':>10} {'verified':>9}")
    for r in rows:
        print(f"{r['backend']:>9} {r['tokens']:>7} {r['bytes'] / 1e6:>8.1f} {r['runs']:>5} {1e3 * r['write_s']:>9.2f} "
              f"{r['gbps']:>7.2f} {r['memcpy_gbps']:>12.2f} {100 * r['vs_memcpy']:>9.0f}% {str(r['verified']):>9}")
    print(f"other processes used {100 * other:.0f}% of the CPUs during the run")
    report = {"bench": "disagg_transfer", "bytes_per_token": bytes_per_token(), "repeats": ns.repeats,
              "other_cpu": round(other, 3), "rows": rows}
    if ns.json_out:
        with open(ns.json_out, "w") as f:
            json.dump(report, f, indent=1)
    failed = [f"{r['backend']} {r['tokens']}" for r in rows if r["verified"] is False]
    print(json.dumps({**report, "failed": failed}))  # the headline, last, as every benchmark prints it
    if failed:
        sys.exit(f"transferred bytes differ from the source: {', '.join(failed)}")
    return report


if __name__ == "__main__":
    main()
