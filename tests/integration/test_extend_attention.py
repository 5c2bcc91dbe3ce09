"""The `cpu` backend's native extend attention in the default dtype (bf16) against torch's: prefill at once,
in chunks on a cached prefix, and batched with other sequences, on a tiny Llama with SmolLM2's attention
shape. Both bf16 runs are measured against the same model in float32 (torch's attention), and the native
kernel's error must not exceed torch's own bf16 error by more than rounding noise."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch

from tests.forward_steps import ForwardSteps
from tokenloom.config import ServerArgs
from tokenloom.executor.model_runner import ModelRunner
from tokenloom.kernels import extend_attention
from tokenloom.layers.attention.cpu_paged import CpuExtendMetadata

pytestmark = pytest.mark.skipif(not extend_attention.available(torch.bfloat16, 3, 64),
                                reason="native extend attention unavailable here")


@pytest.fixture(scope="module")
def runs(tiny_model_dir):
    folder, _ = tiny_model_dir("llama_hd64")
    made = {}
    for name, dtype, backend in [("native", "bfloat16", "cpu"), ("torch", "bfloat16", "torch_native"),
                                 ("fp32", "float32", "torch_native")]:
        runner = ModelRunner(ServerArgs(model_path=folder, dtype=dtype, attention_backend=backend,
                                        max_total_tokens=4096, max_running_requests=8))
        made[name] = ForwardSteps(runner)
    assert made["native"].runner.attn_backend.native_extend
    assert not hasattr(made["torch"].runner.attn_backend, "native_extend")
    yield made
    for steps in made.values():
        assert steps.runner.token_allocator.available_size() == steps.runner.max_total_num_tokens


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _chunked(steps: ForwardSteps, tokens: list[int], cuts: list[int]) -> torch.Tensor:
    seq = steps.start()
    parts = [steps.extend([seq], [tokens[a:b]], return_all_logits=True) for a, b in pairwise(cuts)]
    steps.release(seq)
    return torch.cat(parts).float()


def _batched(steps: ForwardSteps) -> torch.Tensor:
    """Three sequences in one extend step: a fresh prompt, a continuation of a cached prefix, one token."""
    a, b, c = steps.start(), steps.start(), steps.start()
    steps.extend([b, c], [_tokens(90, 2), _tokens(33, 3)])
    out = steps.extend([a, b, c], [_tokens(61, 4), _tokens(17, 5), [7]], return_all_logits=True).float()
    for seq in (a, b, c):
        steps.release(seq)
    return out


SCENARIOS = {
    "at-once": lambda s: _chunked(s, _tokens(150, 0), [0, 150]),
    "chunks-on-prefix": lambda s: _chunked(s, _tokens(150, 0), [0, 40, 41, 150]),
    "past-a-key-chunk": lambda s: _chunked(s, _tokens(700, 1), [0, 600, 700]),
    "batched": _batched,
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_native_extend_as_accurate_as_torch(runs, scenario):
    seen = []
    original = runs["native"].runner.attn_backend.forward

    def spy(q, k, v, layer_id, scaling, batch, logit_cap=0.0):
        if batch.forward_mode.is_extend():
            seen.append(isinstance(batch.attn_metadata, CpuExtendMetadata))
        return original(q, k, v, layer_id, scaling, batch, logit_cap)

    runs["native"].runner.attn_backend.forward = spy
    try:
        native = SCENARIOS[scenario](runs["native"])
    finally:
        del runs["native"].runner.attn_backend.forward
    assert seen and all(seen)  # every attention call of the extend steps took the native kernel
    reference = SCENARIOS[scenario](runs["fp32"])
    torch_bf16 = SCENARIOS[scenario](runs["torch"])
    native_err = (native - reference).abs().max().item()
    torch_err = (torch_bf16 - reference).abs().max().item()
    assert native_err <= 1.5 * torch_err + 1e-3, (native_err, torch_err)
