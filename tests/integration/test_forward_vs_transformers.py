"""tokenloom's forward against transformers on the same weights: logits agree, argmax equal."""

from __future__ import annotations

import pytest
import torch

from tests.forward_steps import ForwardSteps
from tests.model_factory import VARIANTS
from tests.scheduler_harness import generate_in_process
from tokenloom.config import ServerArgs
from tokenloom.executor.model_runner import ModelRunner


def _runner(folder: str, **kw) -> ModelRunner:
    args = dict(model_path=folder, dtype="float32", max_total_tokens=2048, max_running_requests=8)
    return ModelRunner(ServerArgs(**{**args, **kw}))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_tiny_model_logits_match_transformers(tiny_model_dir, variant):
    folder, hf = tiny_model_dir(variant)
    runner = _runner(folder)
    steps = ForwardSteps(runner)
    gen = torch.Generator().manual_seed(1)
    lengths = [37, 5, 100]  # one batch of different lengths (and > the llama3 original context of 64)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lengths]
    seqs = [steps.start() for _ in prompts]
    logits = steps.extend(seqs, prompts, return_all_logits=True)
    ours = torch.split(logits, lengths)
    for prompt, mine in zip(prompts, ours, strict=True):
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0].float()
        assert (mine - ref).abs().max().item() < 2e-4
        assert torch.equal(mine.argmax(-1), ref.argmax(-1))
    for s in seqs:
        steps.release(s)
    assert runner.token_allocator.available_size() == runner.max_total_num_tokens


def test_tiny_model_greedy_generation_matches_transformers(tiny_model_dir):
    folder, hf = tiny_model_dir("qwen2")
    runner = _runner(folder)
    prompt = list(range(3, 40))
    ours = generate_in_process(runner, [prompt], [{"temperature": 0, "max_new_tokens": 20, "ignore_eos": True}])[0]
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(20):
            ids = torch.cat((ids, hf(ids).logits[:, -1].argmax(-1, keepdim=True)), dim=1)
    assert ours == ids[0, len(prompt):].tolist()


def test_smollm2_gguf_logits_match_transformers(smollm2_runner_fp32, smollm2_hf_reference):
    from tokenloom.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(smollm2_runner_fp32.source)
    prompt = tokenizer("The capital city of France is Paris. The capital city of Germany is").input_ids
    steps = ForwardSteps(smollm2_runner_fp32)
    seq = steps.start()
    mine = steps.extend([seq], [prompt], return_all_logits=True)
    steps.release(seq)
    with torch.no_grad():
        ref = smollm2_hf_reference(torch.tensor([prompt])).logits[0].float()
    assert (mine - ref).abs().max().item() < 2e-3
    assert torch.equal(mine.argmax(-1), ref.argmax(-1))


def test_smollm2_greedy_continuation_matches_transformers(smollm2_runner_fp32, smollm2_hf_reference):
    from tokenloom.tokenizer import eos_token_ids, load_tokenizer

    tokenizer = load_tokenizer(smollm2_runner_fp32.source)
    prompt = tokenizer("Once upon a time, in a small village,").input_ids
    params = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    ours = generate_in_process(smollm2_runner_fp32, [prompt], [params],
                               eos_token_ids(smollm2_runner_fp32.source, tokenizer))[0]
    with torch.no_grad():
        ref = smollm2_hf_reference.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                                            eos_token_id=None)[0, len(prompt):].tolist()
    assert ours == ref
