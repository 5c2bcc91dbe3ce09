"""Phi3ForCausalLM against transformers' own Phi3ForCausalLM on the same tiny random weights (float32): logits of
one batch mixing a prompt past the original RoPE length (LongRoPE's long factors) with shorter ones (short
factors), greedy generation that crosses the original length while decoding, a sliding window shorter than the prompt,
the bf16 default within transformers bf16's own distance, and the configs refused at start naming the feature.
(HTTP, chunked prefill, radix hits, TP=2 and PP=2: tests/e2e/test_phi3_server.py.)"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests.forward_steps import ForwardSteps
from tests.phi3_factory import ORIG, hf_greedy_stepwise, make_tiny_phi3
from tests.scheduler_harness import LoopHarness, generate_in_process
from tokenloom.config import ServerArgs
from tokenloom.executor.model_runner import ModelRunner
from tokenloom.executor.worker import ModelWorker
from tokenloom.model_config import ModelConfig, ModelConfigError

# float32 logits of a 2-layer model: observed ~3e-7 (summation order only)
FP32_TOL = 1e-4


@pytest.fixture(scope="module")
def phi3_dir(tmp_path_factory):
    cache: dict[str, tuple[str, torch.nn.Module]] = {}

    def get(variant: str):
        if variant not in cache:
            folder = str(tmp_path_factory.mktemp(f"phi3_{variant}"))
            cache[variant] = (folder, make_tiny_phi3(folder, variant))
        return cache[variant]

    return get


def _runner(folder: str, **kw) -> ModelRunner:
    args = dict(model_path=folder, dtype="float32", max_total_tokens=2048, max_running_requests=8)
    return ModelRunner(ServerArgs(**{**args, **kw}))


def _prompts(lengths: list[int], seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=gen).tolist() for n in lengths]


@pytest.mark.parametrize("variant", ["phi4mini_longrope_partial", "phi35_longrope"])
def test_phi3_logits_match_transformers_short_and_long_in_one_batch(phi3_dir, variant):
    folder, hf = phi3_dir(variant)
    runner = _runner(folder)
    steps = ForwardSteps(runner)
    lengths = [37, ORIG, 200]  # short factors, short (seq_len == original), long factors
    prompts = _prompts(lengths)
    seqs = [steps.start() for _ in prompts]
    logits = steps.extend(seqs, prompts, return_all_logits=True)
    for prompt, mine in zip(prompts, torch.split(logits, lengths), strict=True):
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0].float()
        assert (mine - ref).abs().max().item() < FP32_TOL
        assert torch.equal(mine.argmax(-1), ref.argmax(-1))
    for s in seqs:
        steps.release(s)


@pytest.mark.parametrize("prompt_len", [40, 150])
def test_phi3_greedy_generation_matches_transformers(phi3_dir, prompt_len):
    """40: the prompt uses the short factors and decoding crosses the original length of 64 (tokens from
    position 64 on use the long ones, as transformers' forward does); 150: everything long. Chunked prefill of
    32 splits the 150-token prompt, which must not change the factor choice."""
    folder, hf = phi3_dir("phi4mini_longrope_partial")
    runner = _runner(folder, chunked_prefill_size=32)
    prompt = _prompts([prompt_len], seed=2)[0]
    ours = generate_in_process(runner, [prompt], [{"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}])[0]
    ref, _ = hf_greedy_stepwise(hf, prompt, 40)
    assert ours == ref


def test_phi3_prefix_cache_never_mixes_short_and_long_factor_kv(phi3_dir):
    """A prompt past the original length is computed with the long factors throughout, so the cached KV of a
    shorter prompt with the same first tokens (short factors) must not be reused for it, while two long
    prompts share theirs. Each answer equals transformers' on its own."""
    folder, hf = phi3_dir("phi4mini_longrope_partial")
    runner = _runner(folder)
    h = LoopHarness(runner.args, ModelWorker(runner, ()), runner.memory, runner.vocab_size)
    assert h.scheduler.flush_cache().success
    short = _prompts([40], seed=3)[0]
    long_a = short + _prompts([110], seed=4)[0]  # 150 tokens: long factors, first 40 tokens those of `short`
    long_b = long_a[:120] + _prompts([20], seed=5)[0]  # shares 120 tokens with long_a, also long
    greedy = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    got = {}
    for rid, prompt in (("short", short), ("long_a", long_a), ("long_b", long_b)):
        h.submit(rid, prompt, greedy)
        got[rid] = h.run()[rid]
        assert got[rid].output_ids == hf_greedy_stepwise(hf, prompt, 8)[0], rid
    assert got["long_a"].meta["cached_tokens"] == 0  # the short prompt's KV (short factors) was not reused
    assert got["long_b"].meta["cached_tokens"] >= 100  # the long ones share theirs
    assert h.scheduler.flush_cache().success


@pytest.mark.parametrize("backend", ["cpu", "torch_native"])
def test_phi3_sliding_window_past_the_window(phi3_dir, backend):
    """A prompt of 150 tokens, then decode, through a window of 96: the window binds (keys older than 96
    positions are masked in transformers too)."""
    folder, hf = phi3_dir("phi3_window")
    runner = _runner(folder, attention_backend=backend)
    assert runner.model.cfg.sliding_window == 96 and runner.model.cfg.layer_window(1) == 96
    steps = ForwardSteps(runner)
    prompt = _prompts([150])[0]
    seq = steps.start()
    mine = steps.extend([seq], [prompt], return_all_logits=True)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].float()
        unwindowed = make_tiny_phi3(folder + "_nowindow", "phi3_window", sliding_window=None)(
            torch.tensor([prompt])).logits[0].float()
    assert (mine - ref).abs().max().item() < FP32_TOL
    assert (unwindowed - ref).abs().max().item() > 100 * FP32_TOL  # the window changes the answer
    steps.release(seq)
    ours = generate_in_process(runner, [prompt], [{"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}])[0]
    assert ours == hf_greedy_stepwise(hf, prompt, 12)[0]


def test_phi3_bf16_default_within_transformers_bf16_distance(phi3_dir):
    folder, hf = phi3_dir("phi4mini_longrope_partial")
    runner = _runner(folder, dtype="auto")  # the default: bf16 weights and activations
    assert runner.model.dtype == torch.bfloat16
    steps = ForwardSteps(runner)
    lengths = [50, 180]
    prompts = _prompts(lengths, seed=3)
    seqs = [steps.start() for _ in prompts]
    logits = steps.extend(seqs, prompts, return_all_logits=True)
    hf_bf16 = make_tiny_phi3(folder + "_bf16", "phi4mini_longrope_partial").to(torch.bfloat16)
    for prompt, mine in zip(prompts, torch.split(logits, lengths), strict=True):
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0].float()
            theirs = hf_bf16(torch.tensor([prompt])).logits[0].float()
        ours_err, hf_err = (mine - ref).abs().max().item(), (theirs - ref).abs().max().item()
        assert ours_err <= 1.5 * hf_err, (ours_err, hf_err)


def _config(**changes) -> dict:
    cfg = {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
           "max_position_embeddings": 512, "original_max_position_embeddings": 64, "hidden_act": "silu",
           "rope_scaling": {"type": "su", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}}
    cfg.update(changes)
    return cfg


def test_phi3_config_parsing_su_partial_and_window():
    cfg = ModelConfig.from_hf_dict(_config(sliding_window=2047), "c")
    assert cfg.architecture == "Phi3ForCausalLM" and cfg.rope_scaling["rope_type"] == "longrope"
    assert cfg.rope_scaling["original_max_position_embeddings"] == 64 and cfg.rope_scaling["factor"] == 8.0
    assert cfg.sliding_window == 2047 and cfg.layer_window(0) == 2047 and not cfg.attention_bias
    cfg = ModelConfig.from_hf_dict(_config(partial_rotary_factor=0.75, original_max_position_embeddings=None,
                                           rope_scaling=None, rope_parameters={"rope_type": "default",
                                                                               "rope_theta": 250000.0}), "c")
    assert cfg.partial_rotary_factor == 0.75 and cfg.rope_scaling is None and cfg.rope_theta == 250000.0


@pytest.mark.parametrize("changes, named", [
    ({"hidden_act": "gelu_new"}, "unsupported hidden_act 'gelu_new'"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "unsupported rope_scaling type 'dynamic' for Phi3"),
    ({"embd_layer": {"embedding_cls": "image"}}, "multimodal Phi config \\(embd_layer\\)"),
    ({"architectures": ["Phi3VForCausalLM"], "model_type": "phi3_v"}, "unsupported architecture"),
])
def test_phi3_unsupported_features_are_refused_naming_them(changes, named):
    with pytest.raises(ModelConfigError, match=named):
        ModelConfig.from_hf_dict(_config(**changes), "c")


def test_phi3_fused_tensor_of_the_wrong_size_is_named(phi3_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    from tokenloom.layers.linear import WeightShapeError

    folder, _ = phi3_dir("phi35_longrope")
    bad = tmp_path / "bad"
    bad.mkdir()
    for name in os.listdir(folder):
        if not name.endswith(".safetensors"):
            (bad / name).write_bytes(Path(folder, name).read_bytes())
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    key = "model.layers.1.self_attn.qkv_proj.weight"
    tensors[key] = tensors[key][:-16]
    save_file(tensors, str(bad / "model.safetensors"))
    assert json.loads((bad / "config.json").read_text())["architectures"] == ["Phi3ForCausalLM"]
    with pytest.raises(WeightShapeError, match=f"{key}: checkpoint has 112 rows, expected 128 "
                                               "\\(64 q_proj \\+ 32 k_proj \\+ 32 v_proj\\)"):
        _runner(str(bad))
