"""A discrete-event model of tokenloom's pipeline-parallel event loop (issue 18) and its two send optimizations.

    .venv/bin/python bench/pp_sim.py --scenario seed      # the PP4 x TP8 shape below, points on/off, depth 0, 1
    .venv/bin/python bench/pp_sim.py --sweep [--quick]    # ON vs OFF over link latency x last-stage imbalance
    .venv/bin/python bench/pp_sim.py --validate FILE      # predicted vs measured for bench/pipeline.py's runs
    .venv/bin/python bench/pp_sim.py --calibrate          # re-derive that shape's forward-time scale (~4 min)
    add --json to print every mode's figures as one JSON object on the last line; --quick: 256 requests.

The two optimizations (pipeline_loop.py; TOKENLOOM_PP_EARLY_OUTPUT_SEND, TOKENLOOM_PP_OVERLAP_SENDS): point 1,
the early output send: the last stage's output is sent to stage 0 as soon as its forward ends, not after the
stage has processed the previous result; point 2, overlapped sends: each send is posted right behind the step
that produced it and nobody waits for it, so sends and the next receives overlap compute. `--scenario seed`
(the name is kept for existing command lines) models a large deployment: PP4 over 4 nodes of 8 H200 each
(TP8 per stage), Qwen3-235B-A22B-shaped stages, 1024 requests of ~4096 input and ~1536 output tokens all sent
at t=0; its forward-time scale is calibrated to a reported throughput of that shape (see `SEED_TARGET_REQ_S`).

What is modelled (`PipelineSim`): pp stages, each a CPU thread plus a forward thread, running the loop of
tokenloom/scheduler/pipeline_loop.py with L = pp + depth lanes. Each stage's loop is a generator on one event
heap (it yields a time to sleep to, or an event to wait for); each step on a forward thread is a process of its
own, run in submission order, whose event fires when the step's callable returns. Iteration t on stage s,
lane mb = t % L:
 1. stage 0 reads its inbox and decides lane mb's batch (the decision is shared: every stage schedules the
    same); other stages receive the request list from s-1; non-last stages send it on (a 0-byte message);
 2. scheduling costs `sched_s` of CPU on every stage;
 3. last stage, depth > 0: wait for the step launched at t - depth, send its output to stage 0;
 4. non-first stage with a batch: blocking receive of the proxy (2 * hidden * tokens * 2 bytes) from s-1;
 5. the step is submitted to the stage's forward thread (FIFO; it starts when the thread is free);
 6. last stage, depth 0: point 1 ON ("early_output_send"): the forward thread posts the output send right
    behind the forward and the CPU goes on (pipeline_loop.py's executor-side send, as a CUDA isend on the
    forward stream); `early_send_blocking=True` makes the CPU wait for the forward and post it instead. OFF:
    the CPU posts it after step 7, waiting for the step first if it is still running;
 7. lane (t+1) % L's result (launched at t+1-L): stage 0 receives it from the last stage, middle stages from
    s-1 and forward it unless s+1 is the last, the last stage waits for its own step; `process_s` of CPU;
    stage 0 then applies it (token times are stamped here: this is where tokens stream out);
 8. non-last stage with a batch: the CPU waits for the step, then sends the proxy to s+1
    (`stream_ordered_proxy=True`: the forward thread posts it behind the forward, as step 6's ON does).
Output messages exist only for lanes that launched a batch; stage 0 sleeps to the next arrival when idle.
Messages: a send costs the sender `msg_cpu_s`, waits until the previous send on its channel (src, dst, kind)
was received (one in flight per channel), then occupies the directed link src->dst for bytes / bandwidth
(FIFO across the link's channels) and arrives `latency` later. A send is complete when the receiver has taken
it (max of arrival and the receive being posted); a receive returns then, plus `msg_cpu_s`. A forward thread's
send holds that thread (its next step waits) for the channel's previous message, as PPChannel.isend does.
Point 2 OFF ("grouped_sends" False): at the end of each iteration a stage's CPU waits until every send it
posted in that iteration is complete, and a forward thread waits for each send it posted to complete before
its step returns, so sends serialize with the receivers' next receives; ON: no such waits. Point 1 only
exists at depth 0; point 2 OFF applies at every depth, as in pipeline_loop.py (`overlap_sends` off).
`loop_forms` gives pipeline_loop.py's forms (what --validate simulates): point 1 non-blocking, and the proxy
posted by the forward thread exactly when point 2 is ON (with it OFF the loop's CPU waits and posts it).

Batching (bench/pp_batcher.py's `Batcher`, identical on every stage): FIFO waiting queue; a lane prefills when
it holds a chunked request or a waiting request fits (lane cap `max_running_requests // pp`, global cap
`max_running_requests`), filling up to `chunk_size` tokens (the last request taken may be chunked); otherwise
its running requests decode one token each. A lane is scheduled again only after its result was processed.
Forward time per stage: prefill a + b * tokens; decode c + d * batch + e * sum(kv_len), kv_len = input +
generated tokens. Metrics: duration = last finish - first arrival; output/request throughput; concurrency as
bench_serving reports it (sum of E2E latencies / duration); TTFT, ITL (gaps between a request's tokens at
stage 0); per-stage busy and bubble fractions over the time some request is unfinished; send/recv wait.

Assumptions and what is ignored: KV memory only through max_running_requests (no retraction, no new-token-ratio
admission); no radix cache beyond a fixed cached prompt prefix per request (`make_workload(cached_len=...)`);
prefill ignores attention over the already-prefilled prefix; forward and link do not contend; every thread has
a core of its own (no GIL, no preemption, no wake-up latency); a stage's TP ranks act as one (the per-rank 1/tp
slices and the receiver's all-gather are folded into the effective bandwidth); no jitter (deterministic;
lengths from a seeded generator); data may arrive before its receive is posted (eager); CPU costs are per
iteration, not per request.

`--validate FILE` reads the JSON bench/pipeline.py writes:
    {"runs": [{"pp": 2, "depth": 0, "early_output_send": true, "grouped_sends": true, "num_requests": int,
               "input_len": int, "output_len": int, "max_running_requests": int, "cached_prompt_tokens": int,
               "chunked_prefill_size": int,
               "measured": {"output_throughput": tok/s, "bubble_fraction": [per stage], "itl_ms_mean": ms},
               "stage_costs": {"prefill_a_s": s, "prefill_b_s_per_token": s, "decode_c_s": s,
                               "decode_d_s_per_req": s, "decode_e_s_per_kv_token": s, "sched_s": s,
                               "process_s": s, "link_latency_s": s, "link_bytes_per_s": B/s,
                               "hidden_size": int}}, ...]}
"cached_prompt_tokens" (default 0, with a warning): prompt tokens per request the engine found in its prefix
cache (bench/pipeline.py repeats its prompts, so nearly all of them); "chunked_prefill_size" (default 2048,
tokenloom's); "early_send_blocking" and "stream_ordered_proxy" (default: `loop_forms`); "msg_cpu_s" in
stage_costs (default 0); the five forward keys may be lists (one value per stage). "itl_ms_mean" is the mean
decode period of a lane (bench/pipeline.py's mean ITL; the older key "itl_ms_median" held the same mean and is
still read); it is compared with the simulated mean ITL. Throughput on both sides: output tokens / (first
arrival to last token). Requests arrive together (rate inf), lengths fixed; "grouped_sends" is
pipeline_loop.py's `overlap_sends`.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import os
import sys
from collections import deque
from dataclasses import astuple, replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.pp_batcher import Batch, Batcher, Req, SimConfig, StageCost, make_workload  # noqa: E402


class _Event:
    """Happens once, at `time`; processes that wait on it before then are parked in `waiters`."""

    __slots__ = ("time", "waiters")

    def __init__(self) -> None:
        self.time: float | None = None
        self.waiters: list = []


class PipelineSim:
    """The event loop: stage processes are generators that yield an absolute time or an `_Event` to wait for."""

    def __init__(self, cfg: SimConfig, reqs: list[Req]) -> None:
        self.cfg, self.reqs = cfg, reqs
        self.batcher = Batcher(cfg, reqs)
        self.now = 0.0
        self._heap: list = []
        self._seq = itertools.count()
        self.channels: dict[tuple[int, int, str], list] = {}  # key -> [queue, posted event, last send's event]
        self.link_free: dict[tuple[int, int], float] = {}
        pp = cfg.pp
        self.last_step: list[_Event | None] = [None] * pp  # each stage's latest step on its forward thread
        self.busy = [0.0] * pp
        self.send_wait, self.recv_wait = [0.0] * pp, [0.0] * pp
        self.done: list[dict[int, _Event]] = [{} for _ in range(pp)]  # stage -> iteration -> its step done

    # -- kernel
    def _push(self, at: float, gen) -> None:
        heapq.heappush(self._heap, (at, next(self._seq), gen))

    def _fire(self, ev: _Event) -> None:
        ev.time = self.now
        for gen in ev.waiters:
            self._push(self.now, gen)
        ev.waiters = []

    def run(self) -> dict:
        for s in range(self.cfg.pp):
            self._push(0.0, self._stage(s))
        while self._heap:
            self.now, _, gen = heapq.heappop(self._heap)
            try:
                w = next(gen)
            except StopIteration:
                continue
            if isinstance(w, _Event):
                if w.time is None:
                    w.waiters.append(gen)
                else:
                    self._push(max(w.time, self.now), gen)
            else:
                self._push(max(w, self.now), gen)
        if self.batcher.finished != len(self.reqs):
            raise RuntimeError(f"pipeline stalled: {self.batcher.finished}/{len(self.reqs)} requests finished")
        return summarize(self)

    # -- messages
    def _channel(self, key: tuple[int, int, str]) -> list:
        return self.channels.setdefault(key, [deque(), None, None])

    def _send(self, s: int | None, key: tuple[int, int, str], nbytes: float):
        """Post a send from stage s's CPU thread (s None: from a forward thread, whose waits are not counted).
        Returns (as the generator's value) the event of the receiver taking the message."""
        ch = self._channel(key)
        prev, taken = ch[2], _Event()
        ch[2] = taken
        yield from self._post(s, key, nbytes, prev, taken)
        return taken

    def _post(self, s: int | None, key, nbytes: float, prev: _Event | None, taken: _Event):
        t0 = self.now
        if prev is not None:
            yield prev
        if s is not None:
            self.send_wait[s] += self.now - t0
        yield self.now + self.cfg.msg_cpu_s
        link = key[:2]
        start = max(self.now, self.link_free.get(link, 0.0))
        self.link_free[link] = start + nbytes / self.cfg.link_bytes_per_s
        ch = self._channel(key)
        ch[0].append((self.link_free[link] + self.cfg.link_latency_s, taken))
        if ch[1] is not None:
            self._fire(ch[1])
            ch[1] = None

    def _recv(self, s: int, key: tuple[int, int, str]):
        ch, t0 = self._channel(key), self.now
        while not ch[0]:
            ch[1] = ch[1] or _Event()
            yield ch[1]
        arrival, taken = ch[0].popleft()
        yield arrival
        self._fire(taken)
        self.recv_wait[s] += self.now - t0
        yield self.now + self.cfg.msg_cpu_s

    # -- a stage's forward thread
    def _submit(self, s: int, duration: float, send: tuple[tuple[int, int, str], float] | None) -> _Event:
        """Queue a step on stage s's forward thread (FIFO); its event fires when the step's callable returns:
        after the forward and, when the thread posts the step's send (`send`: channel key, bytes), after
        posting it (isend first waits for the channel's previous message) and, with point 2 OFF, after the
        receiver took it (pipeline_loop.py's executor waits for each send it posts there)."""
        done, prev = _Event(), self.last_step[s]
        self.last_step[s] = done
        self.busy[s] += duration
        self._push(self.now, self._forward(duration, prev, done, send))
        return done

    def _forward(self, duration: float, prev: _Event | None, done: _Event, send):
        if prev is not None:
            yield prev
        yield self.now + duration
        if send is not None:
            taken = yield from self._send(None, *send)
            if not self.cfg.grouped_sends:
                yield taken
        self._fire(done)

    # -- one stage's loop
    def _stage(self, s: int):
        cfg, bat = self.cfg, self.batcher
        pp, last, lanes = cfg.pp, s == cfg.pp - 1, cfg.pp + cfg.depth
        proxy_bytes_per_token = 2 * cfg.hidden_size * 2
        t = 0
        while True:
            sent: list[_Event] = []
            if s == 0:  # 1. requests (stage 0 decides for everyone here)
                if bat.finished == bat.total:
                    return
                wake = bat.next_arrival()
                if wake is not None:
                    yield wake
                bat.read_inbox(self.now)
                batch = bat.decide(t, t % lanes)
            else:
                yield from self._recv(s, (s - 1, s, "req"))
                batch = bat.decided[t]
            if not last:
                sent.append((yield from self._send(s, (s, s + 1, "req"), 0)))
            yield self.now + cfg.sched_s  # 2. schedule
            if last and cfg.depth > 0 and pp > 1:  # 3. output of the batch launched at t - depth
                old = bat.decided.get(t - cfg.depth)
                if old is not None:
                    yield self.done[s][t - cfg.depth]
                    sent.append((yield from self._send(s, (s, 0, "out"), _out_bytes(old))))
            early = cfg.depth == 0 and cfg.early_output_send and pp > 1 and batch is not None and last
            if batch is not None:
                if s > 0:  # 4. proxy
                    yield from self._recv(s, (s - 1, s, "proxy"))
                send = None  # 5. forward, with the send its thread posts behind it (6. point 1 ON, 8.)
                if early and not cfg.early_send_blocking:
                    send = ((s, 0, "out"), _out_bytes(batch))
                elif not last and cfg.stream_ordered_proxy:
                    send = ((s, s + 1, "proxy"), proxy_bytes_per_token * batch.tokens)
                self.done[s][t] = self._submit(s, batch.durations[s], send)
            if early and cfg.early_send_blocking:  # 6. point 1 ON, the CPU waiting for the forward
                yield self.done[s][t]
                sent.append((yield from self._send(s, (s, 0, "out"), _out_bytes(batch))))
            prev = bat.decided.get(t + 1 - lanes)  # 7. lane nxt's result
            if prev is not None:
                if last:
                    yield self.done[s][t + 1 - lanes]
                else:
                    yield from self._recv(s, (pp - 1 if s == 0 else s - 1, s, "out"))
                    if s + 1 != pp - 1:
                        sent.append((yield from self._send(s, (s, s + 1, "out"), _out_bytes(prev))))
                yield self.now + cfg.process_s
                if s == 0:
                    bat.apply(prev, self.now)
            if last and cfg.depth == 0 and pp > 1 and batch is not None and not early:  # 6. point 1 OFF
                yield self.done[s][t]
                sent.append((yield from self._send(s, (s, 0, "out"), _out_bytes(batch))))
            if not last and batch is not None and not cfg.stream_ordered_proxy:  # 8. proxy to s+1
                yield self.done[s][t]
                nbytes = proxy_bytes_per_token * batch.tokens
                sent.append((yield from self._send(s, (s, s + 1, "proxy"), nbytes)))
            if not cfg.grouped_sends:  # point 2 OFF: this iteration's sends complete before going on
                t0 = self.now
                yield from sent
                self.send_wait[s] += self.now - t0
            self.done[s].pop(t + 1 - lanes, None)
            t += 1


def _out_bytes(batch: Batch) -> int:
    return 8 * len(batch.prefill or batch.decode)  # one int64 token id per request


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(sim: PipelineSim) -> dict:
    reqs = sim.reqs
    t0, t1 = min(r.arrival for r in reqs), max(r.finish for r in reqs)
    dur = t1 - t0
    active, end = 0.0, t0  # time some request is unfinished: union of [arrival, finish]
    for r in sorted(reqs, key=lambda r: r.arrival):
        if r.finish > end:
            active += r.finish - max(r.arrival, end)
            end = r.finish
    ttft = [r.first_token - r.arrival for r in reqs]
    e2e = [r.finish - r.arrival for r in reqs]
    itl = sim.batcher.itl
    return {
        "duration_s": dur,
        "output_throughput": sum(r.output_len for r in reqs) / dur,
        "request_throughput": len(reqs) / dur,
        "concurrency": sum(e2e) / dur,
        "ttft_ms": {"mean": 1e3 * sum(ttft) / len(ttft), "p50": 1e3 * _pct(ttft, 0.5), "p99": 1e3 * _pct(ttft, 0.99)},
        "itl_ms": {"mean": 1e3 * sum(itl) / max(len(itl), 1), "p50": 1e3 * _pct(itl, 0.5),
                   "p99": 1e3 * _pct(itl, 0.99)},
        "e2e_ms_mean": 1e3 * sum(e2e) / len(e2e),
        "busy_fraction": [b / active for b in sim.busy],
        "bubble_fraction": [1 - b / active for b in sim.busy],
        "send_wait_s": sum(sim.send_wait),
        "recv_wait_s": sum(sim.recv_wait),
    }


def simulate(cfg: SimConfig, reqs: list[Req]) -> dict:
    return PipelineSim(cfg, [replace(r) for r in reqs]).run()


def loop_forms(early_output_send: bool = True, grouped_sends: bool = True) -> dict:
    """How pipeline_loop.py implements the two points: the executor posts point 1's output send behind the
    step (the CPU never waits for it), and the proxy too while point 2 is ON (`overlap_sends`); with point 2
    OFF the loop's CPU waits for the forward and posts the proxy itself."""
    return {"early_output_send": early_output_send, "grouped_sends": grouped_sends, "early_send_blocking": False,
            "stream_ordered_proxy": grouped_sends}


# -- the `--scenario seed` shape: SGLang serving PP4 x TP8 on 4 nodes of 8 H200, 1024 requests of 4096 input and
# 1536 output tokens (range ratio 0.9), all at t=0, with reported figures of 4.61 req/s with both points off and
# 4.65 with both on at depth 0 (4.62 at depth 1, both off). The model is assumed to be Qwen3-235B-A22B (94 layers,
# hidden 4096), which SGLang #7979 ran on a 4 x H200 TP8 PP4 setup (--chunked-prefill-size 16384). Layers per
# stage follow SGLang's split; PER_LAYER is a roofline-shaped guess of one layer on 8 H200 (weights read, FLOPs,
# KV bytes), the last stage adds the LM head. SEED_SCALE and SEED_MAX_RUNNING are calibrated (--calibrate) so the
# baseline (both points off, depth 0) gives the reported 4.61 req/s and bench_serving's concurrency ~568: they
# are fitted, not measured. The CPU and link costs are plausible values for SGLang on 400 Gb/s-class RDMA, not
# measured.
SEED_LAYERS = (23, 23, 24, 24)
PER_LAYER = StageCost(a=0.1e-3, b=0.19e-6, c=0.2e-3, d=0.4e-6, e=0.17e-9)
LM_HEAD = StageCost(a=0.1e-3, c=0.1e-3)
SEED_SCALE = 0.6012
SEED_MAX_RUNNING = 128
SEED_CPU = {"sched_s": 0.3e-3, "process_s": 0.5e-3, "msg_cpu_s": 50e-6}
SEED_LINK = {"link_latency_s": 20e-6, "link_bytes_per_s": 2e11}  # 8 x 400 Gb/s per stage incl. the all-gather
SEED_TARGET_REQ_S = 4.61
OFF = {"early_output_send": False, "grouped_sends": False}


def seed_config(scale: float = SEED_SCALE, max_running: int = SEED_MAX_RUNNING, last_mult: float = 1.0,
                **overrides) -> SimConfig:
    def stage(layers: int, last: bool) -> StageCost:
        k = scale * (last_mult if last else 1.0)
        extra = astuple(LM_HEAD if last else StageCost())
        return StageCost(*(k * (layers * p + x) for p, x in zip(astuple(PER_LAYER), extra, strict=True)))

    stages = tuple(stage(n, i == len(SEED_LAYERS) - 1) for i, n in enumerate(SEED_LAYERS))
    kw = {**SEED_CPU, **SEED_LINK, "max_running_requests": max_running, "chunk_size": 16384, "hidden_size": 4096}
    return SimConfig(stages=stages, **{**kw, **overrides})


def seed_workload(n: int = 1024, rate: float = float("inf")) -> list[Req]:
    return make_workload(n, 4096, 1536, range_ratio=0.9, rate=rate, seed=0)


def calibrate(max_running: int, target: float = SEED_TARGET_REQ_S, n: int = 1024, steps: int = 14) -> float:
    """Bisect (geometrically) the forward-time scale giving `target` req/s for the baseline."""
    lo, hi, reqs = 0.1, 10.0, seed_workload(n)
    for _ in range(steps):
        mid = (lo * hi) ** 0.5
        if simulate(seed_config(mid, max_running, **OFF), reqs)["request_throughput"] > target:
            lo = mid
        else:
            hi = mid
    return (lo * hi) ** 0.5


def _row(name: str, m: dict, base: dict) -> str:
    gain = 100 * (m["request_throughput"] / base["request_throughput"] - 1)
    bub = "/".join(f"{b:.3f}" for b in m["bubble_fraction"])
    return (f"{name:<42} {m['request_throughput']:6.3f} {m['output_throughput']:8.0f} {gain:+6.2f}% "
            f"{m['concurrency']:6.0f} {m['ttft_ms']['mean'] / 1e3:7.1f} {m['itl_ms']['p50']:6.1f} "
            f"{m['itl_ms']['p99']:7.1f} {bub:>23} {m['send_wait_s']:7.1f} {m['recv_wait_s']:7.1f}")


def run_seed(quick: bool, rate: float = float("inf")) -> dict:
    reqs = seed_workload(256 if quick else 1024, rate)
    cpu_proxy = {"stream_ordered_proxy": False}
    variants = {  # (tokenloom): pipeline_loop.py's forms (`loop_forms`); the others change one form
        "depth0 both off (baseline)": loop_forms(False, False),
        "depth0 point1 only (tokenloom)": loop_forms(True, False),
        "depth0 point2 only (tokenloom)": loop_forms(False, True),
        "depth0 both on (tokenloom)": loop_forms(),
        "depth0 both on, CPU-posted proxy": {**loop_forms(), **cpu_proxy},
        "depth0 both on, p1 blocking": {**loop_forms(), "early_send_blocking": True},
        "depth0 both on, p1 blocking, CPU proxy": {**loop_forms(), "early_send_blocking": True, **cpu_proxy},
        "depth1 both off": {**loop_forms(False, False), "depth": 1},
        "depth1 both on (tokenloom)": {**loop_forms(), "depth": 1},
        "depth1 both on, CPU-posted proxy": {**loop_forms(), **cpu_proxy, "depth": 1},
    }
    res = {name: simulate(seed_config(**kw), reqs) for name, kw in variants.items()}
    base = res["depth0 both off (baseline)"]
    print(f"PP4 x TP8 shape: {len(reqs)} requests, PP4, scale {SEED_SCALE}, max_running {SEED_MAX_RUNNING}; "
          f"reported 4.61 (off) -> 4.65 (on) req/s at depth 0, 4.62 at depth 1 (off)")
    print(f"{'variant':<42} {'req/s':>6} {'tok/s':>8} {'vs off':>7} {'conc':>6} {'TTFT s':>7} {'ITL50':>6} "
          f"{'ITL99':>7} {'bubble per stage':>23} {'sendw s':>7} {'recvw s':>7}")
    for name, m in res.items():
        print(_row(name, m, base))
    return {"scenario": "seed", "num_requests": len(reqs), "scale": SEED_SCALE,
            "max_running_requests": SEED_MAX_RUNNING, "results": res}


def run_sweep(quick: bool, rate: float = float("inf")) -> dict:
    """Both points ON (seed_config's forms: the proxy posted by the CPU) vs both OFF at depth 0; x1.0 is the
    calibrated PP4 x TP8 shape (its last stage is already ~6% above stage 0: one more layer and the LM head); other
    multipliers scale the last stage's forward costs."""
    reqs = seed_workload(256 if quick else 1024, rate)
    latencies = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2)
    imbalances = (1.0, 1.1, 1.25, 1.5)
    table = []
    print("gain of both points ON vs both OFF (depth 0, req/s), PP4 x TP8 shape; rows: link latency, columns: last "
          "stage forward x")
    print(f"{'latency':>9} " + " ".join(f"{'x' + str(m):>16}" for m in imbalances))
    for lat in latencies:
        cells = []
        for mult in imbalances:
            off = simulate(seed_config(last_mult=mult, link_latency_s=lat, **OFF), reqs)["request_throughput"]
            on = simulate(seed_config(last_mult=mult, link_latency_s=lat), reqs)["request_throughput"]
            cells.append({"latency_s": lat, "last_mult": mult, "off_req_s": off, "on_req_s": on,
                          "gain": on / off - 1})
        table.extend(cells)
        print(f"{lat * 1e6:7.0f}us " + " ".join(f"{c['off_req_s']:5.2f}->{c['on_req_s']:5.2f} {100 * c['gain']:+4.1f}%"
                                                 for c in cells))
    return {"scenario": "sweep", "num_requests": len(reqs), "cells": table}


def measured_itl_ms(measured: dict) -> float | None:
    """The measured mean ITL: "itl_ms_mean", or the older name of the same mean, "itl_ms_median"."""
    return measured.get("itl_ms_mean", measured.get("itl_ms_median"))


def run_config_from_json(run: dict) -> tuple[SimConfig, list[Req]]:
    """bench/pipeline.py's run record (module docstring) -> the config and workload to simulate."""
    c = run["stage_costs"]
    pp = run["pp"]
    keys = ("prefill_a_s", "prefill_b_s_per_token", "decode_c_s", "decode_d_s_per_req", "decode_e_s_per_kv_token")
    per = [c[k] if isinstance(c[k], list) else [c[k]] * pp for k in keys]
    stages = tuple(StageCost(*(p[s] for p in per)) for s in range(pp))
    forms = loop_forms(run["early_output_send"], run["grouped_sends"])
    forms.update({k: run[k] for k in ("early_send_blocking", "stream_ordered_proxy") if k in run})
    cfg = SimConfig(stages=stages, depth=run["depth"], max_running_requests=run["max_running_requests"],
                    chunk_size=run.get("chunked_prefill_size", 2048), sched_s=c["sched_s"],
                    process_s=c["process_s"], msg_cpu_s=c.get("msg_cpu_s", 0.0),
                    link_latency_s=c["link_latency_s"], link_bytes_per_s=c["link_bytes_per_s"],
                    hidden_size=c["hidden_size"], **forms)
    return cfg, make_workload(run["num_requests"], run["input_len"], run["output_len"],
                              cached_len=run.get("cached_prompt_tokens", 0))


UNMODELLED = ("a positive ITL gap with every stage idling more than predicted is time between steps (on the "
              "ring), not in the measured forwards: the model has no thread wake-ups or GIL hand-offs between a "
              "stage's scheduling and forward threads, no preemption where threads outnumber cores, no frontend "
              "(tokenizer, detokenizer) work, and per-message CPU only as msg_cpu_s")


def explain_gap(run: dict, cfg: SimConfig, predicted: dict) -> list[str]:
    """A few words on where predicted and measured differ: the run's duration split into its decode span
    ((output_len - 1) mean ITLs, when every request runs from the start) and the rest (prefill up to the first
    tokens, the frontend); the ITL gap per loop iteration, next to the scheduler CPU the model charges per
    iteration; whether every stage idles more than predicted."""
    meas, lines = run["measured"], []
    if "cached_prompt_tokens" not in run:
        lines.append("no cached_prompt_tokens: every prompt token is simulated as prefilled (bench/pipeline.py "
                     "repeats its prompts, so the engine prefills ~1 token per request: export the key)")
    d_meas, d_pred = run["num_requests"] * run["output_len"] / meas["output_throughput"], predicted["duration_s"]
    gap, itl_meas = d_meas - d_pred, measured_itl_ms(meas)
    head = f"duration {d_pred:.2f} s predicted, {d_meas:.2f} s measured ({gap:+.2f} s)"
    if abs(gap) <= 0.05 * d_meas or itl_meas is None or run["num_requests"] > run["max_running_requests"]:
        return [*lines, head + (": within 5%" if abs(gap) <= 0.05 * d_meas else "")]
    steps, lanes = run["output_len"] - 1, cfg.pp + cfg.depth
    d_itl = itl_meas - predicted["itl_ms"]["mean"]
    idles = all(m > p for p, m in zip(predicted["bubble_fraction"], meas.get("bubble_fraction", []), strict=False))
    lines.append(f"{head}: {steps * d_itl / 1e3:+.2f} s from the ITL ({steps} x {d_itl:+.1f} ms = {d_itl / lanes:+.1f} "
                 f"ms per iteration, {lanes} per token; scheduler CPU {1e3 * (cfg.sched_s + cfg.process_s):.1f} ms per "
                 f"iteration), {gap - steps * d_itl / 1e3:+.2f} s outside the decode span"
                 + ("; every stage idles more than predicted" if idles else ""))
    return lines


def run_validate(path: str) -> dict:
    with open(path) as f:
        runs = json.load(f)["runs"]
    out, notes = [], []
    print(f"{'run':<28} {'tok/s pred':>10} {'meas':>8} {'ratio':>6} {'ITL mean pred':>13} {'meas':>7} "
          f"{'bubble pred':>17} {'meas':>17}")
    for run in runs:
        cfg, reqs = run_config_from_json(run)
        m, meas = simulate(cfg, reqs), run["measured"]
        itl = measured_itl_ms(meas)
        rec = {"pp": cfg.pp, "depth": cfg.depth, "early_output_send": cfg.early_output_send,
               "grouped_sends": cfg.grouped_sends, "predicted": m, "measured": meas,
               "throughput_ratio": m["output_throughput"] / meas["output_throughput"],
               "itl_ratio": m["itl_ms"]["mean"] / itl if itl else None, "explanation": explain_gap(run, cfg, m)}
        out.append(rec)
        name = f"pp{cfg.pp} d{cfg.depth} p1={int(cfg.early_output_send)} p2={int(cfg.grouped_sends)}"
        notes.extend(f"{name}: {line}" for line in rec["explanation"])
        fmt = "/".join
        print(f"{name:<28} {m['output_throughput']:10.1f} {meas['output_throughput']:8.1f} "
              f"{rec['throughput_ratio']:6.3f} {m['itl_ms']['mean']:13.2f} {itl or 0:7.2f} "
              f"{fmt(f'{b:.3f}' for b in m['bubble_fraction']):>17} "
              f"{fmt(f'{b:.3f}' for b in meas.get('bubble_fraction', [])):>17}")
    for line in notes:
        print(line)
    if any("from the ITL" in line for line in notes):
        print(UNMODELLED)
    return {"scenario": "validate", "file": path, "runs": out}


def run_calibrate(quick: bool) -> dict:
    rows = []
    print(f"{'max_running':>11} {'scale':>7} {'off req/s':>9} {'conc':>6} {'on req/s':>8} {'gain':>6}")
    for r in (128,) if quick else (96, 128, 192, 256, 512):
        k = calibrate(r)
        off, on = (simulate(seed_config(k, r, **kw), seed_workload()) for kw in (OFF, {}))
        rows.append({"max_running_requests": r, "scale": k, "off": off, "on": on})
        gain = 100 * (on["request_throughput"] / off["request_throughput"] - 1)
        print(f"{r:11d} {k:7.4f} {off['request_throughput']:9.3f} {off['concurrency']:6.0f} "
              f"{on['request_throughput']:8.3f} {gain:+5.2f}%")
    return {"scenario": "calibrate", "rows": rows}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--scenario", choices=["seed"], help="seed: the PP4 x TP8 shape (4 nodes of 8 H200, "
                      "1024 requests of ~4096 in / ~1536 out tokens) with the two send optimizations on and off")
    mode.add_argument("--sweep", action="store_true")
    mode.add_argument("--validate", metavar="FILE")
    mode.add_argument("--calibrate", action="store_true")
    ap.add_argument("--quick", action="store_true", help="256 requests instead of 1024 (calibration: one point)")
    ap.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals (req/s) for "
                    "--scenario and --sweep; default inf: all requests at t=0, as in the reported runs")
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON object on the last line")
    args = ap.parse_args(argv)
    if args.scenario:
        res = run_seed(args.quick, args.request_rate)
    elif args.sweep:
        res = run_sweep(args.quick, args.request_rate)
    elif args.validate:
        res = run_validate(args.validate)
    else:
        res = run_calibrate(args.quick)
    if args.json:
        print(json.dumps(res))
    return res


if __name__ == "__main__":
    main()
