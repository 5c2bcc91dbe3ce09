"""Gemma 3 (text) from GGUF: the tiny model (tests/gemma_models.py, 6 layers so llama.cpp's default pattern
makes the last one global; query_pre_attn_scalar = head_dim, the scale llama.cpp derives for all sizes but
27B) converted by llama.cpp's own convert_hf_to_gguf.py, which writes norms as 1 + w, Gemma's names
(ffn_norm = the pre-feed-forward norm, post_ffw_norm, attn_q_norm...) and the local RoPE base.

The f32 file's logits of a prompt past the window, a chunk and a decode step are within 5e-5 of transformers
float32 on the HF weights, argmax equal. (Quantized files go through the loader's shared path, tested on
Llama in test_quantized_gguf.py; converting a second file here would double this test's cost.)

Gemma 2 has no GGUF test: llama.cpp's `gemma2` converter requires a SentencePiece tokenizer.model (Gemma 3's
falls back to the BPE tokenizer.json these test models carry)."""

from __future__ import annotations

import pytest
import torch

from tests.forward_steps import ForwardSteps
from tests.gemma_models import WINDOW, make_tiny_gemma
from tests.llama_cpp_convert import convert
from tokenloom.config import ServerArgs
from tokenloom.executor.model_runner import ModelRunner

TOL = 5e-5


@pytest.fixture(scope="module")
def gemma3_gguf(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("gemma3_gguf"))
    hf = make_tiny_gemma("gemma3", folder, num_hidden_layers=6, layer_types=None, query_pre_attn_scalar=32)
    assert hf.config.layer_types[-1] == "full_attention" and hf.config.layer_types[0] == "sliding_attention"
    return hf, convert(folder, f"{folder}/model-f32.gguf", "f32")


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
    hf, path = gemma3_gguf
    ours, ids = _logits(path, dtype="float32")
    ref = _reference(hf, ids)
    assert (ours - ref).abs().max().item() < TOL
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
