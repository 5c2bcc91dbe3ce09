"""Gemma 2 and Gemma 3 (text) forward against transformers' own classes on the same tiny random weights
(tests/gemma_models.py: soft-caps that bind, q/k norms, local/global RoPE, (1 + w) norms away from 1).

- float32, both attention backends (`torch_native`; `cpu`, whose decode steps run the native paged kernel
  on every layer, Gemma 2's soft-capped ones included: checked by counting its calls and their `logit_cap`):
  a batched prefill of different lengths, a chunk on a cached prefix and a decode step, every position's
  logits within 5e-5 of transformers' (measured ~5e-6), argmax equal;
- the soft-caps bind: transformers without them is far (> 0.05) from both;
- the default configuration (bf16, no flags): as close to transformers float32 as transformers' own bf16
  model is (mean KL per position and top-1 agreement over 4 x 48 positions, teacher-forced, prefill and
  decode; a model with a wider window for that), its decode steps on the native kernel too.

Prompts run past the sliding window (transformers without the window is far off: it binds)."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.forward_steps import ForwardSteps, all_kv_free
from tests.gemma_models import WINDOW, make_tiny_gemma
from tokenloom.config import ServerArgs
from tokenloom.executor.model_runner import ModelRunner
from tokenloom.kernels import paged_attention
from tokenloom.layers.attention.torch_native import TorchNativeBackend

TOL = 5e-5
# Prompt lengths past the window (a chunk of 2 and a decode step follow): similar lengths run the padded
# batch path, mixed ones the per-request path.
LENGTHS = {"similar": [WINDOW + 9, WINDOW + 5, WINDOW + 7], "mixed": [WINDOW + 9, 4, WINDOW + 3]}
BF16_LENGTH = 48  # x 4 sequences, the last 8 positions of each by decode steps


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def gemma(request, tmp_path_factory):
    folder = str(tmp_path_factory.mktemp(request.param))
    return request.param, folder, make_tiny_gemma(request.param, folder)


def _spy_native_decode(monkeypatch) -> list[float]:
    """The `logit_cap` of every native paged decode kernel call from here on; a decode step's attention
    through the torch path (the fallback capped layers once took) fails the test."""
    caps: list[float] = []
    real_decode, real_attend = paged_attention.decode, TorchNativeBackend._attend

    def decode(*args, logit_cap: float = 0.0, **kwargs):
        caps.append(logit_cap)
        return real_decode(*args, logit_cap=logit_cap, **kwargs)

    def attend(self, q, k, v, layer_id, scaling, batch, md, logit_cap):
        assert not batch.forward_mode.is_decode(), f"layer {layer_id}'s decode ran the torch path"
        return real_attend(self, q, k, v, layer_id, scaling, batch, md, logit_cap)

    monkeypatch.setattr(paged_attention, "decode", decode)
    monkeypatch.setattr(TorchNativeBackend, "_attend", attend)
    return caps


def _expect_native_caps(kind: str, hf: torch.nn.Module, caps: list[float], steps: int) -> None:
    """Every layer of each of `steps` decode steps ran the native kernel, with Gemma 2's soft-cap."""
    cap = hf.config.attn_logit_softcapping if kind == "gemma2" else None
    assert caps == [cap or 0.0] * (steps * hf.config.num_hidden_layers)
    assert kind != "gemma2" or cap > 0


def _prompts(lengths: list[int]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in lengths]


def _run(folder: str, lengths: list[int], **flags) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Per sequence: logits [positions, vocab] of a prefill, then a 2-token chunk on the cached prefix, then
    a decode step; and the tokens fed."""
    runner = ModelRunner(ServerArgs(**{"model_path": folder, "max_total_tokens": 1024, "max_running_requests": 4,
                                       **flags}))
    steps = ForwardSteps(runner)
    prompts = _prompts(lengths)
    seqs = [steps.start() for _ in prompts]
    first = torch.split(steps.extend(seqs, prompts, return_all_logits=True), lengths)
    chunk = [[5 + i, 9 + i] for i in range(len(seqs))]
    second = torch.split(steps.extend(seqs, chunk, return_all_logits=True), 2)
    decode = steps.extend(seqs, [[11 + i] for i in range(len(seqs))])
    for s in seqs:
        steps.release(s)
    assert all_kv_free(runner)
    logits = [torch.cat((a, b, d[None])) for a, b, d in zip(first, second, decode, strict=True)]
    fed = [p + c + [11 + i] for i, (p, c) in enumerate(zip(prompts, chunk, strict=True))]
    return logits, fed


def _reference(hf: torch.nn.Module, fed: list[list[int]]) -> list[torch.Tensor]:
    with torch.no_grad():
        return [hf(torch.tensor([ids])).logits[0].float() for ids in fed]


@pytest.mark.parametrize("lengths", sorted(LENGTHS))
@pytest.mark.parametrize("backend", ["torch_native", "cpu"])
def test_float32_matches_transformers_and_caps_bind(gemma, backend, lengths, monkeypatch):
    kind, folder, hf = gemma
    caps = _spy_native_decode(monkeypatch) if backend == "cpu" else None
    ours, fed = _run(folder, LENGTHS[lengths], dtype="float32", attention_backend=backend)
    if caps is not None:
        _expect_native_caps(kind, hf, caps, steps=1)
    refs = _reference(hf, fed)
    for mine, ref in zip(ours, refs, strict=True):
        assert (mine - ref).abs().max().item() < TOL
        assert torch.equal(mine.argmax(-1), ref.argmax(-1))
    # without its window the same model is far off (the window binds); so is Gemma 2 without either cap
    unwindowed = copy.deepcopy(hf)
    unwindowed.config.sliding_window = 10 ** 6
    far = [(m - r).abs().max().item() for m, r in zip(ours, _reference(unwindowed, fed), strict=True)]
    assert max(far) > 0.05, far
    if kind == "gemma2":
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            uncapped = copy.deepcopy(hf)
            setattr(uncapped.config, key, None)
            for layer in uncapped.model.layers:
                layer.self_attn.attn_logit_softcapping = uncapped.config.attn_logit_softcapping
            far = [(m - r).abs().max().item() for m, r in zip(ours, _reference(uncapped, fed), strict=True)]
            assert min(far) > 0.05, (key, far)


def _distance(logits: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    log_ref, log_got = ref.log_softmax(-1), logits.float().log_softmax(-1)
    kl = (log_ref.exp() * (log_ref - log_got)).sum(-1)
    return kl.mean().item(), (logits.argmax(-1) == ref.argmax(-1)).float().mean().item()


@pytest.fixture(scope="module")
def gemma_wide(gemma, tmp_path_factory):
    """The same kind of model with a window past the bf16 test's prompts (enough positions for a distance)."""
    kind = gemma[0]
    folder = str(tmp_path_factory.mktemp(kind + "_wide"))
    return folder, make_tiny_gemma(kind, folder, seed=1, sliding_window=256)


def test_default_bf16_within_transformers_bf16_distance(gemma, gemma_wide, monkeypatch):
    folder, hf = gemma_wide
    caps = _spy_native_decode(monkeypatch)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 49152, (BF16_LENGTH,), generator=gen).tolist() for _ in range(4)]
    runner = ModelRunner(ServerArgs(model_path=folder, max_total_tokens=1024, max_running_requests=4))  # bf16
    steps = ForwardSteps(runner)
    seqs = [steps.start() for _ in prompts]
    prefill = torch.split(steps.extend(seqs, [p[:-8] for p in prompts], return_all_logits=True), BF16_LENGTH - 8)
    decodes = [steps.extend(seqs, [[p[i]] for p in prompts]) for i in range(BF16_LENGTH - 8, BF16_LENGTH)]
    _expect_native_caps(gemma[0], hf, caps, steps=len(decodes))  # the default backend is `cpu` here
    ours = torch.cat([torch.cat((prefill[b], torch.stack([d[b] for d in decodes]))) for b in range(len(prompts))])
    refs = torch.cat(_reference(hf, prompts))
    ref16 = torch.cat(_reference(copy.deepcopy(hf).to(torch.bfloat16), prompts))
    ref_kl, ref_top1 = _distance(ref16, refs)
    kl, top1 = _distance(ours, refs)
    summary = f"KL {kl:.6f}, top-1 {top1:.3f}; transformers bf16: KL {ref_kl:.6f}, top-1 {ref_top1:.3f}"
    print(summary)
    assert ref_kl < 0.05, summary
    # KL is the sharp measure; top-1 on a random model's near-flat distributions flips on near-ties with the
    # kernels' summation order (AMD Zen 4's AVX512-BF16 bands: KL 0.67x transformers bf16's, top-1 one position
    # of 192 behind), so top-1 may trail by two positions
    assert kl <= ref_kl and top1 >= ref_top1 - 2 / len(refs), summary
