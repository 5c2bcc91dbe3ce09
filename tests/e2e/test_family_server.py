"""Qwen3 and SmolLM3 served over HTTP (a real `launch_server` subprocess) from tiny random checkpoints
(tests/family_models.py), against transformers' own float32 model on the same weights:

- /generate greedy tokens equal transformers' greedy continuation and every output logprob is within 1e-4 of
  transformers' log-softmax (fp32; the logits agree to ~1e-6, so a greedy tie is not a concern), with
  --chunked-prefill-size 16 (the 40-token prompt runs in three chunks) and a radix hit (the second prompt shares
  32 tokens with the first and reports them cached), at TP=2 (4 q heads, 2 kv heads: one kv head per
  rank) and PP=2 (Qwen3: one layer per stage; SmolLM3: its NoPE layer 3 on the second stage);
- the checkpoint's own chat template through the `openai` client, with `chat_template_kwargs` passed through:
  the Qwen3-style template renders `enable_thinking` False with an empty think block, so the prompt is longer
  by exactly those tokens, and each answer equals transformers' greedy continuation of that rendering.
"""

from __future__ import annotations

import openai
import pytest
import torch

from tests.e2e.server_process import ServerProcess, http

FLAGS = ("--dtype", "float32", "--chunked-prefill-size", "16", "--max-total-tokens", "4096",
         "--max-running-requests", "4", "--num-threads", "1")
# (TP=1: the same models in process, tests/integration/test_family_forward.py; a server start is the cost here)
LAYOUTS = {"tp2": ("--tp-size", "2"), "pp2": ("--pp-size", "2")}
NEW = 8
CHAT = [{"role": "user", "content": "Tell me about the weather in the mountains."}]


@pytest.fixture(scope="module", params=[(f, lay) for f in ("qwen3", "smollm3") for lay in LAYOUTS],
                ids=lambda p: f"{p[0]}-{p[1]}")
def served(request, family_model_dir):
    family, layout = request.param
    folder, hf = family_model_dir(family)
    server = ServerProcess("--model-path", folder, *FLAGS, *LAYOUTS[layout]).wait_healthy()
    try:
        yield family, server, hf, folder
        server.wait_idle_and_pool_full()
    finally:
        server.stop()
    assert not server.children()


def _greedy(hf: torch.nn.Module, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    ids, logprobs = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            logp = hf(torch.tensor([ids])).logits[0, -1].float().log_softmax(-1)
            ids.append(int(logp.argmax()))
            logprobs.append(logp[ids[-1]].item())
    return ids[len(prompt):], logprobs


def test_greedy_tokens_and_logprobs_match_transformers(served):
    _, server, hf, _ = served
    gen = torch.Generator().manual_seed(7)
    first = torch.randint(3, 49152, (40,), generator=gen).tolist()
    second = first[:32] + torch.randint(3, 49152, (9,), generator=gen).tolist()
    for i, prompt in enumerate((first, second)):
        body = {"input_ids": prompt, "return_logprob": True,
                "sampling_params": {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True}}
        status, out = http("POST", server.url + "/generate", body)
        assert status == 200, out
        want_ids, want_lps = _greedy(hf, prompt, NEW)
        assert out["output_ids"] == want_ids
        got_lps = [lp[0] for lp in out["meta_info"]["output_token_logprobs"]]
        assert got_lps == pytest.approx(want_lps, abs=1e-4)
        if i == 1:  # the shared 32 tokens come from the radix cache
            assert out["meta_info"]["cached_tokens"] >= 32, out["meta_info"]


def test_checkpoint_chat_template_and_kwargs(served):
    from transformers import AutoTokenizer

    family, server, hf, folder = served
    tokenizer = AutoTokenizer.from_pretrained(folder)
    answers = {}
    with openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0) as client:
        for thinking in (True, False):
            out = client.chat.completions.create(
                model="default", messages=CHAT, max_tokens=6, temperature=0,
                extra_body={"chat_template_kwargs": {"enable_thinking": thinking}, "ignore_eos": True})
            ids = tokenizer(tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True,
                                                          enable_thinking=thinking),
                            add_special_tokens=False).input_ids
            assert out.usage.prompt_tokens == len(ids)
            want, _ = _greedy(hf, ids, 6)
            assert out.choices[0].message.content == tokenizer.decode(want, skip_special_tokens=True)
            answers[thinking] = (ids, out.choices[0].message.content)
    if family == "qwen3":  # the Qwen3-style template: thinking off adds an empty think block
        on, off = answers[True][0], answers[False][0]
        assert off[:len(on)] == on
        assert tokenizer.decode(off[len(on):]) == "<think>\n\n</think>\n\n"
    else:  # SmolLM2's template has no thinking switch: the kwarg changes nothing
        assert answers[True] == answers[False]
