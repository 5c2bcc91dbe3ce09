"""Qwen3, SmolLM3 (and Qwen2, which shares Llama's model) against transformers' own classes on the same tiny
random weights (tests/family_models.py), from the HF folder and from its GGUF twin written by llama.cpp's
converter.

- float32 (also with sliding windows of 16 tokens, shorter than the prompts): every prompt position's logits
  (a batch of three lengths, one prompt fed in two chunks on its own cached prefix, then decode steps) within
  2e-4 of transformers float32 (measured ~5e-7), argmax equal;
- bf16 (the default dtype): the largest logit error against transformers float32 no larger than
  transformers' own bf16 model's on the same weights (measured ~0.006 against ~0.009); KL within 2x and
  top-1 within 0.03 of its (both are bf16 noise on a random model's near-flat distributions);
- GGUF f32: the same bound as HF float32 (Qwen3: not permuted, q/k norms as attn_q_norm/attn_k_norm; SmolLM3:
  Q/K un-permuted); GGUF q8_0 kept quantized (q/k/v, o, gate/up, down as quantized weights) within 0.03 of the
  same file dequantized, the tolerance of test_quantized_gguf.py (int8 activation blocks); the Qwen3 twin's
  `tokenizer.chat_template` renders (thinking on and off) and tokenizes as the folder's. Qwen2's twin (arch
  qwen2: q/k/v biases as attn_{q,k,v}.bias) is converted with the folder's tokenizer.json read as saved: with
  SmolLM2's tokenizer under model_type qwen2, transformers builds Qwen2's pre-tokenizer, whose hash on that
  vocabulary llama.cpp's converter does not know (tests/llama_cpp_convert.py).
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.family_models import QWEN3_STYLE_TEMPLATE, gguf_twin
from tests.forward_steps import ForwardSteps, all_kv_free
from tokenloom.config import ServerArgs
from tokenloom.executor.model_runner import ModelRunner

TOL = 2e-4
Q8_TOL = 0.03
VOCAB = 49152


def _runner(path: str, **kw) -> ModelRunner:
    args = dict(model_path=path, dtype="float32", max_total_tokens=2048, max_running_requests=4)
    return ModelRunner(ServerArgs(**{**args, **kw}))


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (37, 5, 90)]


def _our_logits(runner: ModelRunner, prompts: list[list[int]], decode: int = 3) -> list[torch.Tensor]:
    """Per prompt, the logits of every position: prompt 0 in two chunks (the second on the first's cached KV),
    the others in one batch with it, then `decode` steps of the argmax tokens for all."""
    steps = ForwardSteps(runner)
    seqs = [steps.start() for _ in prompts]
    first = steps.extend(seqs[:1], [prompts[0][:20]], return_all_logits=True)
    rest = [prompts[0][20:]] + prompts[1:]
    out = torch.split(steps.extend(seqs, rest, return_all_logits=True), [len(r) for r in rest])
    logits = [torch.cat((first, out[0]))] + list(out[1:])
    for _ in range(decode):
        step = steps.extend(seqs, [[int(lg[-1].argmax())] for lg in logits])
        logits = [torch.cat((lg, row[None])) for lg, row in zip(logits, step, strict=True)]
    for s in seqs:
        steps.release(s)
    assert all_kv_free(runner)
    return logits


def _reference(hf: torch.nn.Module, prompts: list[list[int]], ours: list[torch.Tensor]) -> list[torch.Tensor]:
    """transformers' logits on each prompt followed by the tokens our decode steps fed."""
    refs = []
    for prompt, mine in zip(prompts, ours, strict=True):
        fed = prompt + [int(mine[i].argmax()) for i in range(len(prompt) - 1, mine.shape[0] - 1)]
        with torch.no_grad():
            refs.append(hf(torch.tensor([fed])).logits[0].float())
    return refs


def _assert_close(ours: list[torch.Tensor], refs: list[torch.Tensor], tol: float, argmax: bool = True) -> float:
    worst = 0.0
    for mine, ref in zip(ours, refs, strict=True):
        assert mine.shape == ref.shape
        worst = max(worst, (mine - ref).abs().max().item())
        if argmax:
            assert torch.equal(mine.argmax(-1), ref.argmax(-1))
    assert worst < tol, worst
    return worst


@pytest.mark.parametrize("variant", ["qwen3", "smollm3", "smollm3_flags", "qwen3_swa", "smollm3_swa", "qwen2"])
def test_hf_float32_logits_match_transformers(family_model_dir, variant):
    folder, hf = family_model_dir(variant)
    runner = _runner(folder)
    assert type(runner.model).__name__ == {"qwen2": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}.get(
        variant.split("_")[0], "SmolLM3ForCausalLM")
    if variant.endswith("_swa"):  # the window is shorter than prompts 0 and 2 (37 and 90 tokens)
        windows = [runner.model_config.layer_window(i) for i in range(runner.model_config.num_hidden_layers)]
        assert windows == ([0, 16] if variant == "qwen3_swa" else [0, 0, 0, 16]), windows
    prompts = _prompts()
    ours = _our_logits(runner, prompts)
    _assert_close(ours, _reference(hf, prompts, ours), TOL)


def _distance(logits: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    log_ref, log_got = ref.log_softmax(-1), logits.float().log_softmax(-1)
    kl = (log_ref.exp() * (log_ref - log_got)).sum(-1)
    return kl.mean().item(), (logits.argmax(-1) == ref.argmax(-1)).float().mean().item()


@pytest.mark.parametrize("variant", ["qwen3", "smollm3"])
def test_bf16_default_is_as_close_to_fp32_as_transformers_bf16(family_model_dir, variant):
    folder, hf = family_model_dir(variant)
    runner = ModelRunner(ServerArgs(model_path=folder, max_total_tokens=2048, max_running_requests=4))
    assert runner.dtype == torch.bfloat16
    prompts = _prompts()
    ours = torch.cat(_our_logits(runner, prompts, decode=0))
    bf16 = copy.deepcopy(hf).to(torch.bfloat16)
    with torch.no_grad():
        fp32 = torch.cat([hf(torch.tensor([p])).logits[0].float() for p in prompts])
        theirs = torch.cat([bf16(torch.tensor([p])).logits[0].float() for p in prompts])
    kl, top1 = _distance(ours, fp32)
    ref_kl, ref_top1 = _distance(theirs, fp32)
    err, ref_err = (ours - fp32).abs().max().item(), (theirs - fp32).abs().max().item()
    summary = f"ours: max err {err:.4g}, KL {kl:.3g}, top-1 {top1:.3f}; transformers bf16: {ref_err:.4g}, " \
              f"{ref_kl:.3g}, {ref_top1:.3f}"
    # The logit error is the sharp measure here; KL and top-1 of a random model's near-flat distributions are
    # bf16 noise (measured: ours/theirs KL ratio 0.7-1.4, top-1 within 3 of 132 positions either way).
    assert err <= ref_err, summary
    assert kl <= 2 * ref_kl and top1 >= ref_top1 - 0.03, summary


@pytest.mark.parametrize("variant", ["qwen3", "smollm3", "qwen2"])
def test_gguf_twins_load_and_match(family_model_dir, variant):
    from tokenloom.layers.quant_linear import QuantWeight
    from tokenloom.models.gguf_file import GGUFFile

    folder, hf = family_model_dir(variant)
    prompts = _prompts()
    f32 = gguf_twin(folder, "f32")
    assert GGUFFile(f32).arch == variant
    ours = _our_logits(_runner(f32), prompts)
    _assert_close(ours, _reference(hf, prompts, ours), TOL)

    if variant == "qwen3":  # the converter copies the folder's template; the GGUF's tokenizer renders it alike
        from transformers import AutoTokenizer

        from tokenloom.models.loader import resolve_model_source
        from tokenloom.tokenizer import load_tokenizer

        assert GGUFFile(f32).chat_template() == QWEN3_STYLE_TEMPLATE
        from_gguf = load_tokenizer(resolve_model_source(ServerArgs(model_path=f32)))
        from_folder = AutoTokenizer.from_pretrained(folder)
        chat = [{"role": "user", "content": "hi"}]
        for thinking in (True, False):
            kw = dict(tokenize=False, add_generation_prompt=True, enable_thinking=thinking)
            text = from_gguf.apply_chat_template(chat, **kw)
            assert text == from_folder.apply_chat_template(chat, **kw)
            assert ("<think>" in text) is not thinking
            assert from_gguf(text).input_ids == from_folder(text).input_ids

    q8 = gguf_twin(folder, "q8_0")
    kept = _runner(q8)  # a .gguf stays quantized by default
    layer = kept.model.layers[0]
    for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        assert isinstance(linear.quant, QuantWeight) and linear.weight is None
        assert set(linear.quant.part_types) == {"Q8_0"}, linear.quant.part_types
    quantized = _our_logits(kept, prompts, decode=0)
    dequantized = _our_logits(_runner(q8, quantization="none"), prompts, decode=0)
    # near-flat random logits: argmax may flip at a near-tie, so the bound is on the values
    _assert_close(quantized, dequantized, Q8_TOL, argmax=False)
