"""A tiny Phi-4-mini-shaped model (fused qkv / gate_up, LongRoPE with original length 64, partial rotary 0.75,
SmolLM2's vocabulary) served over HTTP in float32: greedy tokens and logprobs equal transformers' on the same
weights (its forward with its cache, step by step; tests/phi3_factory.py `hf_greedy_stepwise` says where
transformers.generate differs), with chunked prefill (32) splitting a prompt past the original length (long
factors for every token), a prompt whose decoding crosses it (short, then long), and a radix hit on a cached
long prefix; then the same answers at --tp-size 2 (each rank's shard of the fused q, k, v and gate, up) and
--pp-size 2."""

from __future__ import annotations

import pytest
import torch

from tests.e2e.server_process import ServerProcess, free_port, http
from tests.phi3_factory import ORIG, hf_greedy_stepwise, make_tiny_phi3

FLAGS = ("--dtype", "float32", "--chunked-prefill-size", "32", "--max-total-tokens", "4096",
         "--max-running-requests", "8", "--num-threads", "1")
NEW = 24
LOGPROB_TOL = 1e-4  # float32, 2 layers: observed ~1e-6


@pytest.fixture(scope="module")
def phi3_model(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("phi3_served"))
    hf = make_tiny_phi3(folder, "phi4mini_longrope_partial", smollm2_tokenizer=True)
    gen = torch.Generator().manual_seed(7)
    long_prompt = torch.randint(3, 49152, (150,), generator=gen).tolist()
    prompts = {"long": long_prompt, "crossing": torch.randint(3, 49152, (ORIG - 20,), generator=gen).tolist(),
               "long_shared": long_prompt[:130] + torch.randint(3, 49152, (30,), generator=gen).tolist()}
    refs = {key: hf_greedy_stepwise(hf, prompt, NEW) for key, prompt in prompts.items()}
    with torch.no_grad():  # past the original length from the start: transformers.generate agrees
        assert hf.generate(torch.tensor([long_prompt]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(long_prompt):].tolist() == refs["long"][0]
    assert len(set(refs["long"][0])) > 3  # the greedy path is not one repeated token
    return folder, prompts, refs


def _generate(url: str, prompts: list[list[int]]) -> list[dict]:
    status, body = http("POST", url + "/generate", {
        "input_ids": prompts, "return_logprob": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True}}, timeout=300)
    assert status == 200, body
    return body


def _check(outs: list[dict], keys: list[str], refs: dict) -> None:
    for key, out in zip(keys, outs, strict=True):
        tokens, logprobs = refs[key]
        got = out["meta_info"]["output_token_logprobs"]
        assert out["output_ids"] == tokens, key
        assert [t for _, t, *_ in got] == tokens
        worst = max(abs(lp - ref) for (lp, *_), ref in zip(got, logprobs, strict=True))
        assert worst < LOGPROB_TOL, (key, worst)


def _serve_and_check(folder: str, prompts: dict, refs: dict, *extra: str) -> dict:
    server = ServerProcess("--model-path", folder, *FLAGS, *extra).wait_healthy()
    try:
        _check(_generate(server.url, [prompts["long"], prompts["crossing"]]), ["long", "crossing"], refs)
        again = _generate(server.url, [prompts["long_shared"]])  # its first 128 tokens are cached (page-aligned)
        assert again[0]["meta_info"]["cached_tokens"] >= 96, again[0]["meta_info"]
        _check(again, ["long_shared"], refs)
        return server.wait_idle_and_pool_full()
    finally:
        server.stop()


def test_phi3_server_matches_transformers_chunked_and_radix(phi3_model):
    folder, prompts, refs = phi3_model
    _serve_and_check(folder, prompts, refs)


def test_phi3_server_tp2_matches_transformers(phi3_model):
    folder, prompts, refs = phi3_model
    info = _serve_and_check(folder, prompts, refs, "--tp-size", "2", "--dist-init-addr", f"127.0.0.1:{free_port()}")
    assert info["tp_size"] == 2 and info["tp_ranks_agree"] is True


def test_phi3_server_pp2_matches_transformers(phi3_model):
    folder, prompts, refs = phi3_model
    info = _serve_and_check(folder, prompts, refs, "--pp-size", "2")
    assert info["pp_size"] == 2
