"""Soak, abort storms and killed processes, per topology (tiny model, small limits, real processes over HTTP).

Each test runs one server shape through three phases:
1. soak: mixed requests (native and OpenAI routes, streaming and not, prompts of 2-120 words, 2-40 new tokens)
   arriving faster than the server holds (`--max-queued-requests` turns the excess into 503s), a tenth cut off by
   their client and a tenth aborted through /abort_request. Every request ends completed, aborted, refused with a
   message or cancelled by its client: none lost, none failed; afterwards the KV pool (every rank's) is full
   again, and resident memory of every process stays within a bound between the middle and the end;
2. (PP, PD) an abort storm: half of the requests aborted at random moments; the stages / servers keep agreeing
   and serving;
3. a process is killed under load (the detokenizer, a TP rank, a PP stage, the decode server behind the router,
   then, behind a new decode server, the prefill server): every request in flight ends with a message within a
   bound, the server exits non-zero and no process is left.

Short form by default (CI); `--long` (or TOKENLOOM_TEST_LONG=1) runs 2,000 requests per soak and prints the
figures docs/reliability.md records.

Every server and router a test starts is registered with the `started` fixture as it is created (before it is
waited for), and stopped when the test ends, whether it passed, failed an assertion part-way, or timed out
waiting for a process: a failed soak leaves nothing running.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import pytest

from tests.e2e.server_process import ServerProcess, free_port, http
from tests.e2e.test_disaggregation import Router, _assert_idle_and_full
from tests.reliability.load import LoadReport, LoadShape, run_load

LONG = os.environ.get("TOKENLOOM_TEST_LONG") == "1"
SOAK_REQUESTS = 2000 if LONG else 100
LIMITS = ("--dtype", "float32", "--context-length", "4096", "--max-total-tokens", "3000",
          "--max-running-requests", "12", "--max-queued-requests", "24", "--chunked-prefill-size", "256")
FULL_QUEUE = "The request queue is full."  # the scheduler's refusal (scheduler.py)
KILL_BOUND_S = 30.0  # every request in flight ends this soon after a process is killed


def rss_mb(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        except (OSError, StopIteration):
            pass
    return total / 1024


def process_tree(server: ServerProcess) -> list[int]:
    return [server.proc.pid, *server.children()]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


Started = TypeVar("Started", ServerProcess, Router)


def stop_started(processes: list[ServerProcess | Router]) -> None:
    """Stop `processes`, the last started first (a router before the servers it fronts). A server is killed
    with its children (scheduler ranks, detokenizer), which would otherwise only follow within their parent
    watch's period; a router is terminated (then killed)."""
    for process in reversed(processes):
        if isinstance(process, Router):
            process.stop()
            continue
        # only a server still running: a reaped one's pid may belong to someone else's process by now
        children = process.children() if process.proc.poll() is None else []
        process.stop(signal.SIGKILL)
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def started() -> Iterator[Callable[[Started], Started]]:
    """`started(ServerProcess(...))` / `started(Router(...))`: the process, registered to be stopped when the
    test ends, however it ends (a process stopped earlier by the test is left as it is)."""
    processes: list[ServerProcess | Router] = []

    def register(process: Started) -> Started:
        processes.append(process)
        return process

    yield register
    stop_started(processes)


def is_a_full_queue(refusal: str) -> bool:
    """Whether a refusal is a 503 for a full queue: as the server says it, or as SGLang's router wraps it (for a
    stream, `data: {'error': {"message": <the server's body>, ...}}`, the body at times cut off by the router: then
    what is left must be the start of the server's message)."""
    if not refusal.startswith("503 "):
        return False
    if FULL_QUEUE in refusal:
        return True
    message = refusal.rsplit('"message":"', 1)[-1] if refusal.startswith("503 data: {'error'") else ""
    return bool(message) and '"' not in message and FULL_QUEUE.startswith(message)


def soak(url: str, servers: list[ServerProcess], label: str, abort_urls: tuple[str, ...] | None = None,
         abort_share: float = 0.1) -> LoadReport:
    """Phase 1 (or 2, with a large `abort_share`): the load in two halves, RSS sampled between and after."""
    pids = [pid for s in servers for pid in process_tree(s)]
    half = SOAK_REQUESTS // 2
    first = asyncio.run(run_load(url, LoadShape(requests=half, abort_share=abort_share, seed=1), abort_urls=abort_urls))
    middle = rss_mb(pids)
    second = asyncio.run(run_load(url, LoadShape(requests=SOAK_REQUESTS - half, abort_share=abort_share, seed=2),
                                  abort_urls=abort_urls))
    end = rss_mb(pids)
    report = LoadReport(first.outcomes + second.outcomes, first.wall_s + second.wall_s)
    print(f"[{label}] {report.summary()}; RSS of {len(pids)} processes {middle:.0f} MB -> {end:.0f} MB")
    assert not report.of("lost") and not report.of("failed"), report.of("lost")[:5] + report.of("failed")[:5]
    assert len(report.outcomes) == SOAK_REQUESTS
    counts = report.counts()
    assert counts.get("completed", 0) >= min(50, SOAK_REQUESTS // 10), counts  # the load is real, not all refused
    unexpected = {o.detail[:300] for o in report.of("refused") if not is_a_full_queue(o.detail)}
    assert not unexpected, unexpected
    assert end <= middle * 1.15 + 64, (middle, end)  # no process grows without bound
    return report


def kill_under_load(url: str, victim_pid: int, servers_that_exit: list[ServerProcess], label: str,
                    broken_connection_fails: bool = False) -> LoadReport:
    """Phase 3: long requests in flight, then `victim_pid` is killed; every request ends with a message within
    KILL_BOUND_S, and every server in `servers_that_exit` exits non-zero leaving no process behind."""
    pids = [pid for s in servers_that_exit for pid in process_tree(s)]
    shape = LoadShape(requests=24, rate_per_s=200, max_new_tokens=(300, 600), disconnect_share=0, abort_share=0,
                      answer_bound_s=KILL_BOUND_S + 30, seed=3, broken_connection_fails=broken_connection_fails)

    async def scenario() -> tuple[LoadReport, float]:
        load = asyncio.ensure_future(run_load(url, shape))
        await asyncio.sleep(1.5)  # requests running and queued
        os.kill(victim_pid, signal.SIGKILL)
        killed = time.monotonic()
        report = await load
        return report, time.monotonic() - killed

    report, ended_after = asyncio.run(scenario())
    print(f"[{label}] killed pid {victim_pid}: {report.summary()}; all ended {ended_after:.1f} s after the kill")
    assert not report.of("lost"), report.of("lost")[:5]
    assert report.of("failed"), report.counts()  # requests were in flight when it died
    assert all(o.seconds < shape.answer_bound_s for o in report.outcomes)
    assert ended_after < KILL_BOUND_S
    for server in servers_that_exit:
        assert server.wait_exit(timeout=KILL_BOUND_S) != 0
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if alive(p)], "processes left behind"
    return report


def test_unified_soak_then_a_killed_detokenizer(tiny_runtime_model, started):
    """With --detokenizer-process (by default the server process detokenizes: nothing to kill)."""
    server = started(ServerProcess("--model-path", tiny_runtime_model, *LIMITS, "--num-threads", "1",
                                   "--detokenizer-process")).wait_healthy()
    soak(server.url, [server], "unified")
    server.wait_idle_and_pool_full()
    detokenizer = server.server_info()["process_ids"]["detokenizer"]
    kill_under_load(server.url, detokenizer, [server], "unified")
    assert "detokenizer" in server.logs()


def test_tp2_soak_then_a_killed_rank(tiny_runtime_model, started):
    server = started(ServerProcess("--model-path", tiny_runtime_model, *LIMITS, "--tp-size", "2")).wait_healthy()
    soak(server.url, [server], "tp2")
    server.wait_idle_and_pool_full()
    info = server.server_info()
    assert info["tp_ranks_agree"] is True
    kill_under_load(server.url, info["process_ids"]["scheduler1"], [server], "tp2")
    assert "rank 1" in server.logs()


def test_pp2_soak_abort_storm_then_a_killed_stage(tiny_runtime_model, started):
    server = started(ServerProcess("--model-path", tiny_runtime_model, *LIMITS, "--pp-size", "2")).wait_healthy()
    soak(server.url, [server], "pp2")
    soak(server.url, [server], "pp2 abort storm", abort_share=0.5)  # SGLang's stages diverged here (#34572)
    info = server.wait_idle_and_pool_full()
    for stage in info.get("pp_stages", []):  # every stage's pool, not only stage 0's
        assert stage["available_kv_tokens"] + stage["evictable_kv_tokens"] == stage["max_total_num_tokens"], info
    status, out = http("POST", server.url + "/generate", {"text": "Still in step?",
                                                          "sampling_params": {"max_new_tokens": 4}})
    assert status == 200 and out["meta_info"]["completion_tokens"] == 4
    kill_under_load(server.url, info["process_ids"]["scheduler1"], [server], "pp2")  # stage 1
    assert "rank 1" in server.logs()


def test_pd_soak_abort_storm_then_a_killed_decode_then_prefill_server(tiny_runtime_model, monkeypatch, started):
    bootstrap = free_port()
    pd = ("--disaggregation-transfer-backend", "mooncake")
    # A prefill request whose decode half never arrives (its decode server died first) waits for the decode
    # side's destination until the bootstrap timeout (SGLang's default 300 s); that timeout is the bound here.
    monkeypatch.setenv("TOKENLOOM_DISAGGREGATION_BOOTSTRAP_TIMEOUT", "10")
    prefill = started(ServerProcess("--model-path", tiny_runtime_model, *LIMITS, "--disaggregation-mode", "prefill",
                                    "--disaggregation-bootstrap-port", str(bootstrap), *pd, "--num-threads", "1"))
    decode = started(ServerProcess("--model-path", tiny_runtime_model, *LIMITS, "--disaggregation-mode", "decode",
                                   *pd, "--num-threads", "1"))
    prefill.wait_healthy()
    decode.wait_healthy()
    # no retries (a retried request would hide the refusal); no circuit breaker: it would turn the servers'
    # 503s into the router's own refusals of nearly everything, and the servers would not see the load
    router = started(Router(prefill, bootstrap, decode,
                            extra=("--disable-retries", "--disable-circuit-breaker"))).wait_ready()
    both = (prefill.url, decode.url)
    soak(router.url, [prefill, decode], "pd", abort_urls=both)
    soak(router.url, [prefill, decode], "pd abort storm", abort_urls=both, abort_share=0.5)
    _assert_idle_and_full(prefill)
    _assert_idle_and_full(decode)  # not the drain bound: every aborted room's slots are let go at once
    kill_under_load(router.url, decode.proc.pid, [], "pd", broken_connection_fails=True)
    _assert_idle_and_full(prefill)  # the prefill server freed what the dead decode server was sent
    assert http("GET", prefill.url + "/health")[0] == 200
    router.stop()
    # a new decode server, then the prefill server killed under load: the decode halves waiting for its KV
    # fail when its heartbeat stops answering (5 s x 2 misses by default, SGLang's), its processes all exit
    second_decode = started(ServerProcess("--model-path", tiny_runtime_model, *LIMITS, "--disaggregation-mode",
                                          "decode", *pd, "--num-threads", "1")).wait_healthy()
    router = started(Router(prefill, bootstrap, second_decode,
                            extra=("--disable-retries", "--disable-circuit-breaker"))).wait_ready()
    kill_under_load(router.url, prefill.proc.pid, [prefill], "pd prefill killed", broken_connection_fails=True)
    _assert_idle_and_full(second_decode)  # nothing the dead prefill server was to send is still held
    assert http("GET", second_decode.url + "/health")[0] == 200
