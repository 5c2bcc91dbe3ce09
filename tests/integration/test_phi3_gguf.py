"""Phi-3 GGUF files written by llama.cpp's own convert_hf_to_gguf.py (arch `phi3`: fused `attn_qkv` and `ffn_up`
holding gate|up, LongRoPE as `rope_factors_long/short` tensors plus original length and attention factor in the
metadata, the rotated width as rope.dimension_count) from a tiny Phi-4-mini-shaped transformers model: the
config read back equals the HF one, float32 logits equal transformers' (a prompt past the original length and
a shorter one in one batch), a Q8_0 file kept quantized splits its fused tensors on row boundaries, at TP=1
and across two TP ranks.

The converter takes its BPE path for Phi-3 only when tokenizer_config.json names GPT2Tokenizer (as Phi-4-mini's
does); the test folder says so beside SmolLM2's tokenizer (a SentencePiece tokenizer.model, which Phi-3-mini's
path needs, cannot be made offline)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

from tests.forward_steps import ForwardSteps
from tests.llama_cpp_convert import convert
from tests.phi3_factory import ORIG, make_tiny_phi3
from tests.rank_processes import run_ranks
from tokenloom.config import ServerArgs
from tokenloom.distributed.parallel_state import ParallelContext
from tokenloom.executor.model_runner import ModelRunner
from tokenloom.layers.quant_linear import QuantWeight
from tokenloom.model_config import ModelConfig

LENGTHS = [37, 150]  # short factors; long factors (past the original length of 64)


@pytest.fixture(scope="module")
def phi3_gguf(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("phi3_gguf_src"))
    hf = make_tiny_phi3(folder, "phi4mini_longrope_partial", smollm2_tokenizer=True)
    path = os.path.join(folder, "tokenizer_config.json")
    with open(path) as f:
        tok = json.load(f)
    tok["tokenizer_class"] = "GPT2Tokenizer"
    with open(path, "w") as f:
        json.dump(tok, f)
    out = str(tmp_path_factory.mktemp("phi3_gguf"))
    files = {t: convert(folder, os.path.join(out, f"phi3-{t}.gguf"), t) for t in ("f32", "q8_0")}
    return folder, hf, files


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(4)
    return [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in LENGTHS]


def _runner(path: str, **kw) -> ModelRunner:
    return ModelRunner(ServerArgs(model_path=path, **{"dtype": "float32", "max_total_tokens": 1024,
                                                      "max_running_requests": 4, **kw}))


def _logits(runner: ModelRunner) -> list[torch.Tensor]:
    steps = ForwardSteps(runner)
    prompts = _prompts()
    out = steps.extend([steps.start() for _ in prompts], prompts, return_all_logits=True)
    return list(torch.split(out, LENGTHS))


def _reference(hf: torch.nn.Module) -> list[torch.Tensor]:
    with torch.no_grad():
        return [hf(torch.tensor([p])).logits[0].float() for p in _prompts()]


def test_phi3_gguf_config_and_f32_logits_equal_transformers(phi3_gguf):
    folder, hf, files = phi3_gguf
    runner = _runner(files["f32"])
    cfg = runner.model.cfg
    hf_cfg = ModelConfig.from_hf_dict(json.loads(Path(folder, "config.json").read_text()), "hf")
    assert cfg.architecture == "Phi3ForCausalLM" and cfg.partial_rotary_factor == 0.75
    assert cfg.rope_scaling["original_max_position_embeddings"] == ORIG and cfg.rope_scaling["factor"] == 8.0
    for key in ("short_factor", "long_factor"):
        assert cfg.rope_scaling[key] == pytest.approx(hf_cfg.rope_scaling[key], rel=1e-7)
    assert runner.model.rotary.attention_factor == pytest.approx(math.sqrt(1 + math.log(8) / math.log(ORIG)))
    for mine, ref in zip(_logits(runner), _reference(hf), strict=True):
        assert (mine - ref).abs().max().item() < 1e-4
        assert torch.equal(mine.argmax(-1), ref.argmax(-1))


def test_phi3_q8_0_kept_quantized_splits_fused_rows(phi3_gguf):
    _, _, files = phi3_gguf
    quant = _runner(files["q8_0"])
    layer = quant.model.layers[0]
    for lin in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj):
        assert lin.weight is None and isinstance(lin.quant, QuantWeight)  # no float copy of the fused tensor
    dense = _logits(_runner(files["q8_0"], quantization="none"))  # the same file dequantized at load
    for mine, exact in zip(_logits(quant), dense, strict=True):
        # the kernel quantizes activations to 8 bits too: close to the dequantized file's float32 forward (whose
        # own loading splits float rows); a wrong split of the fused rows mixes heads and is far off
        assert (mine - exact).abs().max().item() < 0.02 * exact.abs().max().item()
        assert (mine.argmax(-1) == exact.argmax(-1)).float().mean().item() > 0.9


def _tp_rank(rank: int, path: str, port: int, results) -> None:
    import traceback

    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        torch.set_num_threads(1)
        args = ServerArgs(model_path=path, dtype="float32", max_total_tokens=1024, max_running_requests=4,
                          tp_size=2)
        runner = ModelRunner(args, parallel=ParallelContext(tp_rank=rank, tp_size=2, tp_group=dist.group.WORLD))
        results.put((rank, {"logits": [t.numpy().copy() for t in _logits(runner)]}))
        dist.destroy_process_group()
    except Exception:
        results.put((rank, {"error": traceback.format_exc()}))


def test_phi3_q8_0_two_tp_ranks_match_tp1(phi3_gguf):
    """Each rank takes its q, k, v rows and gate, up rows out of the fused quantized tensors: a rank slicing
    the fused rows by rank would mix heads and give other logits."""
    _, _, files = phi3_gguf
    reference = _logits(_runner(files["q8_0"]))
    got, _ = run_ranks(_tp_rank, 2, files["q8_0"], join_s=240)
    for rank in range(2):
        assert "error" not in got[rank], got[rank].get("error")
        for mine, ref in zip(got[rank]["logits"], reference, strict=True):
            assert (torch.from_numpy(mine) - ref).abs().max().item() < 1e-4 * max(1.0, ref.abs().max().item())
