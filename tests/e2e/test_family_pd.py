"""Model families as a prefill/decode pair (real servers, Mooncake transfers) behind SGLang's router, against
transformers float32 on the same tiny weights: a Gemma 3 (tests/gemma_models.py: window 12, sliding and global
layers) with the default sliding-window KV pool on both servers, so the transfer carries the sliding layers' pool
too, a Qwen3-MoE with a dense layer (tests/moe_factory.py), the dense Qwen3 (head_dim unlike hidden / heads, q/k
norms) and SmolLM3 (its layer 3 without RoPE) of tests/family_models.py, each with a 16-token window (Qwen3's
layer 1, from max_window_layers; SmolLM3's NoPE layer 3), so their transfers carry a sliding pool too, and a
Phi-4-mini-shaped Phi-3 (tests/phi3_factory.py: fused qkv and gate_up, partial rotary, LongRoPE with original
length 64). One pair per model (each start costs seconds).

8-token prefill chunks, so a prompt past the window streams its KV in chunks while the prefill server drops the
sliding K/V of its oldest chunks; two prompts at once (one past the window, one that crosses it while decoding);
a follow-up turn (a radix hit on the prefill server, whose cached prefix has its sliding K/V only near its end).
Greedy tokens equal transformers' (teacher-forced on ours) and every prompt and output logprob is within 1e-4.
Afterwards both servers are idle with full pools, the sliding layers' pool included (the prefill server's after
a cache flush). The Gemma pair's decode server has a sliding-layer pool smaller than the follow-up turn: it
reserves sliding slots for the window's tail only (a too-small pool's refusal: tests/integration/
test_sliding_window_pool.py). The Phi-3's first prompt is past the original length (long factors for every
token, on both servers), its second crosses it while decoding: the transferred KV was computed with the short
factors, the decode server's steps past 64 take the long ones (checked against transformers' forward with its
cache, step by step: tests/phi3_factory.py `hf_greedy_stepwise`)."""

from __future__ import annotations

import threading

import pytest
import torch

from tests.e2e.server_process import ServerProcess, free_port, http
from tests.e2e.test_disaggregation import Router, _assert_idle_and_full
from tests.e2e.test_gemma_server import TOL, _check
from tests.family_models import make_variant, smollm2_tokenizer
from tests.gemma_models import WINDOW, make_tiny_gemma
from tests.moe_factory import make_tiny_moe
from tests.phi3_factory import ORIG, hf_greedy_stepwise, make_tiny_phi3

FLAGS = ("--dtype", "float32", "--chunked-prefill-size", "8", "--max-total-tokens", "2048",
         "--max-running-requests", "8", "--num-threads", "1", "--disaggregation-transfer-backend", "mooncake")
DECODE_SWA = 0.02  # the Gemma decode server's sliding-layer pool: 40 slots, fewer than the follow-up turn
PARAMS = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}


class Pair:
    def __init__(self, kind: str, folder: str, hf: torch.nn.Module, decode_flags: tuple[str, ...] = (),
                 lengths: tuple[int, int] = (2 * WINDOW + 5, WINDOW - 4)) -> None:
        """`lengths`: of the two prompts sent at once."""
        self.kind, self.hf, self.lengths = kind, hf, lengths
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


@pytest.fixture(scope="module", params=["gemma3", "qwen3_moe_mixed", "qwen3_swa", "smollm3_swa", "phi3_longrope"])
def pair(request, tmp_path_factory):
    kind = request.param
    folder = str(tmp_path_factory.mktemp(kind))
    if kind == "gemma3":
        p = Pair(kind, folder, make_tiny_gemma(kind, folder), ("--swa-full-tokens-ratio", str(DECODE_SWA)))
    elif kind == "qwen3_moe_mixed":  # the tokenizer read once for the module (reading SmolLM2's takes seconds)
        hf = make_tiny_moe(kind, folder, tokenizer=False)
        smollm2_tokenizer().save_pretrained(folder)
        p = Pair(kind, folder, hf)
    elif kind == "phi3_longrope":  # past the original length; the second crosses it while decoding
        hf = make_tiny_phi3(folder, "phi4mini_longrope_partial", smollm2_tokenizer=True)
        p = Pair(kind, folder, hf, lengths=(ORIG + 6, ORIG - 4))
    else:
        p = Pair(kind, folder, make_variant(kind, folder))
    yield p
    p.stop()


def _check_stepwise(hf: torch.nn.Module, prompt: list[int], out: dict) -> None:
    """A Phi-3 sequence that crosses the original length while decoding: the output tokens and logprobs are
    transformers' forward with its cache, one step at a time (each step's factors from its own length); the
    prompt's logprobs its forward on the prompt alone (within the original length: short factors)."""
    tokens, logprobs = hf_greedy_stepwise(hf, prompt, len(out["output_ids"]))
    assert out["output_ids"] == tokens
    got = [e[0] for e in out["meta_info"]["output_token_logprobs"]]
    assert max(abs(a - b) for a, b in zip(got, logprobs, strict=True)) < TOL
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    got_in = torch.tensor([e[0] for e in out["meta_info"]["input_token_logprobs"][1:]])
    assert (got_in - ref[range(len(prompt) - 1), prompt[1:]]).abs().max().item() < TOL


def test_pd_pair_matches_transformers(pair):
    gen = torch.Generator().manual_seed(0)
    # the second prompt crosses its window (original length for Phi-3) while decoding
    prompt, crossing = (torch.randint(3, 49152, (n,), generator=gen).tolist() for n in pair.lengths)
    outs = []
    for ids, (status, out) in zip((prompt, crossing), pair.generate([prompt, crossing]), strict=True):
        assert status == 200, out
        if pair.kind == "phi3_longrope" and ids is crossing:
            assert len(ids) < ORIG < len(ids) + len(out["output_ids"])
            _check_stepwise(pair.hf, ids, out)
        else:
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
    sliding = pair.kind in ("gemma3", "qwen3_swa", "smollm3_swa")
    assert ("swa_max_total_num_tokens" in decode) == sliding, decode
    if sliding:  # the sliding-window pool is on for both servers, every slot free when idle
        ratio = DECODE_SWA if pair.kind == "gemma3" else 0.8  # else the default --swa-full-tokens-ratio
        assert decode["swa_available_kv_tokens"] == decode["swa_max_total_num_tokens"] == int(2048 * ratio)
        assert http("POST", pair.prefill.url + "/flush_cache")[0] == 200
        prefill = pair.prefill.server_info()
        assert prefill["swa_available_kv_tokens"] == prefill["swa_max_total_num_tokens"] == int(2048 * 0.8)
        assert prefill["available_kv_tokens"] == prefill["max_total_num_tokens"], prefill
