"""Mixture-of-experts models served over HTTP equal transformers: greedy tokens and their logprobs (float32,
|diff| < 1e-4) for Qwen3-MoE (with a dense layer), Qwen2-MoE (shared expert), OLMoE (whole-projection q/k
norm) under TP=2 (each rank a slice of every expert), EP=2 (--ep-size / --enable-ep-moe:
whole experts per rank) and PP=2. The prompts are longer than --chunked-prefill-size (chunked prefill) and
the second round repeats them (a radix-cache hit, checked through cached_tokens)."""

from __future__ import annotations

import pytest
import torch

from tests.e2e.server_process import ServerProcess, free_port, http
from tests.moe_factory import make_tiny_moe

FLAGS = ("--dtype", "float32", "--max-total-tokens", "4096", "--max-running-requests", "8",
         "--chunked-prefill-size", "16", "--num-threads", "1")
NEW_TOKENS = 8
LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module")
def moe_folders(tmp_path_factory):
    cache: dict[str, tuple[str, torch.nn.Module]] = {}

    def get(family: str) -> tuple[str, torch.nn.Module]:
        if family not in cache:
            folder = str(tmp_path_factory.mktemp(family))
            cache[family] = (folder, make_tiny_moe(family, folder))
        return cache[family]

    return get


def _reference(hf: torch.nn.Module, prompt: list[int]) -> tuple[list[int], list[float]]:
    ids, logprobs = torch.tensor([prompt]), []
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            lp = torch.log_softmax(hf(ids).logits[0, -1].float(), -1)
            nxt = int(lp.argmax())
            logprobs.append(float(lp[nxt]))
            ids = torch.cat([ids, torch.tensor([[nxt]])], 1)
    return ids[0, len(prompt):].tolist(), logprobs


# (unsplit: tests/integration/test_moe_models.py, in process; a server start is the cost here. --ep-size 2 is
# --enable-ep-moe's expert split: tests/unit/test_config.py checks the two flags mean the same)
CASES = [
    ("qwen3_moe_mixed", ("--tp-size", "2")),
    ("qwen3_moe_mixed", ("--pp-size", "2")),
    ("qwen2_moe", ("--tp-size", "2", "--enable-ep-moe")),
    ("olmoe", ("--tp-size", "2")),
]


@pytest.mark.parametrize("family,flags", CASES, ids=[f"{f}{''.join(x)}" for f, x in CASES])
def test_moe_server_matches_transformers(moe_folders, family, flags):
    folder, hf = moe_folders(family)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in (37, 21)]
    expected = [_reference(hf, p) for p in prompts]
    server = ServerProcess("--model-path", folder, *FLAGS, *flags,
                           "--dist-init-addr", f"127.0.0.1:{free_port()}").wait_healthy()
    try:
        body = {"input_ids": prompts, "return_logprob": True,
                "sampling_params": {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}}
        for round_ in range(2):  # the second round hits the radix cache
            status, out = http("POST", server.url + "/generate", body)
            assert status == 200, out
            for prompt, answer, (tokens, logprobs) in zip(prompts, out, expected, strict=True):
                got = answer["meta_info"]["output_token_logprobs"]
                assert [t for _, t, *_ in got] == tokens, (family, flags, round_)
                assert max(abs(lp - ref) for (lp, *_), ref in zip(got, logprobs, strict=True)) < LOGPROB_TOL
                if round_:
                    assert answer["meta_info"]["cached_tokens"] >= len(prompt) - 1
        assert "Traceback" not in server.logs()
    finally:
        server.stop()


def test_ep_size_that_cannot_split_the_experts_is_refused(moe_folders):
    """--ep-size must divide the experts (8 here: 3 ranks cannot) and equal --tp-size."""
    from tokenloom.config import ConfigError, ServerArgs, check_parallel_fits
    from tokenloom.models.loader import resolve_model_source

    folder, _ = moe_folders("qwen3_moe")
    with pytest.raises(ConfigError, match="--ep-size 2 must be 1 or equal to --tp-size"):
        ServerArgs(model_path=folder, ep_size=2)
    args = ServerArgs(model_path=folder, tp_size=3, ep_size=3)
    with pytest.raises(ConfigError, match="--ep-size 3 cannot split the model's 8 experts"):
        check_parallel_fits(args, resolve_model_source(args).config)
