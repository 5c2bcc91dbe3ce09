"""The workload and the batching policy of bench/pp_sim.py's pipeline model: stage cost models, the simulated
configuration, requests, and `Batcher`, the continuous batching every stage applies identically (stage 0 decides
and applies results; the other stages read its decisions). See bench/pp_sim.py's docstring for the rules."""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field


@dataclass(frozen=True)
class StageCost:
    """Forward time of one stage: prefill a + b * tokens, decode c + d * batch + e * sum(kv_len) (seconds)."""

    a: float = 0.0
    b: float = 0.0
    c: float = 0.0
    d: float = 0.0
    e: float = 0.0

    def prefill(self, tokens: int) -> float:
        return self.a + self.b * tokens

    def decode(self, batch: int, kv_tokens: int) -> float:
        return self.c + self.d * batch + self.e * kv_tokens


@dataclass(frozen=True)
class SimConfig:
    """One simulated deployment. `stages` has pp entries; CPU and link costs are the same on every stage."""

    stages: tuple[StageCost, ...]
    depth: int = 0
    early_output_send: bool = True  # point 1: the last stage's output sent to stage 0 as its forward ends
    grouped_sends: bool = True  # point 2: sends posted behind their step, overlapping the next receives
    early_send_blocking: bool = False  # point 1 ON with the CPU waiting for the forward (see module docstring)
    stream_ordered_proxy: bool = False  # step 8's send posted by the forward thread behind the forward
    max_running_requests: int = 512
    chunk_size: int = 8192
    sched_s: float = 0.0
    process_s: float = 0.0
    msg_cpu_s: float = 0.0
    link_latency_s: float = 0.0
    link_bytes_per_s: float = float("inf")
    hidden_size: int = 4096

    @property
    def pp(self) -> int:
        return len(self.stages)


@dataclass(eq=False)
class Req:
    """One request; `prefilled` starts at its cached prompt prefix (0 without a prefix cache)."""

    arrival: float
    input_len: int
    output_len: int
    prefilled: int = 0
    generated: int = 0
    first_token: float = -1.0
    last_token: float = -1.0
    finish: float = -1.0


@dataclass(eq=False)
class Batch:
    lane: int
    prefill: list[tuple[Req, bool]]  # (request, this chunk completes its prompt)
    decode: list[Req]
    tokens: int
    durations: tuple[float, ...]  # forward time on each stage


@dataclass
class _Lane:
    decoding: list[Req] = field(default_factory=list)
    chunked: Req | None = None
    count: int = 0  # admitted, unfinished requests of this lane


def make_workload(n: int, input_len: int, output_len: int, range_ratio: float = 1.0, rate: float = float("inf"),
                  seed: int = 0, cached_len: int = 0) -> list[Req]:
    """bench_serving's random dataset: lengths uniform in [int(len * ratio), len]; Poisson arrivals at `rate`.
    `cached_len`: prompt tokens each request finds in the prefix cache (at most all but the last, as the
    engine matches): only the rest is prefilled, while decode still attends over the whole prompt."""
    rng = random.Random(seed)
    t, reqs = 0.0, []
    for _ in range(n):
        i = rng.randint(max(int(input_len * range_ratio), 1), input_len)
        o = rng.randint(max(int(output_len * range_ratio), 1), output_len)
        reqs.append(Req(t, i, o, prefilled=max(0, min(cached_len, i - 1))))
        if rate != float("inf"):
            t += rng.expovariate(rate)
    return reqs


class Batcher:
    """Continuous batching over L lanes. Stage 0 calls `decide` and `apply`; the other stages read `decided`."""

    def __init__(self, cfg: SimConfig, reqs: list[Req]) -> None:
        self.cfg = cfg
        self.pending = deque(sorted(reqs, key=lambda r: r.arrival))
        self.waiting: deque[Req] = deque()
        self.lanes = [_Lane() for _ in range(cfg.pp + cfg.depth)]
        self.lane_cap = max(cfg.max_running_requests // cfg.pp, 1)
        self.running = self.finished = 0
        self.total = len(reqs)
        self.decided: dict[int, Batch | None] = {}
        self.itl: list[float] = []

    def read_inbox(self, now: float) -> None:
        while self.pending and self.pending[0].arrival <= now:
            self.waiting.append(self.pending.popleft())

    def next_arrival(self) -> float | None:
        """When the system is empty, the time stage 0 can sleep to; None when there is work (or nothing left)."""
        if self.running or self.waiting or not self.pending:
            return None
        return self.pending[0].arrival

    def _fits(self, lane: _Lane) -> bool:
        return bool(self.waiting) and lane.count < self.lane_cap and self.running < self.cfg.max_running_requests

    def decide(self, t: int, mb: int) -> Batch | None:
        lane, stages = self.lanes[mb], self.cfg.stages
        if lane.chunked is not None or self._fits(lane):
            items, budget = [], self.cfg.chunk_size
            if lane.chunked is not None:
                req, lane.chunked = lane.chunked, None
                budget -= self._take(lane, req, budget, items)
            while budget > 0 and self._fits(lane):
                req = self.waiting.popleft()
                lane.count += 1
                self.running += 1
                budget -= self._take(lane, req, budget, items)
            tokens = self.cfg.chunk_size - budget
            batch = Batch(mb, items, [], tokens, tuple(c.prefill(tokens) for c in stages))
        elif lane.decoding:
            reqs = list(lane.decoding)
            kv = sum(r.input_len + r.generated for r in reqs)
            batch = Batch(mb, [], reqs, len(reqs), tuple(c.decode(len(reqs), kv) for c in stages))
        else:
            batch = None
        self.decided[t] = batch
        return batch

    @staticmethod
    def _take(lane: _Lane, req: Req, budget: int, items: list[tuple[Req, bool]]) -> int:
        n = min(budget, req.input_len - req.prefilled)
        req.prefilled += n
        done = req.prefilled == req.input_len
        if not done:
            lane.chunked = req
        items.append((req, done))
        return n

    def apply(self, batch: Batch, now: float) -> None:
        """Stage 0 applies a processed result: token times, finished requests free their slots."""
        lane, gone = self.lanes[batch.lane], False
        for req, done in batch.prefill:
            if done:
                req.first_token = req.last_token = now
                req.generated = 1
                lane.decoding.append(req)
        for req in batch.decode:
            req.generated += 1
            self.itl.append(now - req.last_token)
            req.last_token = now
        for req in (r for r, _ in batch.prefill) if batch.prefill else batch.decode:
            if req.generated >= req.output_len and req.finish < 0:
                req.finish, gone = now, True
                lane.count -= 1
                self.running -= 1
                self.finished += 1
        if gone:
            lane.decoding = [r for r in lane.decoding if r.finish < 0]
