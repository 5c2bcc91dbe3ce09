"""Forward-pass benchmark: tokenloom's `ModelRunner` vs transformers on the same model, in one run.

Measures, side by side and interleaved step by step:

* decode-step time for a grid of batch sizes x context lengths (tokenloom: `ModelRunner.forward` on a
  `ForwardBatch` built directly, request rows and KV slots filled without a prefill; transformers: one-token
  forwards on a `DynamicCache` pre-filled to the same context),
* prefill throughput (e.g. 8 x 256 and 1 x 1024 tokens),
* tokenloom in float32 vs bfloat16 at batch 1 and 64,
* tokenloom's one-call native decode step vs its modular model at batch 1..64 with AMX, 1..8 without (same
  runner, steps alternating; the server uses the native step up to `NativeDecode.max_batch`),
* the machine's roofline in the same process: bf16/fp32 GFLOP/s of a large matmul and memory bandwidth,
  best-of at the start of the run, and again at every decode point from probes run between its steps (a
  2048^3 and a 4096^3 matmul, and a read of the step's bytes, or of the weights' at batch 1), so each step is compared
  with the machine as it was in the same round (bench/roofline_probes.py).

KV contents do not change the timing, but untouched (calloc'ed) pages would: reads of never-written memory
all hit the kernel's shared zero page and stay in cache. Every KV slot a point reads is therefore written
with random data first, for both engines.

Usage:
    python bench/forward.py --quick          # ~1-2 minutes: batch 1 and 64 at context 256
    python bench/forward.py                  # full grid (several minutes)
    python bench/forward.py --skip-transformers --batch-sizes 1,64 --context-lens 256,1024

The last line of stdout is one JSON object with the headline figures.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import CpuMonitor, ModelShape, _cpu_name, measure_roofline
from bench.forward_engines import HFEngine, TokenloomEngine
from bench.roofline_probes import MatmulProbe, ReadProbe, median_or_nan, round_fractions, timed_rounds, vs_read
from tokenloom.config import ServerArgs
from tokenloom.models.loader import resolve_model_source

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
GB = 1e9


# --------------------------------------------------------------------------------------------------------
# helpers


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _fmt(x: float | None, spec: str = ".1f", width: int = 8) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return f"{'-':>{width}}"
    return f"{x:>{width}{spec}}"


def _log(msg: str) -> None:
    print(msg, flush=True)


# --------------------------------------------------------------------------------------------------------
# timing


def _timed(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run_interleaved(engines: dict[str, Callable[[], None]], warmup: int, steps: int, min_steps: int,
                    budget_s: float) -> dict[str, list[float]]:
    """Warm every engine up, then alternate single timed steps between them (ABAB...), so drift in the
    machine's speed hits all engines alike. The step count shrinks (down to `min_steps`) when one round of
    all engines would blow `budget_s`."""
    last: dict[str, float] = {}
    for name, fn in engines.items():
        for _ in range(warmup):
            last[name] = _timed(fn)
    round_s = sum(last.values()) or 1e-9
    n = max(min_steps, min(steps, int(budget_s / round_s)))
    times: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(n):
        for name, fn in engines.items():
            times[name].append(_timed(fn))
    return times


@dataclass
class DecodePoint:
    batch: int
    context: int
    tl: list[float] = field(default_factory=list)
    hf: list[float] = field(default_factory=list)
    note: str = ""
    # the roofline probes run between this point's steps: round_fractions() (bench/roofline_probes.py), plus
    # "vs_bound" at batch 1
    at_point: dict[str, float | list[float]] = field(default_factory=dict)

    @property
    def tl_ms(self) -> float:
        return median_or_nan(self.tl) * 1e3

    @property
    def hf_ms(self) -> float:
        return median_or_nan(self.hf) * 1e3

    @property
    def tl_min_ms(self) -> float:
        return min(self.tl) * 1e3 if self.tl else float("nan")

    @property
    def hf_min_ms(self) -> float:
        return min(self.hf) * 1e3 if self.hf else float("nan")


# --------------------------------------------------------------------------------------------------------
# main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="reduced run (~1-2 min): batch 1,64 at context 256")
    p.add_argument("--batch-sizes", type=_ints, default=None, help="comma list (default 1,8,64,256)")
    p.add_argument("--context-lens", type=_ints, default=None, help="comma list (default 256,1024,2048)")
    p.add_argument("--steps", type=int, default=None, help="timed decode steps/point (default 10; quick 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed decode steps per point and engine")
    p.add_argument("--point-budget", type=float, default=20.0,
                   help="seconds of timed decode per point; fewer steps (min 3) for slow points")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="bfloat16")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (both engines)")
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--skip-dtype-compare", action="store_true", help="skip tokenloom fp32 vs bf16")
    p.add_argument("--skip-native-compare", action="store_true",
                   help="skip the native decode step vs the modular model at batch 1/2/4/8 (16/32/64 with AMX)")
    p.add_argument("--prefill", default=None,
                   help="prefill shapes as BxL comma list (default 8x256,1x1024; quick 8x256)")
    p.add_argument("--prefill-reps", type=int, default=None, help="timed prefill reps (default 3; quick 2)")
    p.add_argument("--hf-max-kv-gb", type=float, default=8.0,
                   help="skip transformers at points whose KV cache exceeds this")
    p.add_argument("--max-kv-gb", type=float, default=13.0,
                   help="skip a point entirely when tokenloom's KV for it exceeds this")
    p.add_argument("--profile", action="store_true",
                   help="also print torch.profiler op tables for tokenloom decode at batch 1 and 64, ctx 256")
    args = p.parse_args(argv)
    args.batch_sizes = args.batch_sizes or ([1, 64] if args.quick else [1, 8, 64, 256])
    args.context_lens = args.context_lens or ([256] if args.quick else [256, 1024, 2048])
    args.steps = args.steps or (5 if args.quick else 10)
    args.prefill_reps = args.prefill_reps or (2 if args.quick else 3)
    prefill = args.prefill or ("8x256" if args.quick else "8x256,1x1024")
    args.prefill_shapes = [tuple(int(v) for v in s.lower().split("x")) for s in prefill.split(",") if s]
    if args.quick:
        args.point_budget = min(args.point_budget, 8.0)
    return args


def _profile_tokenloom(engine: TokenloomEngine, batch: int, context: int, steps: int) -> None:
    """Op table over `steps` decode steps (the engine's pool must hold context + steps + 2 per request)."""
    from torch.profiler import ProfilerActivity, profile

    engine.setup_decode(batch, context, steps + 2)
    engine.decode_step()
    engine.decode_step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.decode_step()
    engine.teardown()
    _log(f"\n## torch.profiler: tokenloom decode, batch {batch}, context {context}, {steps} steps "
         f"(times are totals over the steps)")
    _log(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=40))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dtype = _DTYPES[args.dtype]
    elem = torch.tensor([], dtype=dtype).element_size()
    t_start = time.perf_counter()
    monitor = CpuMonitor()

    _log(f"# tokenloom forward benchmark  (torch {torch.__version__}, {args.threads} threads, "
         f"dtype {args.dtype}, cpu: {_cpu_name()})")

    # Roofline first, on a quiet process.
    roof = measure_roofline(args.quick)
    _log(f"roofline: bf16 matmul {roof['bf16_gflops']:.0f} GFLOP/s ({roof['bf16_detail']}), fp32 matmul "
         f"{roof['fp32_gflops']:.0f} GFLOP/s ({roof['fp32_detail']}); memory: read {roof['read_gbps']:.1f} "
         f"GB/s (sum over 1 GB), copy {roof['copy_gbps']:.1f} GB/s (read+write)")
    mem_gbps = roof["read_gbps"]
    peak_gflops = roof["fp32_gflops"] if dtype == torch.float32 else roof["bf16_gflops"]
    peak_name = "fp32" if dtype == torch.float32 else "bf16"

    # Which decode points run, for whom.
    extra = max(args.warmup, 2) + args.steps + 2
    points: list[DecodePoint] = []
    hf_budget = args.hf_max_kv_gb * GB
    tl_budget = args.max_kv_gb * GB

    # tokenloom engine sized to the largest point it runs (pages are only touched per point, smallest first).
    cfg = resolve_model_source(ServerArgs()).config
    shape = ModelShape.from_config(cfg)
    for b in sorted(args.batch_sizes):
        for c in sorted(args.context_lens):
            pt = DecodePoint(b, c)
            if shape.kv_bytes(b, c, elem) > tl_budget:
                pt.note = f"skipped: KV {shape.kv_bytes(b, c, elem) / GB:.1f} GB > --max-kv-gb"
            points.append(pt)
    runnable = [p for p in points if not p.note]
    pool_tokens = max([p.batch * (p.context + extra) for p in runnable]
                      + [b * n for b, n in args.prefill_shapes] + [64 * (256 + 2 * extra)]) + 64
    max_reqs = max([p.batch for p in runnable] + [b for b, _ in args.prefill_shapes] + [64])

    t0 = time.perf_counter()
    tl = TokenloomEngine(args.dtype, pool_tokens, max_reqs, args.threads)
    _log(f"tokenloom: loaded in {time.perf_counter() - t0:.1f} s; KV pool {pool_tokens} tokens "
         f"({tl.runner.kv_pool.nbytes() / GB:.2f} GB reserved, touched per point), {max_reqs} request rows")
    hf: HFEngine | None = None
    if not args.skip_transformers:
        t0 = time.perf_counter()
        hf = HFEngine(dtype, args.threads)
        _log(f"transformers: loaded in {time.perf_counter() - t0:.1f} s ({hf.describe})")
    torch.set_num_threads(args.threads)

    results: dict[str, float | None] = {k: roof[k] for k in ("bf16_gflops", "fp32_gflops")}
    results["mem_gbps"] = mem_gbps
    results["copy_gbps"] = roof["copy_gbps"]

    # ---- fp32 vs bf16 (tokenloom only) ----------------------------------------------------------------
    if not args.skip_dtype_compare:
        other = "float32" if args.dtype != "float32" else "bfloat16"
        t0 = time.perf_counter()
        tl_other = TokenloomEngine(other, 64 * (256 + extra) + 64, 64, args.threads)
        _log(f"\n## tokenloom {args.dtype} vs {other} (context 256; other loaded in "
             f"{time.perf_counter() - t0:.1f} s)")
        _log(f"{'batch':>5} {args.dtype + ' ms':>14} {'(min)':>8} {other + ' ms':>14} {'(min)':>8} "
             f"{args.dtype + ' speedup':>17}")
        for b in (1, 64):
            tl.setup_decode(b, 256, extra)
            tl_other.setup_decode(b, 256, extra)
            times = run_interleaved({"main": tl.decode_step, "other": tl_other.decode_step}, args.warmup,
                                    args.steps, 3, args.point_budget)
            tl.teardown()
            tl_other.teardown()
            main_ms, other_ms = median_or_nan(times["main"]) * 1e3, median_or_nan(times["other"]) * 1e3
            _log(f"{b:>5} {main_ms:>14.2f} {min(times['main']) * 1e3:>8.2f} {other_ms:>14.2f} "
                 f"{min(times['other']) * 1e3:>8.2f} {other_ms / main_ms:>16.2f}x")
            results[f"dtype_b{b}_{args.dtype}_ms"] = main_ms
            results[f"dtype_b{b}_{other}_ms"] = other_ms
        del tl_other
        gc.collect()

    # ---- native decode step vs the modular model (tokenloom only) ---------------------------------------
    native = tl.runner.native_decode
    if not args.skip_native_compare and native is not None:
        _log("\n## native decode step vs modular model (context 256, same runner; native used up to batch "
             f"{native.max_batch} by default)")
        _log(f"{'batch':>5} {'native ms':>10} {'(min)':>8} {'modular ms':>11} {'(min)':>8} {'speedup':>8}")
        default_max = native.max_batch

        def modular_step() -> None:
            tl.runner.native_decode = None
            try:
                tl.decode_step()
            finally:
                tl.runner.native_decode = native

        batches = (1, 2, 4, 8, 16, 32, 64) if native.uses_amx else (1, 2, 4, 8)
        native.max_batch = batches[-1]
        try:
            for b in batches:
                tl.setup_decode(b, 256, 2 * extra)
                times = run_interleaved({"native": tl.decode_step, "modular": modular_step}, args.warmup,
                                        args.steps, 3, args.point_budget)
                tl.teardown()
                nat_ms, mod_ms = median_or_nan(times["native"]) * 1e3, median_or_nan(times["modular"]) * 1e3
                _log(f"{b:>5} {nat_ms:>10.2f} {min(times['native']) * 1e3:>8.2f} {mod_ms:>11.2f} "
                     f"{min(times['modular']) * 1e3:>8.2f} {mod_ms / nat_ms:>7.2f}x")
                results[f"native_b{b}_ms"], results[f"modular_b{b}_ms"] = nat_ms, mod_ms
        finally:
            native.max_batch = default_max

    # ---- prefill ----------------------------------------------------------------------------------------
    _log("\n## prefill (median of reps after 1 warmup; transformers with logits_to_keep=1)")
    _log(f"{'shape':>9} {'TL ms':>9} {'TL tok/s':>9} {'TL GF/s':>8} {'HF ms':>9} {'HF tok/s':>9} "
         f"{'TL/HF':>6}")
    for b, n in args.prefill_shapes:
        engines: dict[str, Callable[[], None]] = {"tl": lambda b=b, n=n: tl.prefill(b, n)}
        if hf is not None:
            engines["hf"] = lambda b=b, n=n: hf.prefill(b, n)
        times = run_interleaved(engines, 1, args.prefill_reps, args.prefill_reps, 1e9)
        tl_s = median_or_nan(times["tl"])
        hf_s = median_or_nan(times["hf"]) if hf is not None else float("nan")
        tokens = b * n
        gfs = shape.prefill_flops(b, n) / tl_s / 1e9
        _log(f"{f'{b}x{n}':>9} {tl_s * 1e3:>9.1f} {tokens / tl_s:>9.0f} {gfs:>8.0f} "
             f"{_fmt(hf_s * 1e3, '.1f', 9)} {_fmt(tokens / hf_s, '.0f', 9)} {_fmt(hf_s / tl_s, '.2f', 6)}")
        results[f"prefill_{b}x{n}_tok_s"] = tokens / tl_s
        results[f"prefill_{b}x{n}_hf_tok_s"] = tokens / hf_s if hf is not None else None

    # ---- decode grid ------------------------------------------------------------------------------------
    _log(f"\n## decode (ms/step = median over timed steps after {args.warmup} warmup; steps alternate "
         f"tokenloom / matmul probe / read probe / transformers)")
    reader, matmul_probe = ReadProbe(), MatmulProbe(dtype)
    for pt in points:
        if pt.note:
            _log(f"  b={pt.batch} ctx={pt.context}: {pt.note}")
            continue
        hf_here = hf is not None and shape.kv_bytes(pt.batch, pt.context, elem) <= hf_budget
        if hf is not None and not hf_here:
            kv_gb = shape.kv_bytes(pt.batch, pt.context, elem) / GB
            pt.note = f"HF skipped: KV {kv_gb:.1f} GB > --hf-max-kv-gb"
        t0 = time.perf_counter()
        tl.setup_decode(pt.batch, pt.context, extra)
        # batch 1: the weight-bandwidth bound's read (weights only); otherwise everything the step reads
        step_bytes = shape.streamed_params * elem + shape.kv_bytes(pt.batch, pt.context, elem)
        read_bytes = reader.clipped(shape.streamed_params * 2 if pt.batch == 1 else step_bytes)
        # each round: tokenloom's step, then the probes (the machine as it was for that step), then transformers
        engines = {"tl": tl.decode_step, "matmul": matmul_probe, "read": lambda n=read_bytes: reader.read(n)}
        if hf_here:
            hf.setup_decode(pt.batch, pt.context)
            engines["hf"] = hf.decode_step
        setup_s = time.perf_counter() - t0
        calls_before = len(matmul_probe.rates), len(reader.rates)
        times = run_interleaved(engines, args.warmup, args.steps, 3, args.point_budget)
        rounds = len(times["tl"])
        peaks = timed_rounds(matmul_probe.rates, calls_before[0], args.warmup, rounds)
        bandwidths = timed_rounds(reader.rates, calls_before[1], args.warmup, rounds)
        pt.at_point = round_fractions(times["tl"], peaks, bandwidths, shape.decode_flops(pt.batch, pt.context),
                                      step_bytes)
        if pt.batch == 1:
            pt.at_point["vs_bound"] = vs_read(times["tl"], bandwidths, shape.streamed_params * 2)
        pt.tl = times["tl"]
        pt.hf = times.get("hf", [])
        tl.teardown()
        if hf_here:
            hf.teardown()
        _log(f"  b={pt.batch:<4} ctx={pt.context:<5} TL median {pt.tl_ms:8.2f} min {pt.tl_min_ms:8.2f} ms | "
             f"HF median {_fmt(pt.hf_ms, '.2f')} min {_fmt(pt.hf_min_ms, '.2f')} ms  ({len(pt.tl)} steps, "
             f"setup {setup_s:.1f} s) {pt.note}")

    # ---- table ------------------------------------------------------------------------------------------
    weight_bytes_bf16 = shape.streamed_params * 2
    weight_bytes_run = shape.streamed_params * elem
    bw_bound_ms = weight_bytes_bf16 / (mem_gbps * GB) * 1e3
    _log(f"\n## decode summary ({args.dtype}); roofline: {peak_name} matmul {peak_gflops:.0f} GFLOP/s, "
         f"read bandwidth {mem_gbps:.1f} GB/s")
    _log(f"   model: {shape.matmul_params / 1e6:.1f} M matmul params ({shape.decode_flops(1, 0) / 1e6:.0f} "
         f"MFLOP/token + attention), bf16 weights {weight_bytes_bf16 / 1e6:.0f} MB -> weight-bandwidth "
         f"bound {bw_bound_ms:.2f} ms/step")
    _log("   TL/HF = tokenloom tok/s over transformers tok/s; %roof = achieved FLOP/s over the matmul peak; "
         "floor = max(FLOPs / matmul peak, (weights + KV read) / read bandwidth), the roofline model's best "
         "time for the step (floor / TL ms = the fraction of that roofline reached); bw-bound (batch 1) = "
         "bf16 weights / read bandwidth")
    header = (f"{'batch':>5} {'ctx':>5} | {'TL ms':>8} {'TL min':>8} {'TL tok/s':>9} {'GFLOP/s':>8} "
              f"{'%roof':>6} | {'HF ms':>8} {'HF tok/s':>9} | {'TL/HF':>6} | {'floor':>7} {'TL/floor':>8} | "
              f"{'bw-bound':>8} {'TL/bound':>8}")
    _log(header)
    _log("-" * len(header))
    for pt in points:
        if not pt.tl:
            _log(f"{pt.batch:>5} {pt.context:>5} | {pt.note}")
            continue
        tl_s = pt.tl_ms / 1e3
        gfs = shape.decode_flops(pt.batch, pt.context) / tl_s / 1e9
        frac = gfs / peak_gflops
        hf_ms = pt.hf_ms if pt.hf else float("nan")
        ratio = hf_ms / pt.tl_ms if pt.hf else float("nan")
        bound = bw_bound_ms if pt.batch == 1 else float("nan")
        floor_ms = 1e3 * max(shape.decode_flops(pt.batch, pt.context) / (peak_gflops * 1e9),
                             (weight_bytes_run + shape.kv_bytes(pt.batch, pt.context, elem)) / (mem_gbps * GB))
        _log(f"{pt.batch:>5} {pt.context:>5} | {pt.tl_ms:>8.2f} {pt.tl_min_ms:>8.2f} {pt.batch / tl_s:>9.0f} "
             f"{gfs:>8.0f} {frac * 100:>5.1f}% | {_fmt(hf_ms, '.2f')} {_fmt(pt.batch / (hf_ms / 1e3), '.0f', 9)} | "
             f"{_fmt(ratio, '.2f', 6)} | {floor_ms:>7.1f} {pt.tl_ms / floor_ms:>8.2f} | "
             f"{_fmt(bound, '.2f')} {_fmt(pt.tl_ms / bound, '.2f')}" + (f"   ({pt.note})" if pt.note else ""))
        key = f"decode_b{pt.batch}_ctx{pt.context}"
        results[f"{key}_ms"] = pt.tl_ms
        results[f"{key}_min_ms"] = pt.tl_min_ms
        results[f"{key}_tok_s"] = pt.batch / tl_s
        results[f"{key}_hf_ms"] = hf_ms if pt.hf else None
        results[f"{key}_ratio_vs_hf"] = ratio if pt.hf else None
        results[f"{key}_roofline_frac"] = frac
        results[f"{key}_floor_ms"] = floor_ms
        results[f"{key}_roofline_model_frac"] = floor_ms / pt.tl_ms

    # ---- the same, against the probes run between each point's steps -----------------------------------
    _log(f"\n## decode vs the roofline at the point ({peak_name}; probes between the steps, see "
         "bench/roofline_probes.py; every figure a median over rounds, fractions of values from one round)")
    _log("   peak = the faster of a 2048^3 and a 4096^3 matmul; read = the step's weights + KV (batch 1: the "
         "weights), clipped to 1 GiB; "
         "%peak = achieved FLOP/s over peak; floor = max(FLOPs / peak, step bytes / read bandwidth); "
         "roof = floor / TL ms; TL/bound (batch 1) = step time over bf16 weights / read bandwidth")
    header = (f"{'batch':>5} {'ctx':>5} | {'TL ms':>8} | {'peak GF/s':>9} {'read GB/s':>9} | {'%peak':>6} | "
              f"{'floor ms':>8} {'roof':>6} | {'TL/bound':>8}")
    _log(header)
    _log("-" * len(header))
    for pt in points:
        if not pt.tl:
            continue
        at = pt.at_point
        vs_bound = at.get("vs_bound", float("nan"))
        _log(f"{pt.batch:>5} {pt.context:>5} | {pt.tl_ms:>8.2f} | {at['peak_gflops']:>9.0f} {at['read_gbps']:>9.1f} | "
             f"{at['peak_frac'] * 100:>5.1f}% | {at['floor_ms']:>8.1f} {at['roofline_model_frac'] * 100:>5.1f}% | "
             f"{_fmt(vs_bound, '.2f')}")
        key = f"decode_b{pt.batch}_ctx{pt.context}"
        results[f"{key}_peak_gflops_interleaved"] = at["peak_gflops"]
        results[f"{key}_read_gbps_interleaved"] = at["read_gbps"]
        results[f"{key}_peak_frac_interleaved"] = at["peak_frac"]
        results[f"{key}_roofline_model_frac_interleaved"] = at["roofline_model_frac"]
        if pt.batch == 1:
            results[f"{key}_vs_bound_interleaved"] = vs_bound

    if args.profile:
        for b in (1, 64):
            if b <= max_reqs and b * (256 + extra) <= pool_tokens:
                _profile_tokenloom(tl, b, 256, args.steps)

    # ---- headline JSON ----------------------------------------------------------------------------------
    ctx0 = 256 if 256 in args.context_lens else min(args.context_lens)

    def pick(key: str) -> float | None:
        v = results.get(key)
        return None if v is None or (isinstance(v, float) and math.isnan(v)) else round(v, 4)

    b1 = results.get(f"decode_b1_ctx{ctx0}_ms")
    headline = {
        f"decode_b64_ctx{ctx0}_tok_s": pick(f"decode_b64_ctx{ctx0}_tok_s"),
        "decode_b64_ratio_vs_hf": pick(f"decode_b64_ctx{ctx0}_ratio_vs_hf"),
        "decode_b64_roofline_frac": pick(f"decode_b64_ctx{ctx0}_roofline_frac"),
        "decode_b64_floor_ms": pick(f"decode_b64_ctx{ctx0}_floor_ms"),
        "decode_b64_roofline_model_frac": pick(f"decode_b64_ctx{ctx0}_roofline_model_frac"),
        "decode_b64_peak_gflops_interleaved": pick(f"decode_b64_ctx{ctx0}_peak_gflops_interleaved"),
        "decode_b64_read_gbps_interleaved": pick(f"decode_b64_ctx{ctx0}_read_gbps_interleaved"),
        "decode_b64_peak_frac_interleaved": pick(f"decode_b64_ctx{ctx0}_peak_frac_interleaved"),
        "decode_b64_roofline_model_frac_interleaved": pick(f"decode_b64_ctx{ctx0}_roofline_model_frac_interleaved"),
        "decode_b64_ms": pick(f"decode_b64_ctx{ctx0}_ms"),
        "decode_b64_min_ms": pick(f"decode_b64_ctx{ctx0}_min_ms"),
        "decode_b1_ms": pick(f"decode_b1_ctx{ctx0}_ms"),
        "decode_b1_min_ms": pick(f"decode_b1_ctx{ctx0}_min_ms"),
        "decode_b1_hf_ms": pick(f"decode_b1_ctx{ctx0}_hf_ms"),
        "decode_b1_bw_bound_ms": round(bw_bound_ms, 4),
        "decode_b1_vs_bw_bound": round(b1 / bw_bound_ms, 4) if b1 else None,
        "decode_b1_read_gbps_interleaved": pick(f"decode_b1_ctx{ctx0}_read_gbps_interleaved"),
        "decode_b1_vs_bw_bound_interleaved": pick(f"decode_b1_ctx{ctx0}_vs_bound_interleaved"),
        "bf16_gflops": pick("bf16_gflops"),
        "fp32_gflops": pick("fp32_gflops"),
        "mem_gbps": pick("mem_gbps"),
        "copy_gbps": pick("copy_gbps"),
        "context": ctx0,
        "dtype": args.dtype,
        "threads": args.threads,
    }
    for k in results:
        if (k.startswith("prefill_") or k.startswith("dtype_")) and k not in headline:
            headline[k] = pick(k)
    for pt in points:
        if pt.tl and not (pt.context == ctx0 and pt.batch in (1, 64)):
            key = f"decode_b{pt.batch}_ctx{pt.context}"
            headline[f"{key}_ms"] = pick(f"{key}_ms")
            headline[f"{key}_ratio_vs_hf"] = pick(f"{key}_ratio_vs_hf")
    other = monitor.other_fraction()
    headline["other_cpu_frac"] = round(other, 3)
    headline["wall_s"] = round(time.perf_counter() - t_start, 1)
    if other > 0.05:
        _log(f"\nWARNING: other processes used {other * 100:.0f}% of the machine's CPU time during this run "
             f"(load average now {os.getloadavg()[0]:.1f}); with {args.threads} threads on "
             f"{os.cpu_count()} cores the timings are inflated and noisy. Rerun on a quiet machine.")
    else:
        _log(f"\nmachine was quiet: other processes used {other * 100:.1f}% of the CPU time")
    print(json.dumps(headline), flush=True)


if __name__ == "__main__":
    main()
