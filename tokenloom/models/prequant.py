"""GPTQ (4- and 8-bit) and AWQ (4-bit) Hugging Face checkpoints: their `quantization_config` read and checked,
and each linear layer's packed tensors (qweight, qzeros, scales, g_idx) turned into one `IntQuantMatrix` at load;
compressed-tensors' integer checkpoints (models/compressed_tensors.py) go through the same `convert`.

Packing conventions (the weight is w[n, k] = (q[n, k] - z[n, k // group]) * s[n, k // group]):
- GPTQ (AutoGPTQ / GPTQModel): qweight int32 [K / 8, N], eight 4-bit codes along the INPUT dim, code k at bits
  4 * (k % 8) of word k // 8; qzeros int32 [groups, N / 8], eight zero points along the output dim the same
  way; scales fp16 [groups, N]; g_idx int32 [K] (the group of each input feature). checkpoint_format "gptq"
  (v1, the default) stores each zero point minus one, "gptq_v2" stores it as is. Act-order (desc_act true)
  quantizes the input features in another order, so g_idx is not k // group: the columns are sorted by g_idx
  at load (each group then contiguous; `IntQuantMatrix.in_perm` keeps the order) and the layer gathers its
  input features in that order before its matmul, as vLLM's GPTQ kernels do with a sorted g_idx. Each group
  must hold exactly group_size features (AutoGPTQ / GPTQModel's act-order assigns them so).
- GPTQ 8-bit (Qwen's "GPTQ-Int8" checkpoints, for one): the same layout with four 8-bit codes per int32 word
  (code k at bits 8 * (k % 4)), zero points likewise four per word. Symmetric checkpoints (sym true) have every
  zero point 128, so q - 128 is an int8 in [-128, 127] and the weight is exactly (q - 128) * s: kept as int8 codes
  with a scale per group (symmetric, no zeros), which GGUF's Q8_0 blocks hold exactly (d = the f16 scale).
- group_size -1 (GPTQ, 4 or 8 bits) is one group per output row (per channel), whatever the layer's width.
- AWQ (AutoAWQ, version gemm): qweight int32 [K, N / 8] packs eight codes along the OUTPUT dim in the
  interleaved order [0, 2, 4, 6, 1, 3, 5, 7] (nibble i of word j holds column 8 j + order[i]); qzeros
  int32 [groups, N / 8] likewise; scales fp16 [groups, N]; zero points as stored (zero_point true).

Invariant: anything outside what is implemented (bits other than 4 / 8, 8-bit AWQ or asymmetric 8-bit GPTQ, a
group size the kernels do not take, an act-order g_idx whose groups are not group_size features each, AWQ
gemv, a quantized LM head) is refused at start with the reason, never loaded approximately.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from tokenloom.layers.int_quant import BLOCK as INT8_GROUP_MULTIPLE  # an 8-bit group: whole Q8_0 blocks
from tokenloom.layers.int_quant import INT4_GROUPS, IntQuantMatrix
from tokenloom.model_config import ModelConfigError
from tokenloom.models import compressed_tensors
from tokenloom.models.compressed_tensors import bit_fields

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column order[i] of its 8
_PARTS = ("qweight", "qzeros", "scales")


@dataclass(frozen=True)
class PrequantConfig:
    method: str  # gptq | awq | compressed-tensors
    group: int
    zeros_minus_one: bool  # GPTQ v1 stores each zero point minus one
    act_order: bool = False  # GPTQ desc_act (compressed-tensors actorder group): g_idx may permute the inputs
    bits: int = 4
    # group -1 (GPTQ, compressed-tensors channel): one group per output row, whatever the layer's input width
    symmetric: bool = True  # compressed-tensors: no weight_zero_point tensors
    activations: bool = False  # compressed-tensors W8A8: int8 weights as stored, inputs quantized per token

    @property
    def name(self) -> str:
        if self.activations:
            return f"{self.method}-w8a8-int8"
        return f"{self.method}-int{self.bits}-" + ("channel" if self.group == -1 else f"g{self.group}")

    @property
    def parts(self) -> tuple[str, ...]:
        """The tensors of one quantized layer, by their last name component."""
        if self.activations:
            return ("weight", "weight_scale")
        if self.method == compressed_tensors.METHOD:
            return (*compressed_tensors.PARTS, *(() if self.symmetric else ("weight_zero_point",)),
                    *(("weight_g_idx",) if self.act_order else ()))
        return (*_PARTS, "g_idx") if self.act_order else _PARTS


# Files older quantizers wrote beside config.json instead of its `quantization_config`, and the method each
# means when the file does not say: AutoGPTQ's quantize_config.json, AutoAWQ's quant_config.json.
SIDECAR_CONFIGS = (("quantize_config.json", "gptq"), ("quant_config.json", "awq"))


def sidecar_quant_config(folder: str) -> tuple[dict[str, Any], str] | None:
    """(the quantization config, its file) from a sidecar file in `folder` when there is one, its
    `quant_method` filled in from the file's name where it has none; None otherwise."""
    import json
    import os

    for name, method in SIDECAR_CONFIGS:
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            continue
        try:
            with open(path) as f:
                qc = json.load(f)
        except json.JSONDecodeError as e:
            raise ModelConfigError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(qc, dict):
            raise ModelConfigError(f"{path}: expected a JSON object")
        return {"quant_method": method, **qc}, path
    return None


def read_quant_config(raw: dict[str, Any], source: str) -> PrequantConfig | None:
    """The checkpoint's quantization (config.json's `quantization_config`), or None for a float checkpoint.
    Raises ModelConfigError, with the reason, for anything not implemented."""
    qc = raw.get("quantization_config")
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method == compressed_tensors.METHOD:
        scheme = compressed_tensors.read_scheme(qc, source)
        return PrequantConfig(method, scheme.group, False, scheme.act_order, scheme.bits, scheme.symmetric,
                              scheme.activations)
    if method not in ("gptq", "awq"):
        raise ModelConfigError(f"{source}: quantization_config.quant_method {method!r} is not supported; tokenloom "
                               "loads gptq, awq and compressed-tensors integer checkpoints (or float ones)")
    bits = qc.get("bits", qc.get("w_bit"))
    group = qc.get("group_size", qc.get("q_group_size"))
    if bits not in ((4, 8) if method == "gptq" else (4,)):
        raise ModelConfigError(f"{source}: {method} with bits={bits}; implemented: "
                               f"{'4- and 8-bit' if method == 'gptq' else '4-bit'} checkpoints")
    if bits == 8:
        if qc.get("sym") is False:
            raise ModelConfigError(f"{source}: gptq 8-bit with sym false; only symmetric 8-bit checkpoints are "
                                   "implemented (their codes minus zero points are int8s)")
        if not isinstance(group, int) or group != -1 and (group < INT8_GROUP_MULTIPLE or group % INT8_GROUP_MULTIPLE):
            raise ModelConfigError(f"{source}: gptq 8-bit group_size {group}; implemented: multiples of "
                                   f"{INT8_GROUP_MULTIPLE} (GGUF Q8_0 blocks), or -1 (per channel)")
    elif group not in INT4_GROUPS and not (method == "gptq" and group == -1):
        per_channel = " or -1 (per channel)" if method == "gptq" else ""
        raise ModelConfigError(f"{source}: {method} group_size {group}; implemented: "
                               f"{', '.join(map(str, INT4_GROUPS))}{per_channel}")
    if method == "gptq":
        fmt = qc.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise ModelConfigError(f"{source}: gptq checkpoint_format {fmt!r}; gptq and gptq_v2 are supported")
        if qc.get("lm_head"):
            raise ModelConfigError(f"{source}: a gptq-quantized lm_head is not supported")
        return PrequantConfig("gptq", group, fmt == "gptq", bool(qc.get("desc_act")), bits)
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise ModelConfigError(f"{source}: awq version {version!r}; only gemm packing is supported")
    if qc.get("zero_point") is False:
        raise ModelConfigError(f"{source}: awq with zero_point false is not supported")
    return PrequantConfig("awq", group, False)


def unpack_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, cfg: PrequantConfig,
                name: str, g_idx: torch.Tensor | None = None) -> IntQuantMatrix:
    """`g_idx` (act-order): the group of each input feature; the columns come out sorted by it (in_perm)."""
    per_word = 32 // cfg.bits
    kw, n = qweight.shape
    k, groups = kw * per_word, scales.shape[0]
    group = k if cfg.group == -1 else cfg.group
    if tuple(qzeros.shape) != (groups, n // per_word) or scales.shape[1] != n or groups * group != k:
        raise ModelConfigError(f"{name}: gptq qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)}, "
                               f"scales {tuple(scales.shape)} do not fit {cfg.bits} bits in groups of {cfg.group}")
    q = bit_fields(qweight, cfg.bits).permute(0, 2, 1).reshape(k, n).t().contiguous()  # [N, K]
    stored_z = bit_fields(qzeros, cfg.bits).reshape(groups, n).t()
    # v1 stores z - 1 and its kernels add the 1 back unmasked (a stored 15 is a zero point of 16)
    z = stored_z.to(torch.int32) + (1 if cfg.zeros_minus_one else 0)
    perm = None if g_idx is None else _act_order(g_idx, k, group, name)
    if perm is not None:
        q = q.index_select(1, perm).contiguous()
    s = scales.t().float().contiguous()
    if cfg.bits == 8:
        if not bool((z == 128).all()):
            raise ModelConfigError(f"{name}: gptq 8-bit zero points other than 128 in a sym checkpoint")
        return IntQuantMatrix(8, group, (q.to(torch.int16) - 128).to(torch.int8), s, None, cfg.name, in_perm=perm)
    return IntQuantMatrix(4, group, q, s, z.float().contiguous(), cfg.name, in_perm=perm)


def _act_order(g_idx: torch.Tensor, k: int, group: int, name: str) -> torch.Tensor | None:
    """The input features sorted by group (stable), or None where g_idx is already k // group; ModelConfigError
    unless every group holds exactly `group` of the k features."""
    g = g_idx.to(torch.int64).reshape(-1)
    if g.numel() != k:
        raise ModelConfigError(f"{name}.g_idx: {g.numel()} entries for {k} input features")
    trivial = torch.arange(k, dtype=torch.int64) // group
    if torch.equal(g, trivial):
        return None
    if int(g.min()) < 0 or int(g.max()) >= k // group \
            or not torch.equal(torch.bincount(g, minlength=k // group), torch.full((k // group,), group)):
        raise ModelConfigError(f"{name}.g_idx: its groups do not each hold group_size ({group}) input features")
    return torch.sort(g, stable=True).indices


def unpack_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, cfg: PrequantConfig,
               name: str) -> IntQuantMatrix:
    k, n8 = qweight.shape
    n, groups = n8 * 8, scales.shape[0]
    if tuple(qzeros.shape) != (groups, n8) or scales.shape[1] != n or groups * cfg.group != k:
        raise ModelConfigError(f"{name}: awq qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)}, "
                               f"scales {tuple(scales.shape)} do not fit group_size {cfg.group}")

    def columns(words: torch.Tensor) -> torch.Tensor:
        nib = bit_fields(words, 4)
        out = torch.empty_like(nib)
        out[..., list(AWQ_ORDER)] = nib  # nibble i -> column order[i]
        return out.reshape(words.shape[0], n)

    q = columns(qweight).t().contiguous()
    z = columns(qzeros).t().float().contiguous()
    return IntQuantMatrix(4, cfg.group, q, scales.t().float().contiguous(), z, cfg.name)


def convert(tensors: Iterator[tuple[str, torch.Tensor]], cfg: PrequantConfig
            ) -> Iterator[tuple[str, torch.Tensor | IntQuantMatrix]]:
    """Checkpoint tensors -> HF names the model loads: each `<module>.qweight/qzeros/scales` triple (with its
    `g_idx` for an act-order checkpoint; compressed-tensors: `weight_packed/weight_scale/weight_shape`, ...)
    becomes one `<module>.weight` IntQuantMatrix; without act-order a `g_idx` must be the trivial k // group;
    other tensors pass through."""
    needed = cfg.parts
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        prefix, _, part = name.rpartition(".")
        if part in ("g_idx", "weight_g_idx") and not cfg.act_order:
            per_group = cfg.group if cfg.group > 0 else tensor.numel()  # -1: one group per row
            expected = torch.arange(tensor.numel(), dtype=torch.int64) // per_group
            if not torch.equal(tensor.to(torch.int64), expected):
                raise ModelConfigError(f"{name}: g_idx is not input feature // group_size ({cfg.group}) in a "
                                       "checkpoint whose config says desc_act false")
            continue
        # W8A8 stores quantized layers' `weight` as int8 beside float ones (the LM head): only int8 ones wait
        quantized = part in needed and (part != "weight" or tensor.dtype == torch.int8)
        if not quantized:
            yield name, tensor
            continue
        if prefix == "lm_head":
            raise ModelConfigError(f"{name}: a quantized lm_head is not supported")
        parts = pending.setdefault(prefix, {})
        parts[part] = tensor
        if len(parts) == len(needed):
            del pending[prefix]
            if cfg.activations:
                yield f"{prefix}.weight", compressed_tensors.unpack_int8(parts, prefix, cfg.name)
            elif cfg.method == compressed_tensors.METHOD:
                yield f"{prefix}.weight", _unpack_compressed(parts, cfg, prefix)
            elif cfg.method == "gptq":
                yield f"{prefix}.weight", unpack_gptq(parts["qweight"], parts["qzeros"], parts["scales"], cfg, prefix,
                                                      parts.get("g_idx"))
            else:
                yield f"{prefix}.weight", unpack_awq(parts["qweight"], parts["qzeros"], parts["scales"], cfg, prefix)
    if pending:
        prefix, parts = next(iter(pending.items()))
        missing = sorted(set(needed) - set(parts))
        raise ModelConfigError(f"{prefix}: {cfg.method} checkpoint lacks {', '.join(missing)}")


def _unpack_compressed(parts: dict[str, torch.Tensor], cfg: PrequantConfig, prefix: str) -> IntQuantMatrix:
    """A compressed-tensors layer (models/compressed_tensors.py), its act-order g_idx sorted as GPTQ's."""
    order = None
    if cfg.act_order:
        k = int(parts["weight_shape"].reshape(-1)[-1])
        order = _act_order(parts["weight_g_idx"], k, k if cfg.group == -1 else cfg.group, prefix)
    return compressed_tensors.unpack(parts, cfg.bits, cfg.group, cfg.symmetric, prefix, cfg.name, order)
