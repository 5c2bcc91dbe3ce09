"""A load generator for the reliability tests: many requests of mixed shapes at a rate above what the server
holds, some of them cut off by their client or aborted through /abort_request, each ending classified.

Every request ends as exactly one `Outcome.kind`:
- "completed": 200 and a finish reason length/stop;
- "aborted": 200 and finish reason abort after this driver asked /abort_request for it;
- "refused": a 4xx/503 whose body carries a message (the queue is full, ...);
- "failed": another error status, or an error event in a stream, carrying a message (expected only when a
  process was killed);
- "cancelled": this driver closed the connection on purpose (a client disconnect);
- "lost": anything else: no answer within the bound, a broken connection nobody asked for, an error without a
  message, a 200 without a finish reason. A reliable server has none.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import aiohttp

ROUTES = ("generate", "generate_stream", "completions_stream", "chat")


@dataclass
class Outcome:
    rid: str
    route: str
    kind: str
    detail: str = ""
    seconds: float = 0.0


@dataclass
class LoadReport:
    outcomes: list[Outcome] = field(default_factory=list)
    wall_s: float = 0.0

    def counts(self) -> dict[str, int]:
        return dict(Counter(o.kind for o in self.outcomes))

    def of(self, kind: str) -> list[Outcome]:
        return [o for o in self.outcomes if o.kind == kind]

    def summary(self) -> str:
        reasons = Counter(f"{o.kind}: {o.detail[:80]}" for o in self.outcomes if o.kind in ("refused", "failed"))
        return f"{len(self.outcomes)} requests in {self.wall_s:.1f} s: {self.counts()}; {dict(reasons)}"


@dataclass
class LoadShape:
    requests: int = 200
    rate_per_s: float = 100.0  # Poisson arrivals
    prompt_words: tuple[int, int] = (2, 120)
    max_new_tokens: tuple[int, int] = (2, 40)
    disconnect_share: float = 0.1
    abort_share: float = 0.1
    answer_bound_s: float = 120.0  # no request may go unanswered longer than this
    seed: int = 0
    # a connection that breaks off counts as "failed" (not "lost"): only when the test killed the very process
    # answering it (a decode server behind the router), which then cannot send a message
    broken_connection_fails: bool = False


async def run_load(url: str, shape: LoadShape, routes: tuple[str, ...] = ROUTES,
                   abort_urls: tuple[str, ...] | None = None) -> LoadReport:
    """Send `shape.requests` requests to the server (or router) at `url`; returns every request's outcome.
    `abort_urls`: the servers /abort_request goes to (default `url`; behind a PD router, both servers)."""
    rng = random.Random(shape.seed)
    report = LoadReport()
    started = time.monotonic()
    timeout = aiohttp.ClientTimeout(total=shape.answer_bound_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        tasks = []
        for i in range(shape.requests):
            await asyncio.sleep(rng.expovariate(shape.rate_per_s))
            fate = rng.random()
            plan = "disconnect" if fate < shape.disconnect_share else \
                "abort" if fate < shape.disconnect_share + shape.abort_share else "finish"
            route = "generate" if plan == "abort" else rng.choice(routes)  # /abort_request takes native rids
            words = " ".join(f"w{rng.randrange(1000)}" for _ in range(rng.randint(*shape.prompt_words)))
            tasks.append(asyncio.ensure_future(_one(session, url, f"load-{shape.seed}-{i}-{uuid.uuid4().hex[:6]}",
                                                    route, words, rng.randint(*shape.max_new_tokens), plan,
                                                    rng.uniform(0.0, 0.5), report, abort_urls or (url,),
                                                    shape.broken_connection_fails)))
        await asyncio.gather(*tasks)
    report.wall_s = time.monotonic() - started
    return report


def _body(route: str, rid: str, words: str, max_new: int) -> tuple[str, dict[str, Any], bool]:
    params = {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}
    if route == "generate":
        return "/generate", {"text": words, "sampling_params": params, "rid": rid}, False
    if route == "generate_stream":
        return "/generate", {"text": words, "sampling_params": params, "rid": rid, "stream": True}, True
    if route == "completions_stream":
        return "/v1/completions", {"model": "default", "prompt": words, "max_tokens": max_new, "temperature": 0,
                                   "ignore_eos": True,
                                   "stream": True}, True
    return "/v1/chat/completions", {"model": "default", "messages": [{"role": "user", "content": words}],
                                    "max_tokens": max_new,
                                    "temperature": 0, "ignore_eos": True}, False


async def _one(session: aiohttp.ClientSession, url: str, rid: str, route: str, words: str, max_new: int,
               plan: str, delay_s: float, report: LoadReport, abort_urls: tuple[str, ...],
               broken_connection_fails: bool) -> None:
    path, body, stream = _body(route, rid, words, max_new)
    started = time.monotonic()
    outcome = Outcome(rid, route, "lost")
    work = asyncio.ensure_future(_request(session, url + path, body, stream, outcome))
    try:
        if plan == "disconnect":
            done, _ = await asyncio.wait({work}, timeout=delay_s)
            if not done:
                work.cancel()
                outcome.kind, outcome.detail = "cancelled", "the client went away"
        elif plan == "abort":
            done, _ = await asyncio.wait({work}, timeout=delay_s)
            if not done:
                outcome.detail = "abort asked"
                for abort_url in abort_urls:
                    async with session.post(abort_url + "/abort_request", json={"rid": rid}) as resp:
                        await resp.read()
        if not work.cancelled():
            await work
    except asyncio.CancelledError:
        pass
    except (TimeoutError, aiohttp.ClientError) as e:
        broke = isinstance(e, aiohttp.ClientPayloadError | aiohttp.ServerDisconnectedError)
        outcome.kind = "failed" if broke and broken_connection_fails else "lost"
        outcome.detail = f"{type(e).__name__}: {e}"
    outcome.seconds = time.monotonic() - started
    report.outcomes.append(outcome)


async def _request(session: aiohttp.ClientSession, url: str, body: dict[str, Any], stream: bool,
                   outcome: Outcome) -> None:
    asked_abort = lambda: outcome.detail == "abort asked"  # noqa: E731 - read when the answer is in
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            _classify_error(resp.status, await resp.text(), outcome)
            return
        if not stream:
            _classify_finish(_finish_of(await resp.json()), asked_abort(), outcome)
            return
        finish = None
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                message = event["error"].get("message") if isinstance(event["error"], dict) else event["error"]
                outcome.kind, outcome.detail = ("failed", str(message)) if message else ("lost", "empty error")
                return
            finish = _finish_of(event) or finish
        _classify_finish(finish, asked_abort(), outcome)


def _finish_of(answer: Any) -> Any:
    if isinstance(answer, list):
        answer = answer[0]
    if "meta_info" in answer:
        return answer["meta_info"].get("finish_reason")
    choice = (answer.get("choices") or [{}])[0]
    return choice.get("finish_reason")


def _classify_finish(finish: Any, asked_abort: bool, outcome: Outcome) -> None:
    kind = finish.get("type") if isinstance(finish, dict) else finish
    if kind in ("length", "stop"):
        outcome.kind = "completed"
    elif kind == "abort" and asked_abort:
        outcome.kind = "aborted"
    elif kind == "abort":
        message = finish.get("message") if isinstance(finish, dict) else None
        outcome.kind, outcome.detail = ("failed", message) if message else ("lost", "an abort nobody asked for")
    else:
        outcome.kind, outcome.detail = "lost", f"no finish reason: {finish!r}"


def _classify_error(status: int, text: str, outcome: Outcome) -> None:
    try:
        parsed = json.loads(text)
        message = parsed.get("message") or (parsed.get("error") or {}).get("message")
    except (json.JSONDecodeError, AttributeError):
        message = text.strip()
    if not message:
        outcome.kind, outcome.detail = "lost", f"HTTP {status} without a message"
    elif 400 <= status < 500 or status == 503:
        outcome.kind, outcome.detail = "refused", f"{status} {message}"
    else:
        outcome.kind, outcome.detail = "failed", f"{status} {message}"
