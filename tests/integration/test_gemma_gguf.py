"""Gemma 3 (text) from GGUF: the tiny model (tests/gemma_models.py, 6 layers so llama.cpp's default pattern
makes the last one global; query_pre_attn_scalar = head_dim, the scale llama.cpp derives for all sizes but
27B) converted by llama.cpp's own convert_hf_to_gguf.py, which writes norms as 1 + w, Gemma's names
(ffn_norm = the pre-feed-forward norm, post_ffw_norm, attn_q_norm...) and the local RoPE base.

- f32 file: logits of a prompt past the window, a chunk and a decode step within 5e-5 of transformers
  float32 on the HF weights, argmax equal;
- q8_0 file, kept quantized (the default): within 0.03 of transformers on the weights the `gguf` package
  dequantizes the file to (names mapped by this test's own table; activations are quantized to int8 per
  block, as llama.cpp does), argmax equal.

Gemma 2 has no GGUF test: llama.cpp's `gemma2` converter requires a SentencePiece tokenizer.model (Gemma 3's
falls back to the BPE tokenizer.json these test models carry)."""

from __future__ import annotations

import copy
import re

import pytest
import torch

from tests.forward_steps import ForwardSteps
from tests.gemma_models import WINDOW, make_tiny_gemma
from tests.llama_cpp_convert import convert
from tokenloom.config import ServerArgs
from tokenloom.executor.model_runner import ModelRunner

TOL = 5e-5
QUANT_TOL = 0.03
GGUF_TO_HF = {"attn_norm": "input_layernorm", "ffn_norm": "pre_feedforward_layernorm",
              "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
              "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm", "attn_q": "self_attn.q_proj",
              "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
              "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


@pytest.fixture(scope="module")
def gemma3_gguf(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("gemma3_gguf"))
    hf = make_tiny_gemma("gemma3", folder, num_hidden_layers=6, layer_types=None, query_pre_attn_scalar=32)
    assert hf.config.layer_types[-1] == "full_attention" and hf.config.layer_types[0] == "sliding_attention"
    files = {t: convert(folder, f"{folder}/model-{t}.gguf", t) for t in ("f32", "q8_0")}
    return hf, files


def _dequantized_reference(hf: torch.nn.Module, path: str) -> torch.nn.Module:
    """transformers' model with the file's weights as the `gguf` package dequantizes them."""
    import gguf

    state = {}
    for t in gguf.GGUFReader(path).tensors:
        w = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()).float()
        w = w.reshape(tuple(int(d) for d in reversed(t.shape.tolist())))
        m = re.match(r"blk\.(\d+)\.(\w+)\.weight", t.name)
        name = f"model.layers.{m.group(1)}.{GGUF_TO_HF[m.group(2)]}.weight" if m else \
            {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}[t.name]
        state[name] = w - 1 if name.endswith("norm.weight") else w  # the converter stored 1 + w
    ref = copy.deepcopy(hf)
    missing, unexpected = ref.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    ref.tie_weights()
    return ref


def _logits(path: str, **flags) -> tuple[torch.Tensor, list[int]]:
    runner = ModelRunner(ServerArgs(model_path=path, max_total_tokens=512, max_running_requests=2, **flags))
    steps = ForwardSteps(runner)
    prompt = torch.randint(3, 49152, (2 * WINDOW + 3,), generator=torch.Generator().manual_seed(3)).tolist()
    seq = steps.start()
    out = [steps.extend([seq], [prompt], return_all_logits=True),
           steps.extend([seq], [[7, 8]], return_all_logits=True), steps.extend([seq], [[9]])]
    steps.release(seq)
    return torch.cat(out), prompt + [7, 8, 9]


def _reference(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def test_f32_gguf_matches_transformers(gemma3_gguf):
    hf, files = gemma3_gguf
    ours, ids = _logits(files["f32"], dtype="float32")
    ref = _reference(hf, ids)
    assert (ours - ref).abs().max().item() < TOL
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_q8_0_gguf_matches_its_dequantized_weights(gemma3_gguf):
    hf, files = gemma3_gguf
    ref_model = _dequantized_reference(hf, files["q8_0"])
    kept, ids = _logits(files["q8_0"], dtype="float32")
    ref = _reference(ref_model, ids)
    assert (kept - ref).abs().max().item() < QUANT_TOL
    assert torch.equal(kept.argmax(-1), ref.argmax(-1))
    assert (ref - _reference(hf, ids)).abs().max().item() > 1e-3  # the file is really quantized
