"""The default configuration's numerics (no dtype: bfloat16 on the CPU, the one-call native decode step, the
`cpu` attention backend) against transformers float32 on the real SmolLM2, teacher-forced. The weights are
dequantized at load (`--quantization none`): this is about the float path's bf16 roundings, which the file's
weights kept quantized (the default for a .gguf) would mix with their own; those have their test in
test_quantized_gguf.py.

bf16 logits never equal fp32 ones, so the metric is a distance fit for bf16: over the same few hundred
positions of a fixed local text (Python's own `pydoc_data.topics`), the mean KL(fp32 || ours) per position
and the top-1 agreement with fp32. The bound is transformers' own bf16 model on the same weights and positions
(computed here, the fp32 reference cast to bf16: the state dict equals `from_pretrained(dtype=bfloat16)`'s and
costs ~1 s instead of ~13): ours must be at least as close to fp32 as it is. The absolute bounds are a guard
should the reference itself drift: measured on 4 x 128 positions (2 cores, torch 2.13), transformers bf16 has
KL 0.0014 and top-1 0.969; tokenloom's prefill path KL 0.00031 / top-1 0.994, its decode path (native step,
batch 4) KL 0.00036 / top-1 0.992 (on 16 x 256 positions: 0.00125 / 0.970 against 0.00030 / 0.990). Before
the float32 residual stream and LM-head sums (commit d7c6e03) the default answered the README's chat example
wrongly.
"""

from __future__ import annotations

import copy
import pydoc_data.topics

import pytest
import torch

from tests.forward_steps import ForwardSteps
from tokenloom.config import ServerArgs
from tokenloom.executor.model_runner import ModelRunner
from tokenloom.layers import cpu_gemm
from tokenloom.layers.attention.cpu_paged import CpuPagedBackend
from tokenloom.tokenizer import load_tokenizer

pytestmark = pytest.mark.slow

SEQS, LENGTH = 4, 128  # 512 positions; 4 = the native step's batch limit without AMX
MAX_KL, MIN_TOP1 = 1e-3, 0.975  # absolute: ~3x our measured KL, and 2.5x our measured disagreements


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    """The default configuration: no dtype, backend or decode flags (only a small KV pool), weights dequantized."""
    return ModelRunner(ServerArgs(quantization="none", max_total_tokens=2048, max_running_requests=SEQS))


@pytest.fixture(scope="module")
def prompts(runner) -> list[list[int]]:
    """SEQS windows of LENGTH tokens spread over the text (it ships with Python: nothing is downloaded)."""
    text = "\n\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
    ids = load_tokenizer(runner.source)(text).input_ids
    stride = len(ids) // SEQS
    assert stride >= LENGTH
    return [ids[i * stride: i * stride + LENGTH] for i in range(SEQS)]


@pytest.fixture(scope="module")
def references(smollm2_hf_reference, prompts) -> dict[str, torch.Tensor]:
    """transformers' logits [SEQS, LENGTH, vocab] in float32 and in bfloat16 (its bf16 model is freed after)."""
    bf16 = copy.deepcopy(smollm2_hf_reference).to(torch.bfloat16)
    with torch.no_grad():
        ids = torch.tensor(prompts)
        out = {"fp32": smollm2_hf_reference(ids).logits.float(), "bf16": bf16(ids).logits.float()}
    del bf16
    return out


def _distance(logits: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(mean KL(ref || logits) per position, top-1 agreement) over all positions."""
    log_ref, log_got = ref.log_softmax(-1), logits.float().log_softmax(-1)
    kl = (log_ref.exp() * (log_ref - log_got)).sum(-1)
    return kl.mean().item(), (logits.argmax(-1) == ref.argmax(-1)).float().mean().item()


def _check(name: str, logits: torch.Tensor, references: dict[str, torch.Tensor]) -> None:
    assert logits.shape == references["fp32"].shape and logits.dtype == torch.float32
    ref_kl, ref_top1 = _distance(references["bf16"], references["fp32"])
    assert ref_kl < 5e-3 and ref_top1 > 0.9, f"transformers bf16 itself is off: KL {ref_kl}, top-1 {ref_top1}"
    kl, top1 = _distance(logits, references["fp32"])
    summary = f"{name}: KL {kl:.5f}, top-1 {top1:.4f}; transformers bf16: KL {ref_kl:.5f}, top-1 {ref_top1:.4f}"
    assert kl <= ref_kl and top1 >= ref_top1, summary
    assert kl <= MAX_KL and top1 >= MIN_TOP1, summary


def test_runner_is_the_default_configuration(runner):
    assert runner.dtype == torch.bfloat16
    assert isinstance(runner.attn_backend, CpuPagedBackend)
    if cpu_gemm._small_gemm() is not None:  # AVX512-BF16 and a C compiler: the native step must be on
        assert runner.native_decode is not None and runner.native_decode.max_batch >= SEQS


def test_prefill_path_is_as_close_to_fp32_as_transformers_bf16(runner, prompts, references):
    steps = ForwardSteps(runner)
    seqs = [steps.start() for _ in prompts]
    try:
        logits = steps.extend(seqs, prompts, return_all_logits=True)  # one extend batch of SEQS x LENGTH
    finally:
        for seq in seqs:
            steps.release(seq)
    _check("prefill", logits.view(SEQS, LENGTH, -1), references)


def test_decode_path_is_as_close_to_fp32_as_transformers_bf16(runner, prompts, references):
    """One token per step for all SEQS sequences; every step after the first goes through the native step."""
    native = runner.native_decode
    calls: list[int] = []
    if native is not None:
        original_run = native.run

        def counting_run(batch):
            assert native.applies(batch)
            calls.append(batch.batch_size)
            return original_run(batch)

        native.run = counting_run
    steps = ForwardSteps(runner)
    seqs = [steps.start() for _ in prompts]
    try:
        logits = [steps.extend(seqs, [[p[i]] for p in prompts]) for i in range(LENGTH)]  # decode after the first
    finally:
        for seq in seqs:
            steps.release(seq)
        if native is not None:
            native.run = original_run
    if native is not None:
        assert calls == [SEQS] * (LENGTH - 1)
    _check("decode", torch.stack(logits, dim=1), references)
