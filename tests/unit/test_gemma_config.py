"""Gemma 2 / Gemma 3 config parsing: the defaults of keys a Hub config leaves out and the legacy keys
(`rope_scaling`, `rope_local_base_freq`, `sliding_window_pattern`) mean what transformers' own config
classes make of them; multimodal Gemma 3 and what the model cannot run are refused by name. The soft-capped
attention of the torch path equals an explicit reference."""

from __future__ import annotations

import pytest
import torch
import transformers

from tokenloom.layers.attention.torch_native import _decode, _sdpa
from tokenloom.model_config import ModelConfig, ModelConfigError

BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=7, num_attention_heads=4,
            num_key_value_heads=2)


def test_gemma2_hub_defaults_are_transformers_defaults():
    raw = {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", **BASE}
    hf = transformers.Gemma2Config(**BASE)
    cfg = ModelConfig.from_hf_dict(raw)
    assert cfg.layer_types == tuple(hf.layer_types)  # sliding on even layers
    assert cfg.attn_logit_softcap == hf.attn_logit_softcapping == 50.0
    assert cfg.final_logit_softcap == hf.final_logit_softcapping == 30.0
    assert cfg.query_pre_attn_scalar == hf.query_pre_attn_scalar
    assert (cfg.head_dim, cfg.sliding_window, cfg.tie_word_embeddings) == (hf.head_dim, hf.sliding_window, True)
    assert cfg.max_position_embeddings == hf.max_position_embeddings
    assert cfg.norm_weight_offset == 1.0 and cfg.sandwich_norms and cfg.hidden_act == "gelu_pytorch_tanh"
    assert cfg.embedding_multiplier == pytest.approx(8.0)
    assert [cfg.layer_window(i) for i in range(3)] == [hf.sliding_window, 0, hf.sliding_window]
    nulls = ModelConfig.from_hf_dict({**raw, "attn_logit_softcapping": None, "final_logit_softcapping": None})
    assert nulls.attn_logit_softcap is None and nulls.final_logit_softcap is None


def test_gemma3_legacy_keys_mean_what_transformers_makes_of_them():
    legacy = dict(rope_theta=1e6, rope_local_base_freq=10000.0, sliding_window_pattern=3, sliding_window=512,
                  rope_scaling={"rope_type": "linear", "factor": 8.0})
    raw = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", **BASE, **legacy}
    hf = transformers.Gemma3TextConfig(**BASE, **legacy)
    cfg = ModelConfig.from_hf_dict(raw)
    assert cfg.layer_types == tuple(hf.layer_types)
    assert cfg.rope_theta == hf.rope_parameters["full_attention"]["rope_theta"] == 1e6
    assert cfg.rope_local_theta == hf.rope_parameters["sliding_attention"]["rope_theta"] == 10000.0
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert cfg.qk_norm == "head" and cfg.attn_logit_softcap is None and cfg.final_logit_softcap is None
    # the transformers 5 form of the same config parses the same
    saved = {"architectures": ["Gemma3ForCausalLM"], **hf.to_dict()}
    again = ModelConfig.from_hf_dict(saved)
    assert (again.layer_types, again.rope_theta, again.rope_local_theta) == (cfg.layer_types, 1e6, 10000.0)
    assert again.rope_scaling["rope_type"] == "linear" and again.rope_scaling["factor"] == 8.0
    # no pattern and no layer_types: every 6th layer is global, as transformers' default
    plain = ModelConfig.from_hf_dict({"architectures": ["Gemma3ForCausalLM"], **BASE})
    assert plain.layer_types == tuple(transformers.Gemma3TextConfig(**BASE).layer_types)
    assert plain.rope_theta == 1e6 and plain.rope_local_theta == 10000.0


@pytest.mark.parametrize(("raw", "words"), [
    ({"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "text_config": BASE},
     "multimodal Gemma 3"),
    ({"architectures": ["Gemma3ForCausalLM"], **BASE, "vision_config": {}}, "multimodal Gemma 3"),
    ({"architectures": ["Gemma2ForCausalLM"], **BASE, "hidden_activation": "gelu"}, "hidden_activation 'gelu'"),
    ({"architectures": ["Gemma2ForCausalLM"], **BASE, "attention_bias": True}, "attention_bias"),
    ({"architectures": ["Gemma3ForCausalLM"], **BASE, "use_bidirectional_attention": True},
     "use_bidirectional_attention"),
    ({"architectures": ["Gemma3ForCausalLM"], **BASE, "rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}}}, "rope_type 'yarn'"),
])
def test_refused_by_name(raw, words):
    with pytest.raises(ModelConfigError, match=words):
        ModelConfig.from_hf_dict(raw)


def _reference(q, k, v, mask, scale, cap):
    """Eager soft-capped attention as transformers computes it: q [B, H, Lq, D], k/v [B, Hkv, Lk, D]."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    s = torch.tanh(q @ k.transpose(-1, -2) * scale / cap) * cap
    return torch.softmax(s.masked_fill(~mask, float("-inf")), -1) @ v


def test_soft_capped_attention_paths_equal_the_reference():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 5, 8, generator=gen) * 3
    k, v = torch.randn(2, 2, 7, 8, generator=gen) * 3, torch.randn(2, 2, 7, 8, generator=gen)
    causal = torch.ones(5, 7, dtype=torch.bool).tril(2)  # queries at positions 2..6 over 7 keys
    want = _reference(q, k, v, causal, 0.3, 1.5)
    got = _sdpa(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=causal, scale=0.3, softcap=1.5)
    assert torch.allclose(got, want, atol=1e-5)
    square = torch.ones(5, 5, dtype=torch.bool).tril()
    got = _sdpa(q, k[:, :, :5], v[:, :, :5], is_causal=True, scale=0.3, enable_gqa=True, softcap=1.5)
    assert torch.allclose(got, _reference(q, k[:, :, :5], v[:, :, :5], square, 0.3, 1.5), atol=1e-5)
    assert not torch.allclose(got, _reference(q, k[:, :, :5], v[:, :, :5], square, 0.3, 1e6), atol=1e-2)
    # decode: one query per request, [Hkv, B, L, D] keys, an additive mask hiding the last key of request 1
    mask = torch.zeros(2, 1, 1, 7)
    mask[1, ..., 6] = float("-inf")
    out = _decode(q[:, :, 0], k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous(), mask, 0.3, 2, 1.5)
    keep = torch.ones(2, 1, 1, 7, dtype=torch.bool)
    keep[1, ..., 6] = False
    ref = torch.cat([_reference(q[b:b + 1, :, :1], k[b:b + 1], v[b:b + 1], keep[b, 0], 0.3, 1.5) for b in range(2)])
    assert torch.allclose(out, ref.reshape(2, -1), atol=1e-5)
