"""compressed-tensors checkpoints of integer weights (llm-compressor's W4A16 / W8A16 schemes, format
"pack-quantized", and W8A8 int8, format "int-quantized": what vLLM and SGLang load as `compressed-tensors`): the
`quantization_config` read and checked, and each quantized linear layer's tensors turned into one
`IntQuantMatrix` at load.

The packing of "pack-quantized" (compressed-tensors' PackedQuantizationCompressor):
- `weight_packed` int32 [N, K b / 32]: each weight's signed code q in [-2^(b-1), 2^(b-1)) plus 2^(b-1), element i
  of a row at bits b (i % (32 / b)) of word i / (32 / b) (b = 4 or 8: no code straddles a word);
- `weight_scale` [N, K / group] (strategy "group") or [N, 1] ("channel"), in the checkpoint's float dtype;
- `weight_shape` [2] = (N, K);
- asymmetric schemes: `weight_zero_point` [N b / 32, groups], the signed zero points packed the same way along
  the OUTPUT dim; act-order ("actorder": "group"): `weight_g_idx` [K], each input feature's group.
The weight is w = (q - z) s. As IntQuantMatrix codes: 4 bits keep the unsigned code q + 8 with zero point z + 8
(8 for symmetric schemes: GGUF Q4_0 blocks exactly; Q4_1 otherwise); 8 bits keep the int8 q (symmetric only, Q8_0
blocks exactly), as models/prequant.py does for GPTQ.
"int-quantized" W8A8: `weight` int8 [N, K] itself with `weight_scale` [N, 1] (channel) or [1] (tensor), and
activations quantized per token, dynamically and symmetrically, to int8 at run time: exactly what `--quantization
w8a8_int8` computes (int8 x int8 -> int32 matmuls, layers/int_quant.py), so such a layer is that scheme's matrix.

Invariant: anything else (float weights or activations such as FP8, static or asymmetric activation scales,
other formats, bit widths, strategies or group sizes, config groups with different schemes, a KV-cache scheme,
8-bit asymmetric weights) is refused at start with the reason, never loaded approximately.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tokenloom.layers.int_quant import BLOCK as INT8_GROUP_MULTIPLE  # an 8-bit group: whole Q8_0 blocks
from tokenloom.layers.int_quant import INT4_GROUPS, IntQuantMatrix
from tokenloom.model_config import ModelConfigError

METHOD = "compressed-tensors"
FORMAT = "pack-quantized"
INT_FORMAT = "int-quantized"  # W8A8: int8 weights stored as they are, activations quantized per token
PARTS = ("weight_packed", "weight_scale", "weight_shape")


@dataclass(frozen=True)
class Scheme:
    """One checkpoint's weight scheme: `group` -1 is per channel; `activations`: W8A8 (per-token int8 inputs)."""
    bits: int
    group: int
    symmetric: bool
    act_order: bool
    activations: bool = False


def read_scheme(qc: dict[str, Any], source: str) -> Scheme:
    """The Scheme of a compressed-tensors `quantization_config`; ModelConfigError naming what is not
    implemented."""
    def refuse(what: str) -> ModelConfigError:
        return ModelConfigError(f"{source}: compressed-tensors {what}; implemented: integer weights (W4A16 / "
                                f"W8A16, format {FORMAT!r}, strategy group or channel) and W8A8 int8 ({INT_FORMAT!r}, "
                                "dynamic per-token activations)")

    if qc.get("kv_cache_scheme"):
        raise refuse("with a kv_cache_scheme")
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise refuse(f"with quantization_status {status!r} (the weights are not packed)")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise refuse("without config_groups")
    schemes = []
    for name, group in groups.items():
        group = group or {}
        fmt = group.get("format") or qc.get("format")
        if fmt not in (FORMAT, INT_FORMAT):
            raise refuse(f"format {fmt!r} (config group {name})")
        if group.get("output_activations"):
            raise refuse(f"with quantized outputs (config group {name})")
        if not isinstance(group.get("weights"), dict):
            raise refuse(f"without weights arguments (config group {name})")
        schemes.append((fmt, group["weights"], group.get("input_activations")))
    first = schemes[0]
    if any(s != first for s in schemes[1:]):
        raise refuse("config groups with different schemes")
    fmt, weights, inputs = first
    bits, kind, strategy = weights.get("num_bits"), weights.get("type", "int"), weights.get("strategy")
    symmetric, actorder = weights.get("symmetric", True), weights.get("actorder")
    if kind != "int" or bits not in (4, 8):
        raise refuse(f"{kind} weights of {bits} bits")
    if weights.get("dynamic"):
        raise refuse("with dynamic weight quantization")
    if fmt == INT_FORMAT:
        per_token = isinstance(inputs, dict) and inputs.get("type", "int") == "int" and inputs.get("num_bits") == 8 \
            and inputs.get("strategy") == "token" and inputs.get("dynamic") is True \
            and inputs.get("symmetric", True) is True
        if not per_token:
            raise refuse(f"format {INT_FORMAT!r} without dynamic symmetric per-token int8 activations")
        if bits != 8 or not symmetric or strategy not in ("channel", "tensor") or actorder not in (None, "weight"):
            raise refuse(f"format {INT_FORMAT!r} with {bits}-bit {strategy} weights "
                         f"({'symmetric' if symmetric else 'asymmetric'})")
        return Scheme(8, -1, True, False, activations=True)
    if inputs:
        raise refuse(f"format {FORMAT!r} with quantized activations")
    if strategy == "channel":
        group = -1
    elif strategy == "group":
        group = weights.get("group_size")
        fits = group in INT4_GROUPS if bits == 4 else isinstance(group, int) and group > 0 \
            and group % INT8_GROUP_MULTIPLE == 0
        if not fits:
            raise refuse(f"group_size {group} at {bits} bits (4 bits: {', '.join(map(str, INT4_GROUPS))}; "
                         f"8 bits: multiples of {INT8_GROUP_MULTIPLE})")
    else:
        raise refuse(f"strategy {strategy!r}")
    if bits == 8 and not symmetric:
        raise refuse("8-bit asymmetric weights")
    if actorder not in (None, "group", "weight", "static", "dynamic"):
        raise refuse(f"actorder {actorder!r}")
    # "group" stores each layer's g_idx; "weight" / "static" reorder only while quantizing (nothing stored).
    return Scheme(bits, group, bool(symmetric), actorder in ("group", "dynamic"))


def unpack_int8(parts: dict[str, torch.Tensor], name: str, matrix_name: str) -> IntQuantMatrix:
    """A W8A8 layer ("int-quantized"): the int8 weight and its scales as `--quantization w8a8_int8`'s matrix."""
    q, scale = parts["weight"], parts["weight_scale"]
    n, k = q.shape
    if scale.numel() == 1:  # strategy "tensor": one scale for every row
        scale = scale.reshape(1, 1).expand(n, 1)
    if scale.numel() != n:
        raise ModelConfigError(f"{name}.weight_scale: {tuple(scale.shape)} does not fit an int8 weight of {n} rows")
    s = scale.reshape(n, 1).float().contiguous()
    if not bool(torch.isfinite(s).all()):
        raise ModelConfigError(f"{name}.weight_scale: a scale is not finite")
    return IntQuantMatrix(8, k, q.contiguous(), s, None, matrix_name, act_quant=True)


def bit_fields(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [..., n] -> uint8 [..., n, 32 / bits]: field i of each word (bits `bits` i ...) at index i (the
    packing GPTQ, AWQ and compressed-tensors share within a word)."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    return ((words.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).to(torch.uint8)


def _codes(words: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """int32 [rows, words] -> uint8 [rows, count]: the unsigned codes, element i at bits `bits` (i % per word)."""
    return bit_fields(words, bits).reshape(words.shape[0], -1)[:, :count]


def unpack(parts: dict[str, torch.Tensor], bits: int, group: int, symmetric: bool, name: str, matrix_name: str,
           order: torch.Tensor | None = None) -> IntQuantMatrix:
    """One layer's tensors -> IntQuantMatrix (module docstring); `order`: the act-order column order, if any."""
    shape = parts["weight_shape"].reshape(-1).tolist()
    packed, scale = parts["weight_packed"], parts["weight_scale"]
    if len(shape) != 2:
        raise ModelConfigError(f"{name}.weight_shape: {shape}; a linear layer's weight is [out, in]")
    n, k = (int(v) for v in shape)
    group_k = k if group == -1 else group
    per_word = 32 // bits
    if packed.dtype != torch.int32 or k % per_word or tuple(packed.shape) != (n, k // per_word) \
            or k % group_k or tuple(scale.shape) != (n, k // group_k):
        raise ModelConfigError(f"{name}: weight_packed {packed.dtype} {tuple(packed.shape)}, weight_scale "
                               f"{tuple(scale.shape)} do not fit weight_shape [{n}, {k}] at {bits} bits in groups "
                               f"of {group_k}")
    s = scale.float().contiguous()
    if not bool(torch.isfinite(s).all()):
        raise ModelConfigError(f"{name}.weight_scale: a scale is not finite")
    q = _codes(packed, bits, k)
    if order is not None:
        q = q.index_select(1, order).contiguous()
    offset = 1 << (bits - 1)
    if bits == 8:
        return IntQuantMatrix(8, group_k, (q.to(torch.int16) - offset).to(torch.int8), s, None, matrix_name,
                              in_perm=order)
    if symmetric:
        zeros = torch.full_like(s, float(offset))
    else:
        zp = parts["weight_zero_point"]
        groups = k // group_k
        if zp.dtype != torch.int32 or zp.dim() != 2 or zp.shape[1] != groups or zp.shape[0] * per_word < n:
            raise ModelConfigError(f"{name}.weight_zero_point: {zp.dtype} {tuple(zp.shape)} does not fit "
                                   f"[{n}, {groups}] zero points at {bits} bits")
        zeros = _codes(zp.t().contiguous(), bits, n).t().float().contiguous()  # unsigned: z + 8
    return IntQuantMatrix(4, group_k, q, s, zeros, matrix_name, in_perm=order)
