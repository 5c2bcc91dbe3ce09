"""`tokenloom serve --tp-size 2` end to end: /generate answers equal the TP=1 server's (same flags), every
rank agrees on its pools, and killing scheduler rank 1 fails the pending request with the rank named, the
server exits 1 and no child survives."""

from __future__ import annotations

import os
import signal
import time

from tests.e2e.conftest import TINY_FLAGS
from tests.e2e.server_process import (
    ServerProcess,
    assert_a_hung_rank_is_named,
    assert_same_answers,
    free_port,
    start_pending_request,
)

PROMPTS = ["The capital city of France is", "1, 2, 3, 4, 5,", "Once upon a time", "def fibonacci(n):"]
BATCH = {"text": PROMPTS, "sampling_params": {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}}
SEEDED = {"text": PROMPTS, "sampling_params": {"temperature": 0.8, "top_k": 16, "max_new_tokens": 16,
                                               "ignore_eos": True, "sampling_seed": 5}}


def test_tp2_server_matches_tp1_and_dies_cleanly_with_a_rank(tiny_server, tiny_runtime_model):
    server = ServerProcess("--model-path", tiny_runtime_model, *TINY_FLAGS, "--tp-size", "2",
                           "--dist-init-addr", f"127.0.0.1:{free_port()}").wait_healthy()
    try:
        assert_same_answers(server.url, tiny_server.url, [BATCH, SEEDED], texts=True)
        info = server.wait_idle_and_pool_full()
        assert info["tp_ranks_agree"] is True and info["tp_size"] == 2
        rank1 = info["process_ids"]["scheduler1"]
        # each rank (every one of its threads) runs on its own half of the cores (TOKENLOOM_CPU_OMP_THREADS_BIND)
        cores = sorted(os.sched_getaffinity(0))
        bound = [set().union(*(os.sched_getaffinity(int(t)) for t in os.listdir(f"/proc/{pid}/task")))
                 for pid in (info["process_ids"]["scheduler"], rank1)]
        assert bound == [set(cores[:len(cores) // 2]), set(cores[len(cores) // 2:2 * (len(cores) // 2)])], bound
        assert info["rank_cpu_cores"] == cores[:len(cores) // 2]

        thread, result = start_pending_request(server)
        start = time.monotonic()
        os.kill(rank1, signal.SIGKILL)
        thread.join(timeout=30)
        status, body = result["reply"]
        assert status == 503 and "scheduler rank 1 (tp 1, pp 0) died" in body["error"]["message"], body
        assert server.wait_exit(timeout=60) == 1
        assert "error: the scheduler rank 1 (tp 1, pp 0) died (exit code -9)" in server.logs()
        assert time.monotonic() - start < 30
        assert not server.children()
    finally:
        server.stop()


def test_a_hung_rank_is_named_and_ends_the_server_within_a_bound(tiny_runtime_model):
    """SIGSTOP on rank 1 (alive, never answering): rank 0's next collective times out after --dist-timeout,
    its error names the rank whose heartbeat stopped, and the server answers the pending request and exits 1."""
    timeout_s = 5
    server = ServerProcess("--model-path", tiny_runtime_model, *TINY_FLAGS, "--tp-size", "2",
                           "--dist-timeout", str(timeout_s)).wait_healthy()
    rank1 = server.server_info()["process_ids"]["scheduler1"]
    assert_a_hung_rank_is_named(server, rank1, "scheduler rank 1 (tp 1, pp 0)", timeout_s)
