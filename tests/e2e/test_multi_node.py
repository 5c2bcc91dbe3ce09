"""Two nodes on one machine (`--nnodes 2`, two launch commands on loopback: the code path of two hosts): node 0
serves HTTP and runs rank 0, node 1 runs rank 1 only. Answers equal the one-process server's; killing a rank on
either node ends both nodes within a bound, with the dead rank named; a clean stop of node 0 ends node 1 with
exit 0; no process is left behind."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.e2e.conftest import TINY_FLAGS
from tests.e2e.server_process import ServerProcess, assert_same_answers, free_port, http, start_pending_request

PROMPTS = ["The capital city of France is", "1, 2, 3, 4, 5,", "Once upon a time", "def fibonacci(n):"]
BATCH = {"text": PROMPTS, "sampling_params": {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}}
SEEDED = {"text": PROMPTS, "sampling_params": {"temperature": 0.8, "top_k": 16, "max_new_tokens": 16,
                                               "ignore_eos": True, "sampling_seed": 5}}
EXIT_BOUND_S = 30


def launch_two_nodes(model: str, *extra: str) -> tuple[ServerProcess, ServerProcess]:
    flags = ("--model-path", model, *TINY_FLAGS, "--tp-size", "2", "--nnodes", "2",
             "--dist-init-addr", f"127.0.0.1:{free_port()}", "--dist-timeout", "30", "--log-level", "info", *extra)
    node0 = ServerProcess(*flags, "--node-rank", "0")
    node1 = ServerProcess(*flags, "--node-rank", "1")
    try:
        node0.wait_healthy()
    except BaseException:
        node0.stop(signal.SIGKILL)
        node1.stop(signal.SIGKILL)
        raise
    return node0, node1


def scheduler_rank_pid(node: ServerProcess) -> int:
    """The one scheduler rank a node runs (its spawned child that is not multiprocessing's resource tracker)."""
    ranks = []
    for pid in node.children():
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read().replace(b"\0", b" ").decode()
        if "spawn_main" in cmdline:
            ranks.append(pid)
    assert len(ranks) == 1, ranks
    return ranks[0]


@pytest.fixture
def two_nodes(tiny_runtime_model, request):
    node0, node1 = launch_two_nodes(tiny_runtime_model, *getattr(request, "param", ()))
    yield node0, node1
    for node in (node0, node1):
        node.stop(signal.SIGKILL)
    assert not node0.children() and not node1.children()


# Both "nodes" share this host, so by default their TP group uses the shared-memory all-reduce; with it
# disabled every collective crosses between the nodes on gloo, as between two hosts.
@pytest.mark.parametrize("two_nodes", [("--disable-custom-all-reduce",)], indirect=True)
def test_two_nodes_match_one_process_then_a_dead_rank_on_node1_ends_both(two_nodes, tiny_server):
    node0, node1 = two_nodes
    assert_same_answers(node0.url, tiny_server.url, [BATCH, SEEDED])
    info = node0.wait_idle_and_pool_full()
    assert info["tp_size"] == 2 and info["tp_ranks_agree"] is True
    assert "collectives: shared memory" not in node0.logs() + node1.logs()

    thread, result = start_pending_request(node0)
    start = time.monotonic()
    os.kill(scheduler_rank_pid(node1), signal.SIGKILL)
    thread.join(timeout=EXIT_BOUND_S)
    status, body = result["reply"]
    named = "scheduler rank 1 (tp 1, pp 0) on node 1 died (exit code -9)"
    assert status == 503 and named in body["error"]["message"], body
    assert node1.wait_exit(timeout=EXIT_BOUND_S) == 1
    assert node0.wait_exit(timeout=EXIT_BOUND_S) == 1
    assert time.monotonic() - start < EXIT_BOUND_S
    assert named in node1.logs() and named in node0.logs()
    assert not node0.children() and not node1.children()


def test_a_dead_rank_on_node0_ends_node1(two_nodes):
    node0, node1 = two_nodes
    assert "tensor-parallel collectives: shared memory" in node0.logs()
    thread, result = start_pending_request(node0)
    start = time.monotonic()
    os.kill(node0.server_info()["process_ids"]["scheduler"], signal.SIGKILL)
    thread.join(timeout=EXIT_BOUND_S)
    status, body = result["reply"]
    assert status == 503 and "scheduler rank 0 (tp 0, pp 0) on node 0 died" in body["error"]["message"]
    assert node0.wait_exit(timeout=EXIT_BOUND_S) == 1
    assert node1.wait_exit(timeout=EXIT_BOUND_S) == 1
    assert time.monotonic() - start < EXIT_BOUND_S
    assert "node 0 went away" in node1.logs() or "rank 1 (tp 1, pp 0) on node 1" in node1.logs()
    assert not node0.children() and not node1.children()


def test_a_clean_stop_of_node0_ends_node1_with_exit_0(two_nodes):
    node0, node1 = two_nodes
    status, out = http("POST", node0.url + "/generate", BATCH)
    assert status == 200 and len(out) == len(PROMPTS)
    assert node0.stop(signal.SIGTERM) in (0, -signal.SIGTERM)
    assert node1.wait_exit(timeout=EXIT_BOUND_S) == 0, node1.logs()
    assert "node 0 shut down" in node1.logs()


def test_a_worker_node_stops_on_sigterm_while_waiting_for_node0(tiny_runtime_model):
    """Node 1 started without a node 0 waits in the rendezvous; SIGTERM ends it at once (exit 0), its
    ranks included, instead of after the start-up timeout."""
    node1 = ServerProcess("--model-path", tiny_runtime_model, *TINY_FLAGS, "--tp-size", "2", "--nnodes", "2",
                          "--dist-init-addr", f"127.0.0.1:{free_port()}", "--node-rank", "1", "--log-level", "info")
    try:
        deadline = time.monotonic() + 60
        while "starting scheduler rank 1" not in node1.logs():
            assert node1.proc.poll() is None and time.monotonic() < deadline, node1.logs()
            time.sleep(0.1)
        time.sleep(1.0)
        start = time.monotonic()
        assert node1.stop(signal.SIGTERM, timeout=30) == 0, node1.logs()
        assert time.monotonic() - start < 15
        assert not node1.children()
    finally:
        node1.stop(signal.SIGKILL)


@pytest.mark.parametrize("two_nodes", [("--tp-size", "1", "--pp-size", "2")], indirect=True)
def test_pipeline_stages_on_two_nodes_match_one_process_then_stop_cleanly(two_nodes, tiny_server):
    """--pp-size 2 over two nodes: stage 0 on node 0, stage 1 on node 1 (every message between the stages
    crosses between the nodes); answers equal the one-process server's; a clean stop ends node 1 with 0."""
    node0, node1 = two_nodes
    assert_same_answers(node0.url, tiny_server.url, [BATCH, SEEDED])
    info = node0.wait_idle_and_pool_full()
    assert info["pp_size"] == 2 and [s["pp_rank"] for s in info["pp_stages"]] == [0, 1]
    assert node0.stop(signal.SIGTERM) in (0, -signal.SIGTERM)
    assert node1.wait_exit(timeout=EXIT_BOUND_S) == 0, node1.logs()
