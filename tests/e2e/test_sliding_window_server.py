"""A sliding-window model through the HTTP server against transformers float32: a tiny Mistral (window 16,
SmolLM2's tokenizer) served with 16-token prefill chunks, so chunks cross the window boundary; greedy tokens
and every prompt and output logprob equal transformers' within 1e-4, on a cold prompt, the same prompt again
(a radix hit) and a prompt sharing a prefix with it (a partial hit); the pool is full again afterwards."""

from __future__ import annotations

import os

import pytest
import torch

from tests.e2e.server_process import ServerProcess, http
from tests.model_factory import TINY

WINDOW = 16


def make_window_mistral_with_smollm2_tokenizer(folder: str, window: int = WINDOW, seed: int = 0) -> str:
    import transformers

    from tokenloom.config import ServerArgs
    from tokenloom.models.loader import resolve_model_source
    from tokenloom.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model_source(ServerArgs()))
    config = transformers.MistralConfig(**{**TINY, "vocab_size": 49152, "bos_token_id": 1, "eos_token_id": 2,
                                           "tie_word_embeddings": True, "sliding_window": window})
    torch.manual_seed(seed)
    model = transformers.MistralForCausalLM(config).eval()
    os.makedirs(folder, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def window_server(tmp_path_factory):
    folder = make_window_mistral_with_smollm2_tokenizer(str(tmp_path_factory.mktemp("window_mistral")))
    server = ServerProcess("--model-path", folder, "--dtype", "float32", "--chunked-prefill-size", "16",
                           "--max-total-tokens", "4096", "--max-running-requests", "8", "--num-threads", "1"
                           ).wait_healthy()
    yield server, folder
    server.stop()


def _check_against_transformers(hf: torch.nn.Module, prompt: list[int], meta: dict, output_ids: list[int]) -> None:
    ids = prompt + output_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    n = len(prompt)
    assert output_ids == ref[n - 1: -1].argmax(-1).tolist()  # greedy, teacher-forced on our tokens
    if meta.get("input_token_logprobs"):
        got_in = torch.tensor([e[0] for e in meta["input_token_logprobs"][1:]])
        assert torch.allclose(got_in, ref[range(n - 1), prompt[1:]], atol=1e-4)
    got_out = torch.tensor([e[0] for e in meta["output_token_logprobs"]])
    assert torch.allclose(got_out, ref[range(n - 1, len(ids) - 1), output_ids], atol=1e-4)


def test_window_model_serves_transformers_tokens_and_logprobs(window_server):
    from transformers import AutoModelForCausalLM

    server, folder = window_server
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 49152, (45,), generator=gen).tolist()
    other = prompt[:37] + torch.randint(3, 49152, (12,), generator=gen).tolist()
    cached = []
    for i, ids in enumerate((prompt, prompt, other)):  # prompt logprobs on the first (they skip the cache)
        status, out = http("POST", server.url + "/generate", {
            "input_ids": ids, "return_logprob": True, "logprob_start_len": 0 if i == 0 else -1,
            "sampling_params": {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}})
        assert status == 200, out
        _check_against_transformers(hf, ids, out["meta_info"], out["output_ids"])
        cached.append(out["meta_info"]["cached_tokens"])
    assert cached[0] == 0 and cached[1] > 0 and cached[2] > 0, cached  # the radix cache served a prefix
    server.wait_idle_and_pool_full()
