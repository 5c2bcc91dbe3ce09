"""RoPE scaling types and partial rotary against transformers' own rotary modules (their rope init functions and
their per-forward updates), at positions past the original RoPE length; the native rotation (partial widths
included) against transformers' apply_rotary_pos_emb; unknown or unservable types refused at construction."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.phi3 import modeling_phi3

from tokenloom.kernels import cpu_ops
from tokenloom.layers.rotary import RotaryEmbedding
from tokenloom.model_config import ModelConfig, ModelConfigError

HEAD_DIM, MAX_POS, ORIG = 32, 512, 64
BASE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=64, max_position_embeddings=MAX_POS)

SCALINGS = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": ORIG},
    "yarn": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": ORIG},
    "yarn_untruncated_betas": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIG,
                               "beta_fast": 16, "beta_slow": 2, "truncate": False},
    "yarn_deepseek_mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": ORIG,
                             "mscale": 0.707, "mscale_all_dim": 0.707 * 1.3},
    "yarn_attention_factor": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": ORIG,
                              "attention_factor": 0.9},
    "dynamic": {"rope_type": "dynamic", "factor": 4.0},
}


def _hf_cos_sin(config: transformers.PretrainedConfig, module: type, positions: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    rotary = module(config)
    x = torch.zeros(1, dtype=torch.float32)
    cos, sin = rotary(x, positions[None])
    return cos[0], sin[0]


def _ours(config: transformers.PretrainedConfig, positions: torch.Tensor, lengths: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor, RotaryEmbedding]:
    cfg = ModelConfig.from_hf_dict(config.to_dict(), "test")
    rotary = RotaryEmbedding.for_model(cfg)
    step = rotary.lookup(positions, torch.float32, lengths)
    cos, sin = step.cos_sin()
    half = rotary.rotary_dim // 2
    return cos[:, 0], torch.cat((-sin[:, 0, :half], sin[:, 0, half:]), -1), rotary


@pytest.mark.parametrize("name", sorted(SCALINGS))
def test_scaling_tables_equal_transformers_past_the_original_length(name):
    config = transformers.LlamaConfig(**BASE, head_dim=HEAD_DIM,
                                      rope_parameters={**SCALINGS[name], "rope_theta": 10000.0})
    positions = torch.arange(0, MAX_POS, 7)  # reaches far past ORIG
    ref_cos, ref_sin = _hf_cos_sin(config, transformers.models.llama.modeling_llama.LlamaRotaryEmbedding, positions)
    cos, sin, _ = _ours(config, positions)
    torch.testing.assert_close(cos, ref_cos, atol=2e-6, rtol=0)
    torch.testing.assert_close(sin, ref_sin, atol=2e-6, rtol=0)
    if name.startswith("yarn"):  # the attention factor is applied (a table of pure cos/sin would not pass)
        assert abs((cos[0, 0] - 1.0).item()) > 1e-3


def _phi3_config(partial: float, factor_keys: bool = True) -> transformers.Phi3Config:
    half = int(HEAD_DIM * partial) // 2
    return transformers.Phi3Config(
        **BASE, original_max_position_embeddings=ORIG, pad_token_id=0,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": partial,
                         "short_factor": [1.0 + 0.05 * i for i in range(half)],
                         "long_factor": [1.5 + 0.7 * i for i in range(half)]})


@pytest.mark.parametrize("partial", [1.0, 0.75])
@pytest.mark.parametrize("seq_len", [ORIG - 10, ORIG, ORIG + 1, 300])
def test_longrope_picks_short_or_long_by_sequence_length_as_transformers(partial, seq_len):
    """One forward of `seq_len` tokens: transformers uses the long factors for all of them iff seq_len > ORIG
    (and the attention factor sqrt(1 + ln 8 / ln 64) either way); so does our lookup given that length."""
    config = _phi3_config(partial)
    positions = torch.arange(seq_len)
    ref_cos, ref_sin = _hf_cos_sin(config, modeling_phi3.Phi3RotaryEmbedding, positions)
    cos, sin, rotary = _ours(config, positions, torch.full_like(positions, seq_len))
    assert rotary.rotary_dim == int(HEAD_DIM * partial) == ref_cos.shape[-1]
    torch.testing.assert_close(cos, ref_cos, atol=2e-6, rtol=0)
    torch.testing.assert_close(sin, ref_sin, atol=2e-6, rtol=0)
    # the two factor sets differ where it matters, so picking the wrong one would fail above
    other, _, _ = _ours(config, positions, torch.full_like(positions, 300 if seq_len <= ORIG else 1))
    assert (other - cos).abs().max() > 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("partial", [1.0, 0.75, 0.5])
def test_native_and_torch_rotation_equal_transformers_apply(dtype, partial):
    config = _phi3_config(partial)
    positions = torch.tensor([0, 5, 63, 64, 200, 511])
    gen = torch.Generator().manual_seed(0)
    heads = 6
    qkv = torch.randn(len(positions), heads * HEAD_DIM + 8, generator=gen).to(dtype)  # a strided q|k view
    x = qkv[:, : heads * HEAD_DIM].view(len(positions), heads, HEAD_DIM)
    ref_cos, ref_sin = _hf_cos_sin(config, modeling_phi3.Phi3RotaryEmbedding, positions)
    q = x.float().transpose(0, 1)[None]  # [1, H, T, D]
    ref, _ = modeling_phi3.apply_rotary_pos_emb(q, q, ref_cos[None], ref_sin[None])
    ref = ref[0].transpose(0, 1)
    cfg = ModelConfig.from_hf_dict(config.to_dict(), "test")
    rotary = RotaryEmbedding.for_model(cfg)
    step = rotary.lookup(positions, dtype, torch.full_like(positions, 512))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(RotaryEmbedding.apply(x.clone(), step).float(), ref, atol=tol, rtol=tol)
    assert cpu_ops.available(x)
    native = x.clone()
    assert cpu_ops.rope_(native, step.positions, rotary.cos, rotary.sin)
    torch.testing.assert_close(native.float(), ref, atol=tol, rtol=tol)
    rot = rotary.rotary_dim
    assert torch.equal(native[..., rot:], x[..., rot:])  # the pass-through part untouched


def test_unknown_rope_type_and_unservable_dynamic_are_refused_at_start():
    with pytest.raises(ModelConfigError, match="unsupported rope_scaling type 'mrope'"):
        RotaryEmbedding(HEAD_DIM, MAX_POS, 10000.0, {"rope_type": "mrope", "factor": 2.0})
    with pytest.raises(ModelConfigError, match="dynamic.*--context-length 512"):
        RotaryEmbedding(HEAD_DIM, 1024, 10000.0, {"rope_type": "dynamic", "factor": 2.0,
                                                  "max_position_embeddings": 512})
    with pytest.raises(ModelConfigError, match="partial_rotary_factor 0.3"):
        RotaryEmbedding(HEAD_DIM, MAX_POS, 10000.0, None, partial_rotary_factor=0.3)
    with pytest.raises(ModelConfigError, match="short_factor must list 16 numbers"):
        RotaryEmbedding(HEAD_DIM, MAX_POS, 10000.0, {"rope_type": "longrope", "short_factor": [1.0],
                                                     "long_factor": [1.0] * 16,
                                                     "original_max_position_embeddings": 64})
