"""Family parsers of Qwen3 and SmolLM3 (model_families.py): what each HF config sets in `ModelConfig`, and the
configs they refuse naming the feature. The configs are transformers' own (`to_dict()` of its config classes),
so the keys are the ones real checkpoints write."""

from __future__ import annotations

import pytest
import transformers

from tokenloom.model_config import ModelConfig, ModelConfigError

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256, pad_token_id=None)


def _hf(cls: str, **kw) -> dict:
    cfg = getattr(transformers, cls)(**{**SMALL, **kw}).to_dict()
    cfg["architectures"] = [cls.replace("Config", "ForCausalLM")]
    return cfg


def test_qwen3_head_norm_and_head_dim_from_config():
    cfg = ModelConfig.from_hf_dict(_hf("Qwen3Config", head_dim=32))
    assert cfg.architecture == "Qwen3ForCausalLM"
    assert cfg.qk_norm == "head" and cfg.head_dim == 32 and not cfg.attention_bias
    assert not cfg.sliding_window and not cfg.no_rope_layers


def test_qwen3_sliding_window_layers_from_max_window_layers():
    cfg = ModelConfig.from_hf_dict(_hf("Qwen3Config", use_sliding_window=True, sliding_window=16,
                                       max_window_layers=2))
    assert [cfg.layer_window(i) for i in range(4)] == [0, 0, 16, 16]
    off = _hf("Qwen3Config", use_sliding_window=False, sliding_window=16)
    assert ModelConfig.from_hf_dict(off).sliding_window is None  # as transformers: off means no window
    del off["layer_types"]  # a hand-written config: the rule, not the saved list
    off.update(use_sliding_window=True, sliding_window=8, max_window_layers=3)
    assert [ModelConfig.from_hf_dict(off).layer_window(i) for i in range(4)] == [0, 0, 0, 8]


def test_smollm3_sliding_windows_on_its_nope_layers():
    cfg = ModelConfig.from_hf_dict(_hf("SmolLM3Config", use_sliding_window=True, sliding_window=16))
    assert [cfg.layer_window(i) for i in range(4)] == [0, 0, 0, 16]


def test_smollm3_no_rope_layers_from_flags_and_interval():
    assert ModelConfig.from_hf_dict(_hf("SmolLM3Config")).no_rope_layers == (3,)  # interval 4 by default
    assert ModelConfig.from_hf_dict(_hf("SmolLM3Config", num_hidden_layers=8,
                                        no_rope_layer_interval=2)).no_rope_layers == (1, 3, 5, 7)
    flags = ModelConfig.from_hf_dict(_hf("SmolLM3Config", no_rope_layers=[1, 0, 0, 1]))
    assert flags.no_rope_layers == (1, 2) and flags.architecture == "SmolLM3ForCausalLM"


@pytest.mark.parametrize(("kw", "message"), [
    (dict(no_rope_layers=[1, 0]), "no_rope_layers must be 4 flags"),
    (dict(mlp_bias=True), "SmolLM3 mlp_bias"),
])
def test_smollm3_refusals(kw, message):
    cfg = _hf("SmolLM3Config")
    cfg.update(kw)
    cfg.pop("layer_types", None)
    with pytest.raises(ModelConfigError, match=message):
        ModelConfig.from_hf_dict(cfg)


def test_qwen3_and_smollm3_models_registered():
    from tokenloom.models.qwen3 import Qwen3ForCausalLM
    from tokenloom.models.registry import model_class_for
    from tokenloom.models.smollm3 import SmolLM3ForCausalLM

    assert model_class_for("Qwen3ForCausalLM") is Qwen3ForCausalLM
    assert model_class_for("SmolLM3ForCausalLM") is SmolLM3ForCausalLM
