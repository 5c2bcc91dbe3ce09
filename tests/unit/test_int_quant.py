"""Integer weights of HF checkpoints (tokenloom/layers/int_quant.py, tokenloom/models/prequant.py).

Kernels vs a float32 matmul of the same quantized weight (`kernel_weight`: the codes with the scales and zero
points rounded as the kernel holds them); torchao-style quantization error bounds; GPTQ and AWQ unpacking
against codes quantized and packed independently (tests/hf_quant_factory.py), exactly.
"""

from __future__ import annotations

import pytest
import torch

from tests.hf_quant_factory import dequant, pack, quantize_groups
from tokenloom.kernels.quant_gemm import (
    TYPE_IDS,
    QuantMatrix,
    QuantSplitError,
    QuantTypeError,
    _native,
    dequantize,
    native_supported,
)
from tokenloom.layers.int_quant import (
    INT8PACK_MAX_ROWS,
    IntQuantMatrix,
    quantize_for_method,
    quantize_int4_grouped,
    quantize_int8_per_channel,
)
from tokenloom.layers.quant_linear import QuantWeight
from tokenloom.model_config import ModelConfigError
from tokenloom.models.prequant import PrequantConfig, convert, read_quant_config, unpack_awq, unpack_gptq


def _w(n: int = 64, k: int = 256, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("method", ["int8wo", "int4wo-32", "int4wo-64", "int4wo-128", "int4wo-256"])
@pytest.mark.parametrize("m", [1, 3, INT8PACK_MAX_ROWS + 5])
def test_kernel_matches_float_matmul_of_the_same_quantized_weight(method, dtype, m):
    w = _w()
    qm = quantize_for_method(w, method)
    ref_w = qm.kernel_weight(dtype)
    x = torch.randn(m, 256, generator=torch.Generator().manual_seed(1)).to(dtype)
    bias = torch.randn(64).to(dtype)
    prepared = qm.prepare(dtype)
    y = prepared.linear(x, bias, torch.float32)
    ref = x.float() @ ref_w.t() + bias.float()
    # float32: sums in another order (1e-5); bf16: the kernel's output rounded to bf16 (2^-8 relative)
    tol = 1e-5 if dtype == torch.float32 else 2 ** -7
    assert y.shape == (m, 64)
    assert (y - ref).abs().max().item() <= tol * max(1.0, ref.abs().max().item())
    # the quantization itself: int8 error <= s/2 per weight, int4 <= s/2 (+ the bf16 rounding of s, z')
    err = (qm.dequantize() - w).abs().max().item()
    bound = (w.abs().max() / 127 / 2).item() if method == "int8wo" else ((w.max() - w.min()) / 15 / 2).item()
    assert err <= bound * 1.001
    assert (ref_w - w).abs().max().item() <= bound * 1.001 + (0 if dtype == torch.float32 else 0.02 * w.abs().max())


def test_int8_and_int4_bytes():
    w = _w(128, 512)
    int8 = quantize_int8_per_channel(w).prepare(torch.bfloat16)
    int4 = quantize_int4_grouped(w, 128).prepare(torch.bfloat16)
    assert int8.nbytes == 128 * 512 + 128 * 2  # int8 codes + bf16 scales
    assert int4.nbytes == 128 * 512 // 2 + 4 * 128 * 2 * 2  # nibbles + bf16 (scale, zero) per group
    with pytest.raises(RuntimeError, match="cannot be sliced"):
        int4.narrow_rows(0, 16)


def test_bad_shapes_are_refused_naming_the_tensor():
    with pytest.raises(QuantTypeError, match="layers.0.mlp.down_proj.weight: 96 input features .*int4wo-64"):
        quantize_int4_grouped(_w(64, 96), 64, "layers.0.mlp.down_proj.weight")
    with pytest.raises(QuantTypeError, match="o_proj.weight: 24 output rows; .*multiple of 16"):
        quantize_int4_grouped(_w(24, 64), 32).prepare(torch.bfloat16, "o_proj.weight")
    with pytest.raises(QuantSplitError, match=r"down_proj.weight at --tp-size 2: .* cuts a int4wo-128 group of 128"):
        quantize_int4_grouped(_w(32, 384), 128).narrow_cols(192, 192, "down_proj.weight at --tp-size 2")
    part = quantize_int4_grouped(_w(32, 256), 64).narrow_cols(64, 128)  # on group boundaries: fine
    assert part.shape == (32, 128) and part.scales.shape == (32, 2)


@pytest.mark.parametrize("sym", [False, True])
@pytest.mark.parametrize("method,v1", [("gptq", True), ("gptq", False), ("awq", False)])
def test_unpacking_gives_the_known_codes_exactly(method, v1, sym):
    group = 32
    q, z, s = quantize_groups(_w(48, 128), group, sym)
    t = pack(method, q, z, s, group, v1)
    cfg = PrequantConfig(method, group, v1)
    qm = (unpack_gptq if method == "gptq" else unpack_awq)(t["qweight"], t["qzeros"], t["scales"], cfg, "x")
    assert torch.equal(qm.q.long(), q) and torch.equal(qm.zeros.long(), z) and torch.equal(qm.scales, s.float().t().t())
    assert torch.equal(qm.dequantize(), dequant(q, z, s, group))


def test_convert_streams_weights_and_checks_g_idx():
    q, z, s = quantize_groups(_w(32, 64), 32, False)
    t = pack("gptq", q, z, s, 32)
    cfg = PrequantConfig("gptq", 32, True)
    named = [(f"model.layers.0.mlp.up_proj.{k}", v) for k, v in t.items()] + [("model.norm.weight", torch.ones(4))]
    out = dict(convert(iter(named), cfg))
    assert set(out) == {"model.layers.0.mlp.up_proj.weight", "model.norm.weight"}
    t["g_idx"] = t["g_idx"].flip(0)  # act-order, in a checkpoint that says desc_act false
    with pytest.raises(ModelConfigError, match=r"up_proj.g_idx: .*desc_act false"):
        list(convert(iter([("model.layers.0.mlp.up_proj.g_idx", t["g_idx"])]), cfg))
    with pytest.raises(ModelConfigError, match="up_proj: gptq checkpoint lacks qzeros, scales"):
        list(convert(iter([("model.layers.0.mlp.up_proj.qweight", t["qweight"])]), cfg))


@pytest.mark.parametrize("qc,match", [
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "bits=3; implemented: 4- and 8-bit"),
    ({"quant_method": "awq", "bits": 8, "group_size": 128}, "bits=8; implemented: 4-bit"),
    ({"quant_method": "gptq", "bits": 8, "group_size": 128, "sym": False}, "8-bit with sym false"),
    ({"quant_method": "gptq", "bits": 8, "group_size": 48}, "8-bit group_size 48; .*multiples of 32"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 48}, "gptq group_size 48; implemented: 32, 64, 128, 256 or -1"),
    ({"quant_method": "awq", "bits": 4, "group_size": -1}, "awq group_size -1; implemented: 32, 64, 128, 256$"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "gemv"),
    ({"quant_method": "fp8"}, "'fp8' is not supported"),
])
def test_quant_configs_outside_the_implementation_are_refused(qc, match):
    with pytest.raises(ModelConfigError, match=match):
        read_quant_config({"quantization_config": qc}, "cfg.json")
    assert read_quant_config({}, "cfg.json") is None
    good = read_quant_config({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 64,
                                                      "desc_act": False, "checkpoint_format": "gptq_v2"}}, "c")
    assert good == PrequantConfig("gptq", 64, False)
    act_order = read_quant_config({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128,
                                                           "desc_act": True}}, "c")
    assert act_order == PrequantConfig("gptq", 128, True, act_order=True)
    int8 = read_quant_config({"quantization_config": {"quant_method": "gptq", "bits": 8, "group_size": -1,
                                                      "sym": True}}, "c")
    assert int8 == PrequantConfig("gptq", -1, True, bits=8) and int8.name == "gptq-int8-channel"
    int4 = read_quant_config({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": -1}}, "c")
    assert int4 == PrequantConfig("gptq", -1, True) and int4.name == "gptq-int4-channel"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gptq_4bit_per_channel(dtype):
    """group_size -1: one (scale, zero) a row. The codes unpack exactly; torch's int4 op takes no such group,
    so without the GGUF blocks (float32) the weight is dequantized per call (a float32 matmul's result); with
    bf16 activations, Q4_1 blocks (the row's scale repeated per block); a split of the input features anywhere
    keeps each row's scale and zero."""
    q, z, s = quantize_groups(_w(48, 256), -1, False)
    t = pack("gptq", q, z, s, -1, True)
    qm = unpack_gptq(t["qweight"], t["qzeros"], t["scales"], PrequantConfig("gptq", -1, True), "x")
    exact = dequant(q, z, s, -1)
    assert qm.group == 256 and torch.equal(qm.q.long(), q) and torch.equal(qm.dequantize(), exact)
    assert torch.equal(qm.narrow_cols(96, 64).dequantize(), exact[:, 96:160])
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(3)).to(dtype)
    qw = QuantWeight.from_parts([qm])
    qw.prepare(dtype)
    y = qw.linear(x, None, torch.float32).double()
    ref = x.double() @ exact.double().t()
    mag = (x.double().abs() @ exact.double().abs().t()).max().item()
    if isinstance(qw.segments[0].weight, QuantMatrix):
        assert dtype == torch.bfloat16 and qw.segments[0].weight.name == "Q4_1"
        assert (y - ref).abs().max().item() < 2 ** -7 * mag
    else:
        assert isinstance(qw.segments[0].weight, IntQuantMatrix)
        tol = 1e-5 if dtype == torch.float32 else 2 ** -7
        assert (y - ref).abs().max().item() < tol * mag


@pytest.mark.parametrize("group", [32, 128, -1])
@pytest.mark.parametrize("v1", [True, False])
def test_gptq_8bit_unpacks_to_int8_codes_exactly(group, v1):
    """8-bit GPTQ (four codes a word, zero points 128 stored as 127 in v1): int8 codes q - 128 (which reach
    -128), the fp16 scales per group, the dequantized weight the checkpoint's exactly; a zero point other than
    128 is refused naming the layer."""
    q, z, s = quantize_groups(_w(48, 256), group, True, bits=8)
    assert int(q.min()) == 0  # some code minus its zero point is -128, beyond a Q8_0 file's [-127, 127]
    t = pack("gptq", q, z, s, group, v1, bits=8)
    assert t["qweight"].shape == (64, 48) and t["qzeros"].shape == (s.shape[1], 12)
    qm = unpack_gptq(t["qweight"], t["qzeros"], t["scales"], PrequantConfig("gptq", group, v1, bits=8), "x")
    assert qm.bits == 8 and qm.q.dtype == torch.int8 and qm.zeros is None
    assert torch.equal(qm.q.long(), q - 128) and torch.equal(qm.scales, s.float())
    assert torch.equal(qm.dequantize(), dequant(q, z, s, group))
    t["qzeros"] = pack("gptq", q, z + 1, s, group, v1, bits=8)["qzeros"]
    with pytest.raises(ModelConfigError, match="layers.0.mlp.up_proj: gptq 8-bit zero points other than 128"):
        unpack_gptq(t["qweight"], t["qzeros"], t["scales"], PrequantConfig("gptq", group, v1, bits=8),
                    "layers.0.mlp.up_proj")


@pytest.mark.parametrize("group", [32, 128, -1])
@pytest.mark.parametrize("m", [1, 4, 64, 67])
def test_gptq_8bit_weights_run_as_q8_0_blocks(group, m):
    """bf16 activations: Q8_0 blocks holding the codes and fp16 scales bit for bit (code -128 included), on the
    native kernels within the int8 activation terms' bound (or the bf16 tile's on the many-row path); float32
    activations: the weight dequantized per call (torch has no grouped int8 kernel), a float32 matmul's
    result; a column split on group boundaries (or any split, per channel) keeps the weight's columns."""
    q, z, s = quantize_groups(_w(96, 256), group, True, bits=8)
    t = pack("gptq", q, z, s, group, True, bits=8)
    qm = unpack_gptq(t["qweight"], t["qzeros"], t["scales"], PrequantConfig("gptq", group, True, bits=8), "x")
    exact = dequant(q, z, s, group).double()
    x = (torch.randn(m, 256, generator=torch.Generator().manual_seed(5)) * 2).to(torch.bfloat16)
    f32 = QuantWeight.from_parts([qm])
    f32.prepare(torch.float32)
    assert isinstance(f32.segments[0].weight, IntQuantMatrix)
    y32 = f32.linear(x.float(), None, torch.float32).double()
    assert (y32 - x.double() @ exact.t()).abs().max().item() < 1e-5 * (x.double().abs() @ exact.abs().t()).max()
    half = qm.narrow_cols(128, 128)
    assert torch.equal(half.dequantize(), exact[:, 128:].float())
    if not native_supported(TYPE_IDS["Q8_0"]):
        pytest.skip("no native Q8_0 kernels on this machine")
    blocks = qm.as_gguf_blocks(torch.bfloat16)
    assert blocks.name == "Q8_0" and blocks.nbytes == 96 * 256 // 32 * 34
    assert torch.equal(dequantize(blocks).double(), exact)
    qw = QuantWeight.from_parts([qm])
    qw.prepare(torch.bfloat16)
    held = qw.segments[0].weight
    assert isinstance(held, QuantMatrix) and held.name == "Q8_0"
    ref = x.double() @ exact.t()
    mag = x.double().abs() @ exact.abs().t()
    if _native().quant_path(held.qtype, m, 256, 0) == 0:  # many rows: the weight tile rounded once to bf16
        bound = 2.0 ** -8 * mag + 1e-6
    else:
        dx = x.double().abs().view(m, 8, 32).amax(-1).repeat_interleave(32, dim=1) / 127
        bound = (dx / 256) @ exact.abs().t() + 1e-5 * mag + 1e-6
    assert ((qw.linear(x, None, torch.float32).double() - ref).abs() <= bound).all()


def _act_order_module(n: int = 48, k: int = 256, group: int = 32, seed: int = 7):
    """GPTQ codes of a weight quantized in a random order of its input features: (packed tensors, float
    reference in the features' own order)."""
    w = _w(n, k)
    order = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
    q, z, s = quantize_groups(w[:, order], group, False)
    codes = torch.empty_like(q)
    codes[:, order] = q
    g_idx = torch.empty(k, dtype=torch.int64)
    g_idx[order] = torch.arange(k) // group
    ref = torch.empty(n, k)
    ref[:, order] = dequant(q, z, s, group)
    return pack("gptq", codes, z, s, group, True, g_idx), ref


def test_act_order_gptq_loads_sorted_by_group():
    """desc_act: the columns sorted by g_idx (each group contiguous, `in_perm` their order); dequantize gives the
    weight in the input features' own order exactly; the torch kernel (float32) and the GGUF blocks (bf16) both
    gather x in that order; a g_idx whose groups are not group_size features each, a split of the input
    features, and joining rows of another order are refused."""
    t, ref = _act_order_module()
    cfg = PrequantConfig("gptq", 32, True, act_order=True)
    named = [(f"model.layers.0.mlp.up_proj.{k}", v) for k, v in t.items()]
    qm = dict(convert(iter(named), cfg))["model.layers.0.mlp.up_proj.weight"]
    assert qm.in_perm is not None and torch.equal(qm.dequantize(), ref)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(8))
    f32 = QuantWeight.from_parts([qm])
    f32.prepare(torch.float32)
    err = (f32.linear(x, None, torch.float32) - x @ ref.t()).abs().max().item()
    assert err <= 1e-5 * (x.abs() @ ref.abs().t()).max().item()
    if native_supported(TYPE_IDS["Q4_1"]):
        bf16 = QuantWeight.from_parts([qm])
        bf16.prepare(torch.bfloat16)
        assert isinstance(bf16.segments[0].weight, QuantMatrix) and bf16.segments[0].in_perm is not None
        xb = x.to(torch.bfloat16)
        exact = xb.double() @ qm.kernel_weight(torch.bfloat16).double().t()
        assert (bf16.linear(xb, None, torch.float32).double() - exact).abs().max().item() <= 0.01 * exact.abs().max()
    with pytest.raises(QuantSplitError, match="act-order"):
        qm.narrow_cols(0, 128, "up_proj")
    assert qm.narrow_cols(0, 256).in_perm is qm.in_perm  # tp-size 1: the whole width
    other = dict(convert(iter([(f"m.{k}", v) for k, v in _act_order_module(seed=9)[0].items()]), cfg))["m.weight"]
    with pytest.raises(QuantTypeError, match="act-order"):
        type(qm).cat_rows([qm, other])
    bad = dict(t, g_idx=torch.zeros(256, dtype=torch.int32))  # every feature in group 0
    with pytest.raises(ModelConfigError, match="do not each hold group_size"):
        list(convert(iter([(f"m.{k}", v) for k, v in bad.items()]), cfg))


@pytest.mark.parametrize("m", [1, 5, 33])
def test_w8a8_kernel_matches_float_matmul_of_the_quantized_activations_and_weights(m):
    from tokenloom.layers.int_quant import quantize_rows_int8

    w = _w(96, 256)
    qm = quantize_for_method(w, "w8a8_int8")
    x = (torch.randn(m, 256, generator=torch.Generator().manual_seed(3)) * 3).to(torch.bfloat16)
    xq, sx = quantize_rows_int8(x)
    assert xq.dtype == torch.int8 and (xq.float() * sx - x.float()).abs().max() <= sx.max() / 2 * 1.001
    ref = (xq.float() * sx) @ qm.kernel_weight(torch.bfloat16).t()  # int32 sums are exact; scales in float32
    y = qm.prepare(torch.bfloat16).linear(x, None, torch.float32)
    assert (y - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
    assert torch.equal(qm.kernel_weight(torch.bfloat16), qm.dequantize())  # float32 weight scales, unrounded


_NATIVE_BLOCKS = pytest.mark.skipif(not (native_supported(TYPE_IDS["Q4_1"]) and native_supported(TYPE_IDS["Q8_0"])),
                                    reason="no native Q4_1 / Q8_0 kernels on this machine")


@_NATIVE_BLOCKS
@pytest.mark.parametrize("method,v1", [("gptq", True), ("awq", False)])
@pytest.mark.parametrize("group", [32, 128])
def test_gguf_blocks_of_a_checkpoints_int4_weights(method, v1, group):
    """GPTQ/AWQ codes (fp16 scales, integer zero points) as Q4_1 blocks: d is the scale exactly, the minimum
    -z s is rounded once to f16, so every weight is within half an f16 ulp of |z s| (at most 1/128 of the
    group's step) of (q - z) s; the file's bytes are the gguf package's Q4_1 blocks (its dequantize agrees)."""
    q, z, s = quantize_groups(_w(48, 256), group, False)
    t = pack(method, q, z, s, group, v1)
    qm = (unpack_gptq if method == "gptq" else unpack_awq)(t["qweight"], t["qzeros"], t["scales"],
                                                         PrequantConfig(method, group, v1), "x")
    blocks = qm.as_gguf_blocks(torch.bfloat16)
    assert blocks.name == "Q4_1" and blocks.shape == (48, 256) and blocks.nbytes == 48 * 256 // 32 * 20
    exact = dequant(q, z, s, group).double()
    got = dequantize(blocks).double()  # the gguf package's reading of the bytes
    zs = (z.double() * s.double()).repeat_interleave(group, dim=1)
    assert ((got - exact).abs() <= zs * 2.0 ** -11 + 1e-12).all()
    assert ((got - exact).abs() <= s.double().repeat_interleave(group, dim=1) / 128).all()
    d = torch.from_numpy(blocks.data.numpy().reshape(48, 8, 20)[..., :2].copy()).view(torch.float16)[..., 0]
    assert torch.equal(d, s.repeat_interleave(group // 32, dim=1))  # the scales, bit for bit
    assert torch.equal(qm.kernel_weight(torch.bfloat16), got.float())


@_NATIVE_BLOCKS
@pytest.mark.parametrize("group", [32, 128])
def test_symmetric_gptq_weights_are_q4_0_blocks_exactly(group):
    """Every zero point 8 (GPTQ sym=True): Q4_0 blocks, w = (q - 8) d with d the fp16 scale, bit for bit the
    checkpoint's weight (no minimum to round), 4.5 bits a weight."""
    q, z, s = quantize_groups(_w(48, 256), group, True)
    t = pack("gptq", q, z, s, group, True)
    qm = unpack_gptq(t["qweight"], t["qzeros"], t["scales"], PrequantConfig("gptq", group, True), "x")
    blocks = qm.as_gguf_blocks(torch.bfloat16)
    assert blocks.name == "Q4_0" and blocks.nbytes == 48 * 256 // 32 * 18
    assert torch.equal(dequantize(blocks), dequant(q, z, s, group))


@_NATIVE_BLOCKS
@pytest.mark.parametrize("method", ["int8wo", "int4wo-64"])
@pytest.mark.parametrize("m", [1, 4, 64])
def test_bf16_layers_run_the_gguf_blocks_within_the_int8_activation_bound(method, m):
    """`QuantWeight.prepare` with bf16 activations takes the blocks (Q8_0 for int8wo, scale in f16; Q4_1 for
    int4wo) and runs the native kernels: against a float64 matmul of the blocks' weight, within the two int8
    activation terms' bound (sum_i |w_i| d_x(i) / 256, d_x = the 32-block's max|x| / 127) on the int8 paths and
    within the bf16 rounding of the weight tile on the many-row one (quant_path 0); float32 activations keep
    torch's kernels (exact float32 scales)."""
    w = _w(96, 256)
    x = (torch.randn(m, 256, generator=torch.Generator().manual_seed(5)) * 2).to(torch.bfloat16)
    qw = QuantWeight.from_parts([quantize_for_method(w, method)])
    qw.prepare(torch.bfloat16)
    held = qw.segments[0].weight
    assert isinstance(held, QuantMatrix) and held.packed and held.name == ("Q8_0" if method == "int8wo" else "Q4_1")
    assert qw.quant_types == [method]
    ref_w = quantize_for_method(w, method).kernel_weight(torch.bfloat16).double()
    ref = x.double() @ ref_w.t()
    mag = x.double().abs() @ ref_w.abs().t()
    if _native().quant_path(held.qtype, m, 256, 0) == 0:  # many rows: the weight tile rounded once to bf16
        bound = 2.0 ** -8 * mag + 1e-6
    else:  # the int8 paths: the two activation terms' rounding
        dx = x.double().abs().view(m, 8, 32).amax(-1).repeat_interleave(32, dim=1) / 127
        bound = (dx / 256) @ ref_w.abs().t() + 1e-5 * mag + 1e-6
    y = qw.linear(x, None, torch.float32).double()
    assert ((y - ref).abs() <= bound).all()
    # int8wo: the row scale once in f16 (torch's int8 kernel holds it in bf16: 3 bits fewer)
    if method == "int8wo":
        int8 = quantize_for_method(w, method)
        assert torch.equal(ref_w.float(), int8.q.float() * int8.scales.half().float())
    f32 = QuantWeight.from_parts([quantize_for_method(w, method)])
    f32.prepare(torch.float32)
    assert isinstance(f32.segments[0].weight, IntQuantMatrix)


@_NATIVE_BLOCKS
def test_weights_the_blocks_cannot_hold_stay_on_torchs_kernels():
    w = _w(32, 64)
    assert quantize_for_method(w, "w8a8_int8").as_gguf_blocks(torch.bfloat16) is None  # activations per token
    assert quantize_for_method(_w(32, 48), "int8wo").as_gguf_blocks(torch.bfloat16) is None  # not whole blocks
    huge = quantize_int4_grouped(w, 32)
    huge.scales.fill_(1e4)  # the minimum -z s leaves f16's range
    huge.zeros.fill_(15)
    assert huge.as_gguf_blocks(torch.bfloat16) is None
    qw = QuantWeight.from_parts([huge])
    qw.prepare(torch.bfloat16)
    assert isinstance(qw.segments[0].weight, IntQuantMatrix)
