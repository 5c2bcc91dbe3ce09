"""compressed-tensors checkpoints of integer weights (W4A16 / W8A16, "pack-quantized"), written with the
compressed-tensors library's own compressor and config classes (tests/hf_quant_factory.py): the codes unpacked
exactly, float32 logits equal to transformers' on the dequantized weights, bf16 (GGUF blocks) within bf16 noise,
the native decode step bit-identical to the modular path, act-order g_idx, the real engine, and the refusals.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import transformers

from tests.forward_steps import ForwardSteps
from tests.hf_quant_factory import compress_weight, compressed_from_folder, compressed_scheme, w8a8_from_folder
from tests.scheduler_harness import generate_in_process
from tokenloom.config import ServerArgs
from tokenloom.executor.model_runner import ModelRunner
from tokenloom.kernels import quant_gemm
from tokenloom.kernels.quant_gemm import QuantMatrix
from tokenloom.layers.int_quant import IntQuantMatrix
from tokenloom.layers.quant_linear import quantized_weights
from tokenloom.model_config import ModelConfigError
from tokenloom.models.compressed_tensors import Scheme, read_scheme, unpack
from tokenloom.models.loader import resolve_model_source
from tokenloom.models.prequant import PrequantConfig, read_quant_config

PROMPT = list(range(3, 40))
WIDE = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 512, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False}
# (bits, group (-1: channel), symmetric, act-order) -> the GGUF blocks bf16 runs
CASES = {"w4_g128_sym": ((4, 128, True, False), "Q4_0"), "w4_g64_asym": ((4, 64, False, False), "Q4_1"),
         "w8_channel": ((8, -1, True, False), "Q8_0"), "w8_g64": ((8, 64, True, False), "Q8_0"),
         "w4_g32_act": ((4, 32, False, True), "Q4_1")}


def _config(**weights) -> dict:
    from compressed_tensors.quantization import QuantizationConfig

    scheme = compressed_scheme(weights.pop("bits", 4), weights.pop("group", 128), weights.pop("symmetric", True))
    qc = QuantizationConfig(config_groups={"group_0": scheme}, format="pack-quantized",
                            quantization_status="compressed", ignore=["lm_head"]).model_dump(mode="json")
    qc["config_groups"]["group_0"]["weights"].update(weights)
    return qc


def test_configs_read_and_refused():
    assert read_quant_config({"quantization_config": _config()}, "c") == \
        PrequantConfig("compressed-tensors", 128, False, False, 4, True)
    assert read_scheme(_config(bits=8, group=-1), "c") == Scheme(8, -1, True, False)
    assert read_scheme(_config(symmetric=False, group=64), "c") == Scheme(4, 64, False, False)
    assert read_scheme(_config(actorder="group"), "c").act_order
    assert not read_scheme(_config(actorder="weight"), "c").act_order
    bad = [({"num_bits": 2}, "int weights of 2 bits"), ({"type": "float", "num_bits": 8}, "float weights of 8"),
           ({"strategy": "tensor"}, "strategy 'tensor'"), ({"group_size": 48}, "group_size 48 at 4 bits"),
           ({"num_bits": 8, "symmetric": False, "strategy": "channel"}, "8-bit asymmetric")]
    for change, match in bad:
        with pytest.raises(ModelConfigError, match=rf"cfg.json: compressed-tensors {match}"):
            read_scheme(_config(**change), "cfg.json")
    w8a8 = _config()
    w8a8["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8, "type": "int", "strategy": "token",
                                                             "dynamic": True, "symmetric": True}
    static = json.loads(json.dumps(w8a8))
    static["format"] = "int-quantized"
    static["config_groups"]["group_0"]["input_activations"]["dynamic"] = False
    for qc, match in [(w8a8, "'pack-quantized' with quantized activations"),
                      ({**_config(), "format": "float-quantized"}, "format 'float-quantized'"),
                      ({**_config(), "format": "int-quantized"}, "without dynamic symmetric per-token"),
                      (static, "without dynamic symmetric per-token int8 activations"),
                      ({**_config(), "kv_cache_scheme": {"num_bits": 8, "type": "float"}}, "kv_cache_scheme"),
                      ({**_config(), "quantization_status": "frozen"}, "'frozen'"),
                      ({**_config(), "config_groups": {**_config()["config_groups"],
                                                       "group_1": _config(bits=8)["config_groups"]["group_0"]}},
                       "different schemes")]:
        with pytest.raises(ModelConfigError, match=match):
            read_scheme(qc, "cfg.json")


@pytest.mark.parametrize("case", list(CASES))
def test_unpacked_codes_give_the_exact_weight(case):
    (bits, group, symmetric, act), _ = CASES[case]
    w = torch.randn(48, 256, generator=torch.Generator().manual_seed(1)) * 0.05
    g_idx = (torch.randperm(256, generator=torch.Generator().manual_seed(2)) // group) if act else None
    tensors, exact = compress_weight(w, bits, group, symmetric, torch.bfloat16, g_idx)
    order = torch.sort(g_idx, stable=True).indices if act else None
    got = unpack(tensors, bits, group, symmetric, "layers.0.mlp.up_proj", "ct", order)
    assert torch.equal(got.dequantize(), exact)
    assert (exact - w).abs().max().item() < w.abs().max().item() / (3 if bits == 4 else 60)
    wrong = {**tensors, "weight_shape": torch.tensor([48, 128])}
    with pytest.raises(ModelConfigError, match=r"layers.0.mlp.up_proj: weight_packed .* do not fit weight_shape"):
        unpack(wrong, bits, group, symmetric, "layers.0.mlp.up_proj", "ct", order)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ct")
    torch.manual_seed(3)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**WIDE)).save_pretrained(str(root / "float"))
    made: dict[str, tuple[str, str]] = {}

    def get(case: str) -> tuple[str, str]:
        if case not in made:
            (bits, group, symmetric, act), _ = CASES[case]
            dst = str(root / case)
            made[case] = (dst, compressed_from_folder(str(root / "float"), dst, bits, group, symmetric,
                                                      act_order=act))
        return made[case]

    return get


def _runner(path: str, **kw) -> ModelRunner:
    return ModelRunner(ServerArgs(model_path=path, **{"dtype": "float32", "max_total_tokens": 2048,
                                                      "max_running_requests": 4, **kw}))


def _logits(runner: ModelRunner) -> torch.Tensor:
    steps = ForwardSteps(runner)
    return steps.extend([steps.start()], [PROMPT], return_all_logits=True)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers_on_the_dequantized_weights(checkpoints, case):
    """float32: torch's kernels (or the per-call dequantized form) on the exact weights; bf16 (the default):
    the GGUF blocks CASES names on the native kernels, the one-call decode step bit-identical to the modular
    path."""
    path, reference = checkpoints(case)
    (bits, group, _, _), block = CASES[case]
    hf = transformers.AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0]
    scale = ref.abs().max().item()
    runner = _runner(path)
    assert runner.source.quantization == "compressed-tensors"
    assert set(quantized_weights(runner.model)[1]) == \
        {f"compressed-tensors-int{bits}-" + ("channel" if group == -1 else f"g{group}")}
    assert (_logits(runner) - ref).abs().max().item() < 1e-4 * max(1.0, scale)
    bf16 = _runner(path, dtype="bfloat16")
    assert (_logits(bf16) - ref).abs().max().item() < 0.05 * scale
    if not quant_gemm.native_supported(quant_gemm.TYPE_IDS[block]) or bf16.native_decode is None:
        return
    held = bf16.model.layers[0].mlp.down_proj.quant.segments[0].weight
    assert isinstance(held, QuantMatrix) and held.name == block
    from tests.integration.test_native_decode import _compare_paths, _tokens

    assert bf16.native_decode.quantized
    _compare_paths(_runner(path, dtype="bfloat16"), _tokens(60, 1, 256), prompt=21)


def test_flags_and_engine(checkpoints, tiny_runtime_model, tmp_path):
    """--quantization compressed-tensors must match the checkpoint; the real engine (a rank process) serves a
    compressed-tensors copy of the runtime model with the in-process greedy tokens and reports its types."""
    from tokenloom import Engine

    path, _ = checkpoints("w4_g128_sym")
    with pytest.raises(ModelConfigError, match="--quantization gptq, but the checkpoint is compressed-tensors"):
        resolve_model_source(ServerArgs(model_path=path, quantization="gptq"))
    assert resolve_model_source(ServerArgs(model_path=path, quantization="compressed-tensors")).prequant.bits == 4
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["quantization_config"]["quant_method"] == "compressed-tensors"
    served = str(tmp_path / "served")
    compressed_from_folder(tiny_runtime_model, served, 4, 32, symmetric=False)
    params = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    expected = generate_in_process(_runner(served), [PROMPT], [params])[0]
    with Engine(served, dtype="float32", max_total_tokens=1024, log_level="warning") as eng:
        out = eng.generate(input_ids=PROMPT, sampling_params=params)
        report = eng.tokenizer_manager.scheduler_info
    assert out["output_ids"] == expected
    assert report["weight_quantization"].startswith("compressed-tensors-int4-g32 x ")


def test_w8a8_int8_checkpoint_is_the_w8a8_int8_scheme(tmp_path):
    """compressed-tensors W8A8 ("int-quantized", written by the library's IntQuantizationCompressor): each layer
    holds the checkpoint's int8 weight and channel scales with per-token int8 activations, i.e. exactly
    `--quantization w8a8_int8` run on the dequantized checkpoint (whose per-channel quantization finds the same
    codes): the two give equal logits; against transformers on the dequantized weights within the activations'
    int8 rounding (as the w8a8_int8 tests bound it)."""
    from compressed_tensors.quantization import QuantizationConfig

    from tests.hf_quant_factory import w8a8_scheme

    torch.manual_seed(4)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**WIDE)).save_pretrained(str(tmp_path / "float"))
    path = str(tmp_path / "w8a8")
    reference = w8a8_from_folder(str(tmp_path / "float"), path, scale_dtype=torch.float32)
    qc = read_quant_config({"quantization_config": QuantizationConfig(
        config_groups={"group_0": w8a8_scheme()}, format="int-quantized",
        quantization_status="compressed").model_dump(mode="json")}, "c")
    assert qc.activations and qc.name == "compressed-tensors-w8a8-int8"
    runner = _runner(path)
    held = runner.model.layers[0].mlp.down_proj.quant.segments[0].weight
    assert isinstance(held, IntQuantMatrix) and held.act_quant
    assert set(quantized_weights(runner.model)[1]) == {"compressed-tensors-w8a8-int8"}
    mine = _logits(runner)
    same_scheme = _logits(_runner(reference, quantization="w8a8_int8"))
    assert (mine - same_scheme).abs().max().item() < 1e-4 * max(1.0, same_scheme.abs().max().item())
    hf = transformers.AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0]
    assert (mine - ref).abs().max().item() < 0.03 * ref.abs().max().item()
    assert (mine.argmax(-1) == ref.argmax(-1)).float().mean().item() > 0.9
    bf16 = _logits(_runner(path, dtype="bfloat16"))
    assert (bf16 - ref).abs().max().item() < 0.05 * ref.abs().max().item()
