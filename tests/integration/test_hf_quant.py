"""Hugging Face checkpoints with integer weights: --torchao-config int8wo / int4wo-<group> (a float checkpoint
quantized at load) and GPTQ / AWQ 4-bit checkpoints (written here by tests/hf_quant_factory.py).

References: transformers on the float model (torchao: logits within the quantization error's bound; GPTQ/AWQ:
transformers on exactly the dequantized weights, tight), greedy generation through the scheduler loop, TP=2 vs
TP=1, and the start-up errors (a split that cuts a group, flags that do not fit the checkpoint).
"""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
import transformers

from tests.forward_steps import ForwardSteps
from tests.hf_quant_factory import write_prequant
from tests.model_factory import TINY
from tests.rank_processes import run_ranks
from tests.scheduler_harness import generate_in_process
from tokenloom.cache.memory_budget import model_nbytes
from tokenloom.config import ConfigError, ServerArgs
from tokenloom.distributed.parallel_state import ParallelContext
from tokenloom.executor.model_runner import ModelRunner
from tokenloom.kernels import quant_gemm
from tokenloom.kernels.quant_gemm import QuantMatrix, QuantSplitError, QuantTypeError
from tokenloom.layers.int_quant import IntQuantMatrix
from tokenloom.model_config import ModelConfigError
from tokenloom.models.loader import _safetensors_tensors, resolve_model_source
from tokenloom.models.prequant import convert, read_quant_config

PROMPT = list(range(3, 40))
# Wide enough for every int4 group (input features 256 and 512); q/k/v/o rows multiples of 16.
WIDE = {**TINY, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2}


def _hf(seed: int = 0, **kw) -> transformers.LlamaForCausalLM:
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**WIDE, **kw})).eval()


@pytest.fixture(scope="module")
def float_folder(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("float"))
    hf = _hf(tie_word_embeddings=False)
    hf.save_pretrained(folder, safe_serialization=True)
    return folder, hf


def _runner(path: str, **kw) -> ModelRunner:
    return ModelRunner(ServerArgs(model_path=path, **{"dtype": "float32", "max_total_tokens": 256,
                                                      "max_running_requests": 2, **kw}))


def _logits(runner: ModelRunner) -> torch.Tensor:
    steps = ForwardSteps(runner)
    return steps.extend([steps.start()], [PROMPT], return_all_logits=True)


def _reference(hf: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([PROMPT])).logits[0]


# torchao vs the float model: the weights' quantization error moves the logits. Measured on this random model
# (max |logit diff| / max |logit|, float32 and bf16 activations alike): int8wo 0.016; int4wo-32 0.14, -64 0.18 to
# 0.20, -128 0.22, -256 0.21 (random Gaussian weights are int4's worst case); top-1 agreement int8 1.0, int4 0.73
# to 0.84; w8a8_int8 (bf16) 0.023, top-1 0.97. Bounds: about 1.6-2x those. The tight check is the next test
# (the same quantized weights in float32).
TORCHAO_TOL = {"int8wo": (0.03, 0.95), "int4wo-32": (0.25, 0.6), "int4wo-64": (0.32, 0.6),
               "int4wo-128": (0.36, 0.6), "int4wo-256": (0.36, 0.6), "w8a8_int8": (0.05, 0.9)}


def _block_type(method: str) -> str:
    """The GGUF type layers/int_quant.py re-expresses `method`'s weights in (int8wo: 8 bits; symmetric GPTQ,
    "gptq_sym", every zero point 8; the others: 4 bits with a minimum)."""
    return {"int8wo": "Q8_0", "gptq_sym": "Q4_0"}.get(method, "Q4_1")


def _as_blocks(method: str, dtype: str) -> bool:
    """Whether layers/int_quant.py re-expresses `method`'s weights as GGUF blocks at `dtype` on this machine."""
    return dtype != "float32" and method != "w8a8_int8" \
        and quant_gemm.native_supported(quant_gemm.TYPE_IDS[_block_type(method)])


def _flags(method: str) -> dict[str, str]:
    return {"quantization": method} if method == "w8a8_int8" else {"torchao_config": method}


@pytest.mark.parametrize("method", list(TORCHAO_TOL))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_torchao_logits_close_to_the_float_model(float_folder, method, dtype):
    folder, hf = float_folder
    ref = _reference(hf)
    runner = _runner(folder, **_flags(method), dtype=dtype)
    qkv = runner.model.layers[0].self_attn.qkv_proj
    held = qkv.quant.segments[0].weight
    assert qkv.weight is None and qkv.quant.quant_types == [method]
    if _as_blocks(method, dtype):  # bf16 activations: re-expressed as GGUF blocks on the native kernels
        assert isinstance(held, QuantMatrix) and held.packed and held.name == _block_type(method)
    else:  # float32 activations (exact scales) and w8a8_int8: torch's kernels
        assert isinstance(held, IntQuantMatrix) and held.name == method
    assert runner.model.lm_head.weight is not None  # the LM head and embedding stay in --dtype
    mine = _logits(runner)
    tol, top1 = TORCHAO_TOL[method]
    assert (mine - ref).abs().max().item() < tol * ref.abs().max().item()
    assert (mine.argmax(-1) == ref.argmax(-1)).float().mean().item() >= top1


@pytest.mark.parametrize("method", [m for m in TORCHAO_TOL if m != "w8a8_int8"])
def test_torchao_logits_match_transformers_on_the_same_quantized_weights(float_folder, method):
    """float32 activations: the kernels multiply exactly the dequantized codes, so transformers with every
    linear weight replaced by quantize_for_method(w).dequantize() is the same model up to summation order."""
    import copy

    from tokenloom.layers.int_quant import quantize_for_method

    folder, hf = float_folder
    ref_model = copy.deepcopy(hf)
    with torch.no_grad():
        for name, module in ref_model.named_modules():
            if isinstance(module, torch.nn.Linear) and name != "lm_head":
                module.weight.copy_(quantize_for_method(module.weight, method).dequantize())
    ref = _reference(ref_model)
    mine = _logits(_runner(folder, torchao_config=method))
    assert (mine - ref).abs().max().item() < 1e-4 * max(1.0, ref.abs().max().item())


@pytest.mark.parametrize("method", ["int8wo", "int4wo-128", "w8a8_int8"])
def test_torchao_greedy_generation_runs_through_the_engine_loop(float_folder, method, caplog):
    folder, hf = float_folder
    with caplog.at_level(logging.INFO, logger="tokenloom"):
        runner = _runner(folder, **_flags(method), dtype="bfloat16")
    if _as_blocks(method, "bfloat16"):  # GGUF blocks: the one-call step runs them (a float LM head beside)
        assert runner.native_decode is not None and runner.native_decode.quantized
        assert runner.native_decode._lm_head_q is None
    else:  # declined, with the reason logged: torch's kernels have no native descriptor
        assert runner.native_decode is None
        assert "native decode step not used: the weights are integer weights on torch's kernels" in caplog.text
    params = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    ours = generate_in_process(runner, [PROMPT, PROMPT[:10]], [params, params])
    assert [len(o) for o in ours] == [8, 8]
    # The first token is the quantized model's own prefill argmax (the loop samples what the forward computes).
    assert ours[0][0] == _logits(_runner(folder, **_flags(method), dtype="bfloat16"))[-1].argmax().item()


def test_torchao_weight_bytes_and_load_line(float_folder, caplog):
    folder, _ = float_folder
    with caplog.at_level(logging.INFO, logger="tokenloom.models.loader"):
        runner = _runner(folder, torchao_config="int4wo-64", dtype="bfloat16")
    # 2 layers x (qkv, o, gate_up, down)
    assert "kept quantized: int4wo-64 x 8" in caplog.text
    layer = runner.model.layers[0]
    linear_params = sum(m.quant.rows * m.quant.segments[0].weight.cols for m in
                        (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj))
    held = sum(m.quant.segments[0].weight.nbytes for m in
               (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj))
    if _as_blocks("int4wo-64", "bfloat16"):  # Q4_1 blocks: nibbles + f16 (d, m) per 32 weights
        assert held == linear_params // 32 * 20
    else:  # torch's int4 form: nibbles + bf16 (scale, zero) per group
        assert held == linear_params // 2 + linear_params // 64 * 2 * 2
    # The model's memory accounting (the KV budget's) sees the int4 bytes, and no float copy of the linears.
    dense = _runner(folder, dtype="bfloat16").model
    assert model_nbytes(dense) - model_nbytes(runner.model) >= 2 * (2 * linear_params) - 2 * held


def test_torchao_flag_errors(float_folder, tmp_path):
    folder, _ = float_folder
    with pytest.raises(ConfigError, match="--torchao-config must be one of int8wo, int4wo-32, int4wo-64, "
                                          "int4wo-128, int4wo-256; got 'int4wo-100'"):
        ServerArgs(model_path=folder, torchao_config="int4wo-100")
    from tests.gguf_factory import write_gguf

    gguf = str(tmp_path / "tiny.gguf")
    write_gguf(gguf, _hf(tie_word_embeddings=True), lambda name: "Q8_0")
    with pytest.raises(ModelConfigError, match="--torchao-config int8wo applies to Hugging Face checkpoints"):
        resolve_model_source(ServerArgs(model_path=gguf, torchao_config="int8wo"))
    with pytest.raises(ModelConfigError, match="--quantization awq applies to Hugging Face checkpoints"):
        resolve_model_source(ServerArgs(model_path=gguf, quantization="awq"))
    with pytest.raises(ModelConfigError, match="--quantization w8a8_int8 applies to Hugging Face checkpoints"):
        resolve_model_source(ServerArgs(model_path=gguf, quantization="w8a8_int8"))
    with pytest.raises(ConfigError, match="--torchao-config int8wo .*cannot be combined with --quantization w8a8"):
        ServerArgs(model_path=folder, torchao_config="int8wo", quantization="w8a8_int8")
    with pytest.raises(ModelConfigError, match="CPU only"):
        resolve_model_source(ServerArgs(model_path=folder, torchao_config="int8wo", device="cuda"))


def test_torchao_group_that_does_not_fit_is_refused_naming_the_layer(tmp_path):
    folder = str(tmp_path / "narrow")
    _hf(hidden_size=64, intermediate_size=128).save_pretrained(folder, safe_serialization=True)
    with pytest.raises(QuantTypeError, match=r"layers\.0\.self_attn\.qkv_proj\.weight: 64 input features are not "
                                             r"whole groups of 128"):
        _runner(folder, torchao_config="int4wo-128")


PREQUANT = {  # name: (method, group, sym, v1[, bits])
    "gptq_v1_asym": ("gptq", 64, False, True),
    "gptq_v1_sym": ("gptq", 128, True, True),
    "gptq_v2": ("gptq", 32, False, False),
    "awq": ("awq", 64, False, False),
    "gptq8": ("gptq", 128, True, True, 8),  # Qwen's GPTQ-Int8 form: symmetric, groups of 128, v1
    "gptq8_channel": ("gptq", -1, True, False, 8),  # group_size -1: per output channel
    "gptq_channel": ("gptq", -1, False, True),  # 4 bits, per output channel
}
ACT_ORDER = "gptq_act_order"  # desc_act true: (gptq, 32, asymmetric, v1), each input's features in a random order


@pytest.fixture(scope="module")
def prequant(tmp_path_factory):
    cache: dict[str, tuple] = {}

    def get(name: str) -> tuple[str, dict, torch.nn.Module]:
        if name not in cache:
            method, group, sym, v1, *bits = PREQUANT[name] if name != ACT_ORDER else ("gptq", 32, False, True)
            folder = str(tmp_path_factory.mktemp(name))
            known, ref = write_prequant(folder, _hf(seed=2, tie_word_embeddings=True), method, group, sym, v1,
                                        desc_act=name == ACT_ORDER, bits=bits[0] if bits else 4)
            cache[name] = (folder, known, ref)
        return cache[name]

    return get


@pytest.mark.parametrize("name", list(PREQUANT))
def test_prequant_loads_exact_codes_and_matches_the_dequantized_model(prequant, name):
    folder, known, ref_model = prequant(name)
    method, group, _, _, *bits = PREQUANT[name]
    runner = _runner(folder)
    assert runner.source.quantization == method
    layer = runner.model.layers[1]
    down = layer.mlp.down_proj.quant.segments[0].weight
    width = bits[0] if bits else 4
    assert down.name == f"{method}-int{width}-" + ("channel" if group == -1 else f"g{group}") and down.packed
    # The codes as loaded (before packing) are the known ones exactly: unpack the same module again.
    with open(os.path.join(folder, "config.json")) as f:
        cfg = read_quant_config(json.load(f), "config.json")
    loaded = dict(convert(_safetensors_tensors(folder), cfg))
    q, z, s = known["model.layers.1.mlp.down_proj"]
    got = loaded["model.layers.1.mlp.down_proj.weight"]
    if width == 8:  # int8 codes q - 128, no zero points (every one 128)
        assert torch.equal(got.q.long(), q - 128) and got.zeros is None and bool((z == 128).all())
    else:
        assert torch.equal(got.q.long(), q) and torch.equal(got.zeros.long(), z)
    assert torch.equal(got.scales, s.float())
    # Logits vs transformers on exactly the dequantized weights (float32 activations: sums in another order).
    ref = _reference(ref_model)
    mine = _logits(runner)
    assert (mine - ref).abs().max().item() < 1e-4 * max(1.0, ref.abs().max().item())
    bf16 = _logits(_runner(folder, dtype="bfloat16"))
    assert (bf16 - ref).abs().max().item() < 0.05 * ref.abs().max().item()


@pytest.mark.parametrize("name,sidecar", [("gptq_v1_asym", "quantize_config.json"), ("awq", "quant_config.json")])
def test_prequant_config_in_a_sidecar_file(prequant, tmp_path, name, sidecar):
    """Checkpoints written by AutoGPTQ / AutoAWQ keep their quantization in quantize_config.json /
    quant_config.json (the older tools' own key names, no quant_method) rather than config.json: detected, they
    load as the same checkpoint with config.json's quantization_config does (the same logits); a malformed one
    is refused naming the file."""
    import shutil

    folder, _, _ = prequant(name)
    method, group, _, _, *_ = PREQUANT[name]
    copy = str(tmp_path / name)
    shutil.copytree(folder, copy)
    with open(os.path.join(copy, "config.json")) as f:
        cfg = json.load(f)
    qc = cfg.pop("quantization_config")
    if method == "gptq":
        side = {"bits": 4, "group_size": group, "desc_act": qc["desc_act"], "sym": qc["sym"],
                "true_sequential": True}
    else:
        side = {"zero_point": True, "q_group_size": group, "w_bit": 4, "version": "GEMM"}
    with open(os.path.join(copy, "config.json"), "w") as f:
        json.dump(cfg, f)
    with open(os.path.join(copy, sidecar), "w") as f:
        json.dump(side, f)
    runner = _runner(copy)
    assert runner.source.quantization == method
    assert torch.equal(_logits(runner), _logits(_runner(folder)))
    with open(os.path.join(copy, sidecar), "w") as f:
        json.dump({**side, "bits": 3, "w_bit": 3}, f)
    with pytest.raises(ModelConfigError, match=rf"{sidecar}: {method} with bits=3"):
        _runner(copy)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_act_order_gptq_matches_the_dequantized_model(prequant, dtype):
    """desc_act true: each layer's codes follow its own order of the input features (g_idx). Loaded, the columns
    are sorted by group and the layer gathers its input in that order: the dequantized weight is the reference's
    exactly, float32 logits equal transformers on it to summation order, bf16 (Q4_1 blocks, the gather before
    the native kernels) within bf16 noise, and the native decode step (its own gather) equals the modular path
    bit for bit."""
    folder, known, ref_model = prequant(ACT_ORDER)
    with open(os.path.join(folder, "config.json")) as f:
        cfg = read_quant_config(json.load(f), "config.json")
    assert cfg.act_order
    loaded = dict(convert(_safetensors_tensors(folder), cfg))
    got = loaded["model.layers.1.mlp.down_proj.weight"]
    assert got.in_perm is not None
    assert torch.equal(got.dequantize(), ref_model.model.layers[1].mlp.down_proj.weight.detach())
    runner = _runner(folder, dtype=dtype)
    seg = runner.model.layers[0].self_attn.qkv_proj.quant.segments[0]  # q/k/v share their input's order
    ref = _reference(ref_model)
    mine = _logits(runner)
    if dtype == "float32":
        assert isinstance(seg.weight, IntQuantMatrix) and seg.weight.in_perm is not None
        assert (mine - ref).abs().max().item() < 1e-4 * max(1.0, ref.abs().max().item())
        return
    if _as_blocks("gptq", dtype):
        assert isinstance(seg.weight, QuantMatrix) and seg.in_perm is not None
    assert (mine - ref).abs().max().item() < 0.05 * ref.abs().max().item()
    params = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    assert len(generate_in_process(_runner(folder, dtype=dtype), [PROMPT], [params])[0]) == 6
    native = _runner(folder, dtype=dtype, max_total_tokens=2048, max_running_requests=4)
    if _as_blocks("gptq", dtype):  # the GGUF blocks: the one-call step takes them, with its own gather
        from tests.integration.test_native_decode import _compare_paths, _tokens

        assert native.native_decode is not None and native.native_decode.quantized
        _compare_paths(native, _tokens(60, 1, 256), prompt=21)


def test_act_order_rows_split_by_input_features_are_refused(prequant):
    from tokenloom.models.loader import load_model

    source = resolve_model_source(ServerArgs(model_path=prequant(ACT_ORDER)[0]))
    with pytest.raises(QuantSplitError, match=r"_proj\.weight at --tp-size 2: an act-order .* --tp-size 1"):
        load_model(source, torch.float32, torch.device("cpu"), ParallelContext(tp_rank=0, tp_size=2))


def test_prequant_greedy_generation_matches_transformers(prequant):
    folder, _, ref_model = prequant("gptq_v1_asym")
    params = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    ours = generate_in_process(_runner(folder), [PROMPT], [params])[0]
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        for _ in range(8):
            ids = torch.cat((ids, ref_model(ids).logits[:, -1].argmax(-1, keepdim=True)), dim=1)
    assert ours == ids[0, len(PROMPT):].tolist()


def test_prequant_flag_mismatches(prequant, float_folder):
    folder, _, _ = prequant("awq")
    with pytest.raises(ModelConfigError, match="--quantization gptq, but the checkpoint is awq quantized"):
        resolve_model_source(ServerArgs(model_path=folder, quantization="gptq"))
    with pytest.raises(ModelConfigError, match="--torchao-config int8wo quantizes float weights, but this "
                                               "checkpoint is already awq quantized"):
        resolve_model_source(ServerArgs(model_path=folder, torchao_config="int8wo"))
    with pytest.raises(ModelConfigError, match="--quantization w8a8_int8 quantizes float weights, but this "
                                               "checkpoint is already awq quantized"):
        resolve_model_source(ServerArgs(model_path=folder, quantization="w8a8_int8"))
    with pytest.raises(ModelConfigError, match="cannot be loaded with --quantization none"):
        resolve_model_source(ServerArgs(model_path=folder, quantization="none"))
    assert resolve_model_source(ServerArgs(model_path=folder, quantization="awq")).prequant.group == 64


def test_prequant_split_that_cuts_a_group_is_refused(prequant):
    folder, _, _ = prequant("gptq_v1_sym")  # o_proj: 256 input features in groups of 128: TP 4 cuts them
    from tokenloom.models.loader import load_model

    source = resolve_model_source(ServerArgs(model_path=folder))
    ctx = ParallelContext(tp_rank=1, tp_size=4)
    with pytest.raises(QuantSplitError, match=r"o_proj\.weight at --tp-size 4: .*cuts a gptq-int4-g128 group"):
        load_model(source, torch.float32, torch.device("cpu"), ctx)


def _tp_rank(rank: int, path: str, flags: dict, port: int, results) -> None:
    import traceback

    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        torch.set_num_threads(1)
        args = ServerArgs(model_path=path, **{"dtype": "float32", "max_total_tokens": 256, "max_running_requests": 2,
                                              "tp_size": 2, **flags})
        runner = ModelRunner(args, parallel=ParallelContext(tp_rank=rank, tp_size=2, tp_group=dist.group.WORLD))
        results.put((rank, {"logits": _logits(runner).numpy().copy()}))
        dist.destroy_process_group()
    except Exception:
        results.put((rank, {"error": traceback.format_exc()}))


@pytest.mark.parametrize("which", ["awq", "awq_bf16", "torchao", "torchao_bf16", "w8a8", "gptq8_channel_bf16"])
def test_tensor_parallel_two_ranks_match_tp1(prequant, float_folder, which):
    """TP=2 against TP=1 on the same weights: the int4 checkpoints to float32 rounding. w8a8_int8 quantizes the
    activations per token, and at TP=2 each rank's row-parallel layer (o_proj, down_proj) takes that scale from
    its own half of the input features (as SGLang's w8a8 layers do): the two differ by int8 activation rounding,
    so within a few per cent of the logits' range, with the same greedy tokens. bf16 activations (the GGUF
    blocks, each rank holding its shard's blocks): the int8 activation blocks are the same 32 features on
    either side of the split, so the two differ by float32 summation order and the bf16 rounding of the
    partial sums all-reduced. A per-channel 8-bit GPTQ checkpoint's row-parallel layers split anywhere (each
    row's one scale goes with both halves)."""
    kind = which.removesuffix("_bf16")
    path = prequant(kind)[0] if kind in PREQUANT else float_folder[0]
    flags = {"torchao": {"torchao_config": "int4wo-64"}, "w8a8": {"quantization": "w8a8_int8"}}.get(kind, {})
    if which.endswith("_bf16"):
        flags = {**flags, "dtype": "bfloat16"}
    reference = _logits(_runner(path, **flags))
    got, _ = run_ranks(_tp_rank, 2, path, flags, join_s=180)
    for rank in range(2):
        assert "error" not in got[rank], got[rank].get("error")
        logits = torch.from_numpy(got[rank]["logits"])
        scale = max(1.0, reference.abs().max().item())
        if which == "w8a8" or which.endswith("_bf16"):
            assert (logits - reference).abs().max().item() < 0.03 * scale
            assert (logits.argmax(-1) == reference.argmax(-1)).float().mean().item() > 0.9
        else:
            assert (logits - reference).abs().max().item() < 1e-4 * scale


@pytest.mark.parametrize("which", ["int4wo-64", "int8wo", "gptq_v1_asym", "gptq_v1_sym", "awq", "gptq8"])
def test_native_decode_step_bit_identical_to_modular_path(prequant, float_folder, which):
    """bf16 (the default): the integer weights as GGUF blocks (Q4_1; Q4_0 for symmetric GPTQ; Q8_0 for int8wo
    and 8-bit GPTQ)
    are the one-call step's quantized linears, beside the float LM head, and every decode step's logits and KV
    equal the modular path's bit for bit."""
    from tests.integration.test_native_decode import _compare_paths, _tokens

    path = prequant(which)[0] if which in PREQUANT else float_folder[0]
    flags = {} if which in PREQUANT else {"torchao_config": which}
    runner = _runner(path, dtype="bfloat16", max_total_tokens=2048, max_running_requests=4, **flags)
    kind = {"gptq_v1_sym": "gptq_sym", "gptq8": "int8wo"}.get(which) or (PREQUANT[which][0] if which in PREQUANT
                                                                        else which)
    if not _as_blocks(kind, "bfloat16") or runner.native_decode is None:
        pytest.skip("no native quantized kernels or decode step on this machine")
    assert runner.native_decode.quantized and runner.native_decode._lm_head_q is None
    held = runner.model.layers[0].mlp.down_proj.quant.segments[0].weight
    assert isinstance(held, QuantMatrix) and held.name == _block_type(kind)
    _compare_paths(runner, _tokens(60, 1, 256), prompt=21)
    assert runner.token_allocator.available_size() == runner.max_total_num_tokens


def test_native_decode_step_at_tp2_on_gptq_blocks(prequant):
    """A GPTQ checkpoint in bf16 at --tp-size 2: each rank's shards as Q4_1 blocks in the native step (its
    all-reduces on the shared-memory communicator), bit-identical to that rank's modular path, the ranks agree,
    and both within bf16 noise of TP=1."""
    from tests.integration.test_quantized_gguf import check_native_decode_at_tp2

    path = prequant("gptq_v2")[0]
    single = _runner(path, dtype="bfloat16", max_total_tokens=512)
    if single.native_decode is None or not _as_blocks("gptq", "bfloat16"):
        pytest.skip("no native quantized kernels or decode step on this machine")
    check_native_decode_at_tp2(path, single)


def test_engine_serves_a_checkpoint_quantized_at_load(tiny_runtime_model):
    """The flag reaches the rank process through the real engine: its greedy tokens are the in-process
    quantized model's, and the server reports the kept types."""
    from tokenloom import Engine

    params = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    expected = generate_in_process(_runner(tiny_runtime_model, torchao_config="int4wo-32"), [PROMPT], [params])[0]
    with Engine(tiny_runtime_model, dtype="float32", torchao_config="int4wo-32", max_total_tokens=1024,
                log_level="warning") as eng:
        out = eng.generate(input_ids=PROMPT, sampling_params=params)
        report = eng.tokenizer_manager.scheduler_info  # the rank's ready message (the start-up summary's source)
    assert out["output_ids"] == expected
    assert report["weight_quantization"] == "int4wo-32 x 8"
