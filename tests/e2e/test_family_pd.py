"""Model families as a prefill/decode pair (real servers, Mooncake transfers) behind SGLang's router, against
transformers float32 on the same tiny weights: a Gemma 3 (tests/gemma_models.py: window 12, sliding and global
layers) with the default sliding-window KV pool on both servers, so the transfer carries the sliding layers' pool
too, and a Qwen3-MoE with a dense layer (tests/moe_factory.py). One pair per model (each start costs seconds).

8-token prefill chunks, so a prompt past the window streams its KV in chunks while the prefill server drops the
sliding K/V of its oldest chunks; two prompts at once (one past the window, one that crosses it while decoding);
a follow-up turn (a radix hit on the prefill server, whose cached prefix has its sliding K/V only near its end).
Greedy tokens equal transformers' (teacher-forced on ours) and every prompt and output logprob is within 1e-4.
Afterwards both servers are idle with full pools, the sliding layers' pool included (the prefill server's after
a cache flush). The Gemma pair's decode server has a sliding-layer pool smaller than the follow-up turn: it
reserves sliding slots for the window's tail only (a too-small pool's refusal: tests/integration/
test_sliding_window_pool.py)."""

from __future__ import annotations

import threading

import pytest
import torch

from tests.e2e.server_process import ServerProcess, free_port, http
from tests.e2e.test_disaggregation import Router, _assert_idle_and_full
from tests.e2e.test_gemma_server import _check
from tests.gemma_models import WINDOW, _smollm2_tokenizer, make_tiny_gemma
from tests.moe_factory import make_tiny_moe

FLAGS = ("--dtype", "float32", "--chunked-prefill-size", "8", "--max-total-tokens", "2048",
         "--max-running-requests", "8", "--num-threads", "1", "--disaggregation-transfer-backend", "mooncake")
DECODE_SWA = 0.02  # the Gemma decode server's sliding-layer pool: 40 slots, fewer than the follow-up turn
PARAMS = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}


class Pair:
    def __init__(self, kind: str, folder: str, hf: torch.nn.Module, decode_flags: tuple[str, ...] = ()) -> None:
        self.kind, self.hf = kind, hf
        bootstrap = free_port()
        self.prefill = ServerProcess("--model-path", folder, *FLAGS, "--disaggregation-mode", "prefill",
                                     "--disaggregation-bootstrap-port", str(bootstrap))
        self.decode = ServerProcess("--model-path", folder, *FLAGS, "--disaggregation-mode", "decode", *decode_flags)
        self.router: Router | None = None
        try:
            self.prefill.wait_healthy()
            self.decode.wait_healthy()
            self.router = Router(self.prefill, bootstrap, self.decode).wait_ready()
        except BaseException:
            self.stop()
            raise

    def generate(self, prompts: list[list[int]], prompt_logprobs: bool = True) -> list[tuple[int, dict]]:
        """Every prompt sent at once (SGLang's router takes one prompt per /generate); `prompt_logprobs`: the
        prompt's too (computed in full: no radix hit then)."""
        assert self.router is not None
        replies: list = [None] * len(prompts)
        first = {"logprob_start_len": 0} if prompt_logprobs else {}

        def ask(i: int) -> None:
            replies[i] = http("POST", self.router.url + "/generate", {
                "input_ids": prompts[i], "return_logprob": True, **first, "sampling_params": PARAMS}, timeout=300)

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return replies

    def stop(self) -> None:
        if self.router is not None:
            self.router.stop()
        for server in (self.prefill, self.decode):
            server.stop()


@pytest.fixture(scope="module", params=["gemma3", "qwen3_moe_mixed"])
def pair(request, tmp_path_factory):
    kind = request.param
    folder = str(tmp_path_factory.mktemp(kind))
    if kind == "gemma3":
        p = Pair(kind, folder, make_tiny_gemma(kind, folder), ("--swa-full-tokens-ratio", str(DECODE_SWA)))
    else:  # the tokenizer the Gemma model read (reading SmolLM2's takes seconds)
        hf = make_tiny_moe(kind, folder, tokenizer=False)
        _smollm2_tokenizer().save_pretrained(folder)
        p = Pair(kind, folder, hf)
    yield p
    p.stop()


def test_pd_pair_matches_transformers(pair):
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 49152, (2 * WINDOW + 5,), generator=gen).tolist()
    crossing = torch.randint(3, 49152, (WINDOW - 4,), generator=gen).tolist()  # its window fills while decoding
    outs = []
    for ids, (status, out) in zip((prompt, crossing), pair.generate([prompt, crossing]), strict=True):
        assert status == 200, out
        _check(pair.hf, ids, out)
        outs.append(out)
    follow = prompt + outs[0]["output_ids"] + torch.randint(3, 49152, (4,), generator=gen).tolist()
    assert len(follow) > int(2048 * DECODE_SWA)  # the decode server reserves sliding slots for its window only
    status, out = pair.generate([follow], prompt_logprobs=False)[0]
    assert status == 200, out
    _check(pair.hf, follow, out)
    # the prefill server computed the prompt (not its first output token's KV): a hit on the prompt
    assert out["meta_info"]["cached_tokens"] >= len(prompt) - 1, out["meta_info"]
    for server in (pair.prefill, pair.decode):
        _assert_idle_and_full(server)
    decode = pair.decode.server_info()
    assert ("swa_max_total_num_tokens" in decode) == (pair.kind == "gemma3"), decode
    if pair.kind == "gemma3":  # the sliding-window pool is on for both servers, every slot free when idle
        assert decode["swa_available_kv_tokens"] == decode["swa_max_total_num_tokens"] == int(2048 * DECODE_SWA)
        assert http("POST", pair.prefill.url + "/flush_cache")[0] == 200
        prefill = pair.prefill.server_info()
        assert prefill["swa_available_kv_tokens"] == prefill["swa_max_total_num_tokens"] == int(2048 * 0.8)
        assert prefill["available_kv_tokens"] == prefill["max_total_num_tokens"], prefill

