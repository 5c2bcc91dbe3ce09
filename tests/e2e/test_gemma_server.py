"""Gemma 2 and Gemma 3 (text) through the HTTP server against transformers float32 on the same tiny weights
(tests/gemma_models.py: window 12, soft-caps that bind, q/k norms, local/global RoPE), Gemma 2 unsplit and
under TP=2 (its soft-capped heads split), Gemma 3 under PP=2 (three servers: each start costs seconds of CI;
the other pairings run the same layers). 8-token prefill chunks (chunks cross the window boundary), a
batch of two prompts past the window, a follow-up turn on the first (a radix hit) and a prompt sharing a
prefix with it. Greedy tokens equal transformers' (teacher-forced on ours) and every prompt and
output logprob is within 1e-4 (the in-process logits differ by ~5e-6); the pool is full afterwards."""

from __future__ import annotations

import pytest
import torch

from tests.e2e.server_process import ServerProcess, free_port, http
from tests.gemma_models import WINDOW, make_tiny_gemma

TOL = 1e-4
PARALLEL = {"unsplit": (), "tp2": ("--tp-size", "2"), "pp2": ("--pp-size", "2")}
CASES = [("gemma2", "unsplit"), ("gemma2", "tp2"), ("gemma3", "pp2")]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """kind -> (folder, transformers model), built on first use."""
    built: dict[str, tuple[str, torch.nn.Module]] = {}

    def get(kind: str) -> tuple[str, torch.nn.Module]:
        if kind not in built:
            folder = str(tmp_path_factory.mktemp(kind))
            built[kind] = (folder, make_tiny_gemma(kind, folder))
        return built[kind]
    return get


def _check(hf: torch.nn.Module, prompt: list[int], out: dict) -> None:
    ids, output_ids, meta = prompt + out["output_ids"], out["output_ids"], out["meta_info"]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    n = len(prompt)
    assert output_ids == ref[n - 1: -1].argmax(-1).tolist()  # greedy, teacher-forced on our tokens
    if meta.get("input_token_logprobs"):
        got_in = torch.tensor([e[0] for e in meta["input_token_logprobs"][1:]])
        assert (got_in - ref[range(n - 1), prompt[1:]]).abs().max().item() < TOL
    got_out = torch.tensor([e[0] for e in meta["output_token_logprobs"]])
    assert (got_out - ref[range(n - 1, len(ids) - 1), output_ids]).abs().max().item() < TOL


@pytest.mark.parametrize(("kind", "parallel"), CASES)
def test_gemma_server_matches_transformers(models, kind, parallel):
    folder, hf = models(kind)
    server = ServerProcess("--model-path", folder, "--dtype", "float32", "--chunked-prefill-size", "8",
                           "--max-total-tokens", "2048", "--max-running-requests", "8", "--num-threads", "1",
                           "--dist-init-addr", f"127.0.0.1:{free_port()}", *PARALLEL[parallel])
    try:
        server.wait_healthy()  # inside the try: a server that fails to start is stopped too
        gen = torch.Generator().manual_seed(0)
        prompt = torch.randint(3, 49152, (2 * WINDOW + 5,), generator=gen).tolist()
        second = torch.randint(3, 49152, (WINDOW + 3,), generator=gen).tolist()
        other = prompt[:WINDOW + 8] + torch.randint(3, 49152, (7,), generator=gen).tolist()
        params = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}
        status, outs = http("POST", server.url + "/generate", {
            "input_ids": [prompt, second], "return_logprob": True, "logprob_start_len": 0, "sampling_params": params})
        assert status == 200, outs
        for ids, out in zip((prompt, second), outs, strict=True):
            _check(hf, ids, out)
        # A follow-up turn (the first exchange, then more) continues where the cached sequence ends, whose
        # window the sliding-window pool keeps: a radix hit. A prompt sharing only part of it ends where the
        # sliding KV was dropped (no hit with the default hybrid pool); right either way.
        follow = prompt + outs[0]["output_ids"] + torch.randint(3, 49152, (4,), generator=gen).tolist()
        cached = []
        for ids in (follow, other):
            status, out = http("POST", server.url + "/generate", {
                "input_ids": ids, "return_logprob": True, "sampling_params": params})
            assert status == 200, out
            _check(hf, ids, out)
            cached.append(out["meta_info"]["cached_tokens"])
        assert cached[0] >= len(prompt) + len(outs[0]["output_ids"]) - 1, cached
        server.wait_idle_and_pool_full()
    finally:
        server.stop()
