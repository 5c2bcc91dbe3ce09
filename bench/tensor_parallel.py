"""Issue 17's speed check: TP=1 (one process, 2 threads) vs TP=2 (two rank processes, 1 thread each), one run.

    .venv/bin/python bench/tensor_parallel.py            # both models, decode at batch 1/16/64 and a prefill
    .venv/bin/python bench/tensor_parallel.py --quick    # the SmolLM2-shaped model, batch 1 and 64, fewer rounds

Three worker processes per model live at once (torch.multiprocessing spawn): the TP=1 process and the two TP=2
ranks (gloo on loopback, joined by `tokenloom.distributed.groups.init_distributed`). Each drives `ModelRunner`
directly (this does not use the server's TP wiring): hand-built decode batches over a KV pool filled with random
data, the decode position held fixed so every step reads the same context. They take turns, so one configuration
runs at a time: per round, TP=1 runs `--steps` steps, then TP=2 (both ranks, in lockstep); who goes first
alternates. Each turn starts after a pause (the idle side's libgomp threads stop spin-waiting) and one untimed
step. Per point: each configuration's median step, and the median over rounds of the within-round ratio TP2/TP1.

The native one-call decode step runs at TP=2 too (its C loop all-reduces through the shared-memory communicator)
where it applies (small decode batches); there the TP=1 process also times its modular path (`tp1_modular`, a
second runner on the same weights and KV memory with `--disable-native-decode`) for reference. The ratio is served
vs served; modular vs modular only if TP=2 could not run the native step (`tp2_native` false).

Cores: the TP=2 ranks are bound to a core each, as the server binds its ranks by default
(`TOKENLOOM_CPU_OMP_THREADS_BIND=nobind` runs them unbound); the TP=1 process keeps both cores.

Communication: the TP=2 ranks run a `ParallelContext` subclass that times `all_reduce` / `all_gather_last_dim`
and records every tensor through them (the library is not changed for this). On one host these go through the
shared-memory communicator (`ParallelContext.tp_comm`); `--gloo` runs TP=2 with every collective on gloo instead
(--disable-custom-all-reduce). At a native point the C loop's all-reduces are not seen by the subclass: only the
logits all-gather is recorded there. Per step: the time inside the
collectives on rank 0 (this includes waiting for the slower rank), the payload bytes (the sum of the tensors'
bytes each rank contributes), and in the same turn a bare gloo replay of the same list of collectives back to back
-> "collective time in the step / bare collectives of the same bytes". Since a rank's time in a collective
includes waiting for the other rank, the per-collective minimum over the two ranks, summed ("less the waiting"),
is reported beside it and compared with the bare replay too.

Models: SmolLM2-135M's shape (the default model) with dummy weights but its heads regrouped as 12 x 48 (kv 4 x 48)
instead of 9 x 64 (kv 3 x 64): 9 and 3 heads do not divide by 2, so the real checkpoint cannot be split in two;
the regrouping keeps every matrix, the FLOPs and the KV bytes identical. And a dummy ~1B Llama (hidden 2048,
16 layers, 32 heads, 8 kv heads, intermediate 5632, vocab 32000). bf16. The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field, fields
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from tokenloom.distributed.parallel_state import ParallelContext  # noqa: E402

SETTLE_S = 0.2  # pause before each turn: the previous side's OpenMP threads stop spinning
STEP_TARGET = 1.25  # TP=2 step within 1.25x of TP=1's at batch 64
BARE_TARGET = 2.0  # collective time in the step within 2x of the bare collectives of the same bytes
REPLY_TIMEOUT_S = 900.0
QUIET_SHARE = 0.10  # other processes' share of the CPUs under which the machine counts as quiet

MODELS: dict[str, dict[str, Any]] = {
    "smollm2-135m-shape": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=12,
                               num_key_value_heads=4, head_dim=48, vocab_size=49152, tie_word_embeddings=True,
                               rope_theta=100000.0),
    "dummy-1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=32000, tie_word_embeddings=False, rope_theta=10000.0),
}


# --------------------------------------------------------------------------------------------------------
# pure arithmetic (unit-tested in tests/unit/test_bench_tensor_parallel.py)


def tensor_nbytes(shape: tuple[int, ...], itemsize: int) -> int:
    n = 1
    for d in shape:
        n *= d
    return n * itemsize


def payload_bytes(records: list[tuple[str, tuple[int, ...], int]]) -> int:
    """Bytes each rank contributes to one step's collectives: the sum of the tensors' sizes. (A 2-rank ring
    all-reduce sends and receives this much per rank; an all-gather sends it and receives (tp-1) times it.)"""
    return sum(tensor_nbytes(shape, itemsize) for _, shape, itemsize in records)


def round_ratios(num: list[list[float]], den: list[list[float]]) -> list[float]:
    """Per round, median step of `num` over median step of `den` (the two sides of the same round)."""
    if len(num) != len(den):
        raise ValueError(f"{len(num)} rounds against {len(den)}")
    return [statistics.median(a) / statistics.median(b) for a, b in zip(num, den, strict=True)]


def paired_min_sum(rank0: list[float], rank1: list[float]) -> float:
    """One step's collectives without the waiting: per collective the shorter of the two ranks' times (the rank
    that arrives last hardly waits; its time is the transfer), summed. The rest of a rank's time inside the
    collectives is waiting for the other rank (their compute out of step: imbalance, or the scheduler's noise)."""
    if len(rank0) != len(rank1):
        raise ValueError(f"the ranks ran different collectives ({len(rank0)} vs {len(rank1)})")
    return sum(min(a, b) for a, b in zip(rank0, rank1, strict=True))


def flat_median(rounds: list[list[float]]) -> float:
    return statistics.median([x for r in rounds for x in r])


def projection(tp1_s: float, tp2_s: float, comm_s: float, cores_per_rank: tuple[int, ...] = (1, 2, 4, 8)
               ) -> dict[str, Any]:
    """What TP=2 would give with P cores per rank, from this box's measurement (P = 1: TP=1 on 2 threads, TP=2 on
    one thread per rank; `tp1_s`, `tp2_s` steps, `comm_s` the collectives inside the TP=2 step).

    Model: a step is compute + communication. `eff` = TP=2's compute (its step less its collectives) / TP=1's step,
    measured at the same cores per weight (one core per half vs two cores for the whole): 1.0 is perfect sharding.
    Assumed: compute scales as 1/cores (optimistic for memory-bound decode, so these are best cases) and the
    collectives cost what they cost here (the same bytes over the same transport: shared memory, or gloo with --gloo).
    - `same_total` (TP=2 on 2P cores vs TP=1 on the same 2P cores): eff + comm / T1(2P); P = 1 is the measured ratio.
    - `gain_per_rank_cores` (TP=2 on 2P cores vs TP=1 on P, i.e. a second rank's cores added): T1(P) / T2(2P)."""
    eff = (tp2_s - comm_s) / tp1_s
    out: dict[str, Any] = {"eff": eff, "same_total": {}, "gain_per_rank_cores": {}}
    for p in cores_per_rank:
        t1_total = tp1_s / p  # TP=1 on 2P cores (here 2 cores = P 1)
        out["same_total"][f"P={p}"] = eff + comm_s / t1_total
        t1_half = 2 * tp1_s / p  # TP=1 on P cores
        out["gain_per_rank_cores"][f"P={p}"] = t1_half / (eff * t1_total + comm_s)
    return out


# --------------------------------------------------------------------------------------------------------
# the timed parallel context (runs in the TP=2 ranks)


@dataclass
class CollectiveRecorder:
    seconds: float = 0.0
    per_call: list[float] = field(default_factory=list)
    records: list[tuple[str, tuple[int, ...], int]] = field(default_factory=list)
    dtypes: list[torch.dtype] = field(default_factory=list)

    def reset(self) -> None:
        self.seconds = 0.0
        self.per_call = []
        self.records = []
        self.dtypes = []

    def add(self, op: str, x: torch.Tensor, seconds: float) -> None:
        self.seconds += seconds
        self.per_call.append(seconds)
        self.records.append((op, tuple(x.shape), x.element_size()))
        self.dtypes.append(x.dtype)


@dataclass(frozen=True)
class TimedParallelContext(ParallelContext):
    """`ParallelContext` whose compute collectives are timed and recorded (the layers call these two methods)."""

    recorder: CollectiveRecorder = field(default_factory=CollectiveRecorder, compare=False)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        t = time.perf_counter()
        out = super().all_reduce(x)
        self.recorder.add("all_reduce", x, time.perf_counter() - t)
        return out

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        t = time.perf_counter()
        out = super().all_gather_last_dim(x)
        self.recorder.add("all_gather", x, time.perf_counter() - t)
        return out


class BareReplay:
    """The same collectives as one step, on preallocated tensors, back to back: gloo's floor for those bytes."""

    def __init__(self, recorder: CollectiveRecorder, ctx: ParallelContext) -> None:
        self.group = ctx.tp_group
        self.ops = []
        for (op, shape, _), dtype in zip(recorder.records, recorder.dtypes, strict=True):
            x = torch.randn(shape).to(dtype)
            parts = [torch.empty_like(x) for _ in range(ctx.tp_size)] if op == "all_gather" else None
            self.ops.append((op, x, parts))

    def run(self) -> float:
        t = time.perf_counter()
        for op, x, parts in self.ops:
            if op == "all_reduce":
                dist.all_reduce(x, group=self.group)
            else:
                dist.all_gather(parts, x, group=self.group)
        return time.perf_counter() - t


# --------------------------------------------------------------------------------------------------------
# workers


class _Driver:
    """One or two `ModelRunner`s over one KV memory: a fixed decode point (same position every step) or a prefill."""

    def __init__(self, folder: str, threads: int, parallel: ParallelContext, with_modular: bool,
                 max_tokens: int, max_requests: int) -> None:
        from tokenloom.config import ServerArgs
        from tokenloom.executor.model_runner import LoadedModel, ModelRunner

        common = dict(model_path=folder, load_format="dummy", max_total_tokens=max_tokens,
                      max_running_requests=max_requests, num_threads=threads)
        args = ServerArgs(**common)
        loaded = LoadedModel.load(args, parallel)
        served = ModelRunner(args, parallel, loaded=loaded)
        self.runners = {"served": served}
        if with_modular:
            self.runners["modular"] = ModelRunner(ServerArgs(**common, disable_native_decode=True), parallel,
                                                  loaded=loaded, memory=served.memory)
        torch.set_num_threads(threads)
        self.runner = served
        self.vocab = served.vocab_size
        self._gen = torch.Generator().manual_seed(0)
        self._filled = 1
        self._point: dict[str, Any] = {}

    def _reset(self) -> None:
        self.runner.token_allocator.clear()
        self.runner.req_to_token_pool.clear()

    def setup(self, kind: str, batch: int, length: int) -> bool:
        """Prepare a point; True when the served runner's native decode step applies to it."""
        from bench.common import _fill_random

        self._reset()
        runner = self.runner
        rows = runner.req_to_token_pool.alloc(batch)
        slots = runner.token_allocator.alloc(batch * (length + 1) if kind == "decode" else batch * length)
        if rows is None or slots is None:
            raise RuntimeError(f"KV pool too small for {kind} {batch} x {length}")
        rows_t = torch.tensor(rows, dtype=torch.int64)
        if kind == "decode":
            slots = slots.view(batch, length + 1)
            runner.req_to_token_pool.req_to_token[rows_t, :length] = slots[:, :length].to(torch.int32)
            hi = int(slots.max()) + 1
            if hi > self._filled:  # random KV data (untouched pages would all read the shared zero page)
                for buf in runner.kv_pool.k_buffers + runner.kv_pool.v_buffers:
                    for head in buf:
                        _fill_random(head[self._filled: hi])
                self._filled = hi
        self._point = dict(kind=kind, batch=batch, length=length, rows=rows_t, slots=slots)
        native = runner.native_decode
        if kind != "decode" or native is None:
            return False
        probe = self._batch()
        runner.prepare(probe)  # `applies` reads the attention metadata
        return bool(native.applies(probe))

    def _batch(self):
        from tokenloom.forward_batch import ForwardBatch, ForwardMode

        p = self._point
        batch, length = p["batch"], p["length"]
        if p["kind"] == "decode":
            ids = torch.randint(0, self.vocab, (batch,), generator=self._gen)
            seq_lens = torch.full((batch,), length + 1, dtype=torch.int64)
            return ForwardBatch.build(ForwardMode.DECODE, ids, p["rows"], seq_lens - 1, seq_lens,
                                      p["slots"][:, length].contiguous())
        ids = torch.randint(0, self.vocab, (batch * length,), generator=self._gen)
        return ForwardBatch.build(ForwardMode.EXTEND, ids, p["rows"], torch.zeros(batch, dtype=torch.int64),
                                  torch.full((batch,), length, dtype=torch.int64), p["slots"])

    def step(self, variant: str) -> None:
        # Built outside the runner's forward but inside the timed step, as the scheduler's step would.
        self.runners[variant].forward(self._batch())


def _worker(role: str, folder: str, max_tokens: int, max_requests: int, port: int,
            commands: mp.Queue, replies: mp.Queue, shared_memory: bool = True) -> None:
    """`role`: "tp1", "tp2-0" or "tp2-1". Answers each command on `replies` as (role, payload)."""
    try:
        ctx: ParallelContext
        if role == "tp1":
            from tokenloom.distributed.parallel_state import SINGLE_PROCESS

            ctx, threads = SINGLE_PROCESS, 2
        else:
            from tokenloom.distributed.cpu_binding import ENV, bind_this_process, rank_cores
            from tokenloom.distributed.groups import init_distributed

            # as the server's launcher does (TOKENLOOM_CPU_OMP_THREADS_BIND, default auto): a core per rank
            cores = rank_cores(os.environ.get(ENV), 2, sorted(os.sched_getaffinity(0)), num_threads=1)
            if cores is not None:
                bind_this_process(cores[int(role[-1])])
            base = init_distributed(2, 1, int(role[-1]), f"127.0.0.1:{port}", "cpu", shared_memory=shared_memory)
            ctx = TimedParallelContext(**{f.name: getattr(base, f.name) for f in fields(ParallelContext)})
            threads = 1
        driver = _Driver(folder, threads, ctx, role == "tp1", max_tokens, max_requests)
        replies.put((role, {"ready": True}))
        while True:
            cmd = commands.get()
            if cmd["op"] == "stop":
                break
            if cmd["op"] == "setup":
                native = driver.setup(cmd["kind"], cmd["batch"], cmd["length"])
                for _ in range(cmd["warmup"]):
                    driver.step("served")
                replies.put((role, {"native": native}))
                continue
            # "steps": one untimed step, then n timed; TP=2 also replays its collectives bare, n times
            variant = cmd.get("variant", "served")
            driver.step(variant)
            times, comm, per_call, nbytes = [], [], [], 0
            recorder = getattr(ctx, "recorder", None)
            for _ in range(cmd["n"]):
                if recorder is not None:
                    recorder.reset()
                t = time.perf_counter()
                driver.step(variant)
                times.append(time.perf_counter() - t)
                if recorder is not None:
                    comm.append(recorder.seconds)
                    per_call.append(recorder.per_call)
                    nbytes = payload_bytes(recorder.records)
            out: dict[str, Any] = {"times": times}
            if recorder is not None:
                replay = BareReplay(recorder, ctx)
                replay.run()  # untimed
                out.update(comm=comm, per_call=per_call, bytes=nbytes, calls=len(recorder.records),
                           bare=[replay.run() for _ in range(cmd["n"])])
            replies.put((role, out))
    except BaseException as e:  # the parent must hear of it, not wait forever
        replies.put((role, {"error": f"{type(e).__name__}: {e}"}))
        raise
    finally:
        if role != "tp1":
            from tokenloom.distributed.groups import destroy_distributed

            destroy_distributed()


# --------------------------------------------------------------------------------------------------------
# the parent


class _Workers:
    def __init__(self, folder: str, max_tokens: int, max_requests: int, shared_memory: bool = True) -> None:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = mp.get_context("spawn")
        self.replies = ctx.Queue()
        self.roles = ("tp1", "tp2-0", "tp2-1")
        self.commands = {r: ctx.Queue() for r in self.roles}
        self.procs = {r: ctx.Process(target=_worker, args=(r, folder, max_tokens, max_requests, port,
                                                           self.commands[r], self.replies, shared_memory),
                                 daemon=True)
                      for r in self.roles}
        for p in self.procs.values():
            p.start()
        self._gather(self.roles)

    def _gather(self, roles: tuple[str, ...]) -> dict[str, dict]:
        got: dict[str, dict] = {}
        while len(got) < len(roles):
            try:
                role, payload = self.replies.get(timeout=REPLY_TIMEOUT_S)
            except queue.Empty:
                raise RuntimeError(f"no reply from {sorted(set(roles) - set(got))}") from None
            if "error" in payload:
                raise RuntimeError(f"worker {role}: {payload['error']}")
            got[role] = payload
        return got

    def ask(self, roles: tuple[str, ...], cmd: dict) -> dict[str, dict]:
        for r in roles:
            self.commands[r].put(cmd)
        return self._gather(roles)

    def close(self) -> None:
        for r in self.roles:
            self.commands[r].put({"op": "stop"})
        for p in self.procs.values():
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


TP2 = ("tp2-0", "tp2-1")


class _Noise:
    """Share of the machine's CPU time used by processes other than this benchmark (parent and workers) between
    construction and `other_fraction()`: the colleagues' load on the shared box (0 = quiet)."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = [os.getpid(), *pids]
        self.start = self._snap()

    def _snap(self) -> tuple[float, float, float]:
        tick = os.sysconf("SC_CLK_TCK")
        with open("/proc/stat") as f:
            cpu = [float(x) for x in f.readline().split()[1:9]]
        busy = (sum(cpu) - cpu[3] - cpu[4]) / tick
        ours = 0.0
        for pid in self.pids:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    parts = f.read().rsplit(")", 1)[1].split()
                ours += (float(parts[11]) + float(parts[12])) / tick  # utime, stime
            except (OSError, IndexError, ValueError):
                pass
        return time.perf_counter(), busy, ours

    def other_fraction(self) -> float:
        (t0, b0, o0), (t1, b1, o1) = self.start, self._snap()
        wall = (t1 - t0) * (os.cpu_count() or 1)
        return max(0.0, (b1 - b0) - (o1 - o0)) / wall if wall > 0 else 0.0


def _measure_point(workers: _Workers, kind: str, batch: int, length: int, rounds: int, steps: int,
                   warmup: int) -> dict[str, Any]:
    noise = _Noise([p.pid for p in workers.procs.values() if p.pid is not None])
    setup = workers.ask(workers.roles, {"op": "setup", "kind": kind, "batch": batch, "length": length,
                                        "warmup": warmup})
    native, tp2_native = setup["tp1"]["native"], setup["tp2-0"]["native"]
    sides = ["tp1", "tp2"] + (["tp1_modular"] if native else [])
    times: dict[str, list[list[float]]] = {s: [] for s in sides}
    comm: list[list[float]] = []
    transfer: list[list[float]] = []
    bare: list[list[float]] = []
    nbytes = calls = 0
    for r in range(rounds):
        order = sides if r % 2 == 0 else sides[::-1]
        for side in order:
            time.sleep(SETTLE_S)
            if side == "tp2":
                got = workers.ask(TP2, {"op": "steps", "n": steps})
                rank0 = got["tp2-0"]
                times["tp2"].append(rank0["times"])
                comm.append(rank0["comm"])
                transfer.append([paired_min_sum(a, b) for a, b in
                                 zip(rank0["per_call"], got["tp2-1"]["per_call"], strict=True)])
                bare.append(rank0["bare"])
                nbytes, calls = rank0["bytes"], rank0["calls"]
            else:
                variant = "modular" if side == "tp1_modular" else "served"
                times[side].append(workers.ask(("tp1",), {"op": "steps", "n": steps, "variant": variant})
                                   ["tp1"]["times"])
    tp2_s, comm_s, bare_s = flat_median(times["tp2"]), flat_median(comm), flat_median(bare)
    tp1_fair = "tp1_modular" if native and not tp2_native else "tp1"
    out: dict[str, Any] = {
        "kind": kind, "batch": batch, "length": length, "tp1_native": native, "tp2_native": tp2_native,
        "step_ms": {s: flat_median(v) * 1e3 for s, v in times.items()},
        "ratio_tp2_over_tp1": statistics.median(round_ratios(times["tp2"], times["tp1"])),
        "ratio_tp2_over_tp1_modular": statistics.median(round_ratios(times["tp2"], times[tp1_fair])),
        "comm_ms": comm_s * 1e3, "comm_share": statistics.median(
            [statistics.median(c) / statistics.median(t) for c, t in zip(comm, times["tp2"], strict=True)]),
        "transfer_ms": flat_median(transfer) * 1e3,
        "transfer_over_bare": statistics.median(
            [statistics.median(c) / statistics.median(b) for c, b in zip(transfer, bare, strict=True)]),
        "bytes_per_step": nbytes, "collectives_per_step": calls, "bare_ms": bare_s * 1e3,
        "comm_over_bare": statistics.median(
            [statistics.median(c) / statistics.median(b) for c, b in zip(comm, bare, strict=True)]),
    }
    out["other_cpu_share"] = noise.other_fraction()
    out["projection"] = projection(flat_median(times[tp1_fair]), tp2_s, comm_s)
    return out


def _write_config(folder: str, spec: dict[str, Any]) -> None:
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", max_position_embeddings=2048,
               rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, hidden_act="silu", **spec)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)


def _print_point(model: str, p: dict[str, Any]) -> None:
    what = f"decode b={p['batch']} ctx={p['length']}" if p["kind"] == "decode" else \
        f"prefill {p['batch']}x{p['length']}"
    steps = "  ".join(f"{s} {v:7.2f}" for s, v in p["step_ms"].items())
    print(f"{model:20s} {what:22s} step ms: {steps}  | TP2/TP1 {p['ratio_tp2_over_tp1']:.3f} "
          f"(modular {p['ratio_tp2_over_tp1_modular']:.3f})  comm {p['comm_ms']:.2f} ms = "
          f"{100 * p['comm_share']:.1f}% of the step, {p['bytes_per_step'] / 1e6:.2f} MB in "
          f"{p['collectives_per_step']} collectives, bare {p['bare_ms']:.2f} ms (x{p['comm_over_bare']:.2f}; "
          f"less the waiting {p['transfer_ms']:.2f} ms, x{p['transfer_over_bare']:.2f})  "
          f"native at TP1: {p['tp1_native']}; others' CPU {100 * p['other_cpu_share']:.0f}%", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="SmolLM2 shape only, batch 1 and 64, fewer rounds")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None, help="timed steps per turn")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--gloo", action="store_true", help="TP=2 collectives on gloo (--disable-custom-all-reduce)")
    args = ap.parse_args()
    rounds = args.rounds or (4 if args.quick else 6)
    steps = args.steps or (4 if args.quick else 5)
    models = ["smollm2-135m-shape"] if args.quick else list(MODELS)
    batches = [1, 64] if args.quick else [1, 16, 64]
    prefill = None if args.quick else (4, 256)
    print(f"rounds {rounds}, steps per turn {steps}, context {args.context}, cores {os.cpu_count()}; "
          f"TP=1: 1 process x 2 threads, TP=2: 2 ranks x 1 thread "
          f"({'gloo, loopback' if args.gloo else 'shared-memory collectives'})", flush=True)
    results: dict[str, list[dict[str, Any]]] = {}
    for model in models:
        with tempfile.TemporaryDirectory(prefix="tl-tp-bench-") as folder:
            _write_config(folder, MODELS[model])
            max_requests = max(batches)
            workers = _Workers(folder, max_requests * (args.context + 1) + 1100, max_requests, not args.gloo)
            try:
                points = []
                for b in batches:
                    points.append(_measure_point(workers, "decode", b, args.context, rounds, steps, 2))
                    _print_point(model, points[-1])
                if prefill:
                    points.append(_measure_point(workers, "prefill", *prefill, max(2, rounds // 2),
                                                 max(2, steps // 3), 1))
                    _print_point(model, points[-1])
                results[model] = points
            finally:
                workers.close()
    head = summary(results)
    if not all(v.get("machine_quiet", True) for v in head.values() if isinstance(v, dict) and "machine_quiet" in v):
        print(f"WARNING: other processes took over {100 * QUIET_SHARE:.0f}% of the CPUs: TP=1's two threads suffer "
              f"more than the 1-thread ranks; rerun on a quiet machine before reading the step ratios", flush=True)
    print(json.dumps(head))


def summary(results: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Headline figures: batch-64 decode ratios, collective share and collective-vs-bare, and the targets."""
    head: dict[str, Any] = {"points": results}
    for model, points in results.items():
        b64 = next((p for p in points if p["kind"] == "decode" and p["batch"] == 64), None)
        if b64 is None:
            continue
        head[model] = {
            "b64_ratio_tp2_over_tp1": b64["ratio_tp2_over_tp1"],
            "b64_ratio_tp2_over_tp1_modular": b64["ratio_tp2_over_tp1_modular"],
            "b64_comm_share": b64["comm_share"], "b64_comm_over_bare": b64["comm_over_bare"],
            "b64_transfer_over_bare": b64["transfer_over_bare"],
            "b64_other_cpu_share": b64["other_cpu_share"],
            # Other processes' load hurts TP=1's two OpenMP threads far more than two 1-thread ranks: the step
            # verdict means something only on a quiet machine.
            "machine_quiet": max(p["other_cpu_share"] for p in points) < QUIET_SHARE,
            "target_step_met": b64["ratio_tp2_over_tp1"] <= STEP_TARGET,
            "target_step_met_modular": b64["ratio_tp2_over_tp1_modular"] <= STEP_TARGET,
            "comm_over_bare_max": max(p["comm_over_bare"] for p in points),
            "target_comm_vs_bare_met": all(p["comm_over_bare"] <= BARE_TARGET for p in points),
        }
    return head


if __name__ == "__main__":
    main()
