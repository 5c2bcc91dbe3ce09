"""compressed-tensors checkpoints of integer weights (llm-compressor's W4A16 / W8A16 schemes, format
"pack-quantized", the form vLLM and SGLang load as `compressed-tensors`): the `quantization_config` read and
checked, and each quantized linear layer's tensors turned into one `IntQuantMatrix` at load.

The packing (compressed-tensors' PackedQuantizationCompressor):
- `weight_packed` int32 [N, K b / 32]: each weight's signed code q in [-2^(b-1), 2^(b-1)) plus 2^(b-1), element i
  of a row at bits b (i % (32 / b)) of word i / (32 / b) (b = 4 or 8: no code straddles a word);
- `weight_scale` [N, K / group] (strategy "group") or [N, 1] ("channel"), in the checkpoint's float dtype;
- `weight_shape` [2] = (N, K);
- asymmetric schemes: `weight_zero_point` [N b / 32, groups], the signed zero points packed the same way along
  the OUTPUT dim; act-order ("actorder": "group"): `weight_g_idx` [K], each input feature's group.
The weight is w = (q - z) s. As IntQuantMatrix codes: 4 bits keep the unsigned code q + 8 with zero point z + 8
(8 for symmetric schemes: GGUF Q4_0 blocks exactly; Q4_1 otherwise); 8 bits keep the int8 q (symmetric only, Q8_0
blocks exactly), as models/prequant.py does for GPTQ.

Invariant: anything else (float or activation quantization such as W8A8 or FP8, other formats, bit widths,
strategies or group sizes, config groups with different weight schemes, a KV-cache scheme, 8-bit asymmetric
weights) is refused at start with the reason, never loaded approximately.
"""

from __future__ import annotations

from typing import Any

import torch

from tokenloom.layers.int_quant import INT4_GROUPS, IntQuantMatrix
from tokenloom.model_config import ModelConfigError

METHOD = "compressed-tensors"
FORMAT = "pack-quantized"
PARTS = ("weight_packed", "weight_scale", "weight_shape")
INT8_GROUP_MULTIPLE = 32  # an 8-bit group is whole Q8_0 blocks


def read_scheme(qc: dict[str, Any], source: str) -> tuple[int, int, bool, bool]:
    """(bits, group (-1: per channel), symmetric, act-order) of a compressed-tensors `quantization_config`;
    ModelConfigError naming what is not implemented."""
    def refuse(what: str) -> ModelConfigError:
        return ModelConfigError(f"{source}: compressed-tensors {what}; implemented: integer weights only (W4A16 / "
                                f"W8A16, format {FORMAT!r}, strategy group or channel)")

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
        fmt = (group or {}).get("format") or qc.get("format")
        if fmt != FORMAT:
            raise refuse(f"format {fmt!r} (config group {name})")
        if group.get("input_activations") or group.get("output_activations"):
            raise refuse(f"with quantized activations (config group {name})")
        weights = group.get("weights")
        if not isinstance(weights, dict):
            raise refuse(f"without weights arguments (config group {name})")
        schemes.append(weights)
    first = schemes[0]
    if any(s != first for s in schemes[1:]):
        raise refuse("config groups with different weight schemes")
    bits, kind, strategy = first.get("num_bits"), first.get("type", "int"), first.get("strategy")
    symmetric, actorder = first.get("symmetric", True), first.get("actorder")
    if kind != "int" or bits not in (4, 8):
        raise refuse(f"{kind} weights of {bits} bits")
    if first.get("dynamic"):
        raise refuse("with dynamic weight quantization")
    if strategy == "channel":
        group = -1
    elif strategy == "group":
        group = first.get("group_size")
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
    return bits, group, bool(symmetric), actorder in ("group", "dynamic")


def _codes(words: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """int32 [rows, words] -> uint8 [rows, count]: the unsigned codes, element i at bits `bits` (i % per word)."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    fields = (words.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return fields.reshape(words.shape[0], -1)[:, :count].to(torch.uint8)


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
