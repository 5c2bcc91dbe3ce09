"""Seed 001's stress shape scaled to this machine: prefill PP=2 → decode PP=2 over Mooncake behind SGLang's
router, many concurrent long-output requests, a decode pool far smaller than their KV and an optimistic
admission (`--schedule-conservativeness 0.1`, a small decode reservation), so decode requests retract to host
memory and resume again and again. SGLang left 118 of 256 such requests unfinished after 30 minutes; here
every request must finish, with the unified server's greedy tokens, and both pools end full.

Short form by default (CI); `TOKENLOOM_TEST_LONG=1` runs the long form (more and longer requests)."""

from __future__ import annotations

import os
import random
import threading

from tests.e2e.conftest import TINY_FLAGS
from tests.e2e.server_process import ServerProcess, free_port, http
from tests.e2e.test_disaggregation import Router, _assert_idle_and_full

LONG = os.environ.get("TOKENLOOM_TEST_LONG") == "1"
NUM_REQUESTS, INPUT_LEN, OUTPUT_LEN = (64, 300, 400) if LONG else (12, 120, 100)
DECODE_TOKENS = 2048 if LONG else 700


def test_pp2_to_pp2_under_retraction_stress_finishes_every_request(tiny_server, tiny_runtime_model):
    rng = random.Random(1)
    prompts = [[rng.randrange(100, 40000) for _ in range(int(INPUT_LEN * rng.uniform(0.9, 1.0)))]
               for _ in range(NUM_REQUESTS)]
    outputs = [int(OUTPUT_LEN * rng.uniform(0.9, 1.0)) for _ in range(NUM_REQUESTS)]
    bootstrap = free_port()
    prefill = ServerProcess("--model-path", tiny_runtime_model, *TINY_FLAGS, "--pp-size", "2",
                            "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(bootstrap))
    decode = ServerProcess("--model-path", tiny_runtime_model, *TINY_FLAGS, "--pp-size", "2",
                           "--disaggregation-mode", "decode", "--max-total-tokens", str(DECODE_TOKENS),
                           "--num-reserved-decode-tokens", "8", "--schedule-conservativeness", "0.1")
    router = None
    try:
        prefill.wait_healthy()
        decode.wait_healthy()
        router = Router(prefill, bootstrap, decode).wait_ready()
        answers: list = [None] * NUM_REQUESTS

        def ask(i: int) -> None:
            body = {"input_ids": prompts[i], "sampling_params": {"temperature": 0, "max_new_tokens": outputs[i],
                                                                 "ignore_eos": True}}
            answers[i] = http("POST", router.url + "/generate", body, timeout=1800)

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(NUM_REQUESTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        unfinished = [i for i, a in enumerate(answers) if a is None or a[0] != 200]
        assert not unfinished, [answers[i] for i in unfinished[:3]]
        want = http("POST", tiny_server.url + "/generate", {
            "input_ids": prompts, "sampling_params": [{"temperature": 0, "max_new_tokens": n, "ignore_eos": True}
                                                      for n in outputs]}, timeout=1800)[1]
        for i, (_, out) in enumerate(answers):
            assert out["output_ids"] == want[i]["output_ids"], i
        info = decode.server_info()
        assert info["num_offloaded_reqs"] > 0, info  # the stress did retract
        _assert_idle_and_full(prefill)
        _assert_idle_and_full(decode)
    finally:
        if router is not None:
            router.stop()
        for server in (prefill, decode):
            server.stop()
