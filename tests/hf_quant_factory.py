"""Tiny GPTQ and AWQ checkpoints the tests write themselves from a known float model.

Each linear weight is quantized here with the formats' own formula (4-bit codes per group of input features,
w = (q - z) * s, s in fp16; symmetric: z = 8; GPTQ 8-bit symmetric: s = 2 max|w| / 255, z = 128, codes clamped
to [0, 255], so q - z reaches -128) and packed with numpy bit operations written independently of
tokenloom's unpacking (tokenloom/models/prequant.py): GPTQ packs 32 / bits codes per int32 along the input dim
(zero points minus one in checkpoint_format "gptq"), AWQ along the output dim in the order
[0, 2, 4, 6, 1, 3, 5, 7]. `write_prequant` returns the known integer codes and a transformers model whose
linear weights are exactly the dequantized ones: the float reference.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import torch

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantize_groups(w: torch.Tensor, group: int, sym: bool, bits: int = 4
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [N, K], z [N, G] int64 codes, s [N, G] fp16) with w ~ (q - z) * s; group -1: one group per row."""
    n, k = w.shape
    group = k if group == -1 else group
    wg = w.float().view(n, k // group, group)
    if bits == 8:  # GPTQ's symmetric quantizer: maxq 255, zero (maxq + 1) / 2
        assert sym, "8-bit: symmetric only"
        s = (2 * wg.abs().amax(-1) / 255).clamp(min=1e-4).half()
        z = torch.full((n, k // group), 128, dtype=torch.int64)
        q = torch.round(wg / s.float().unsqueeze(-1) + 128).clamp(0, 255).to(torch.int64)
        return q.view(n, k), z, s
    if sym:
        s = (wg.abs().amax(-1) / 7.5).clamp(min=1e-4).half()
        z = torch.full((n, k // group), 8, dtype=torch.int64)
    else:
        lo, hi = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
        s = ((hi - lo) / 15).clamp(min=1e-4).half()
        # Zero points >= 1: GPTQ v1 stores z - 1 in 4 bits, so a 0 would wrap (AutoGPTQ's known quirk).
        z = torch.round(-lo / s.float()).clamp(1, 15).to(torch.int64)
    q = torch.round(wg / s.float().unsqueeze(-1) + z.unsqueeze(-1)).clamp(0, 15).to(torch.int64)
    return q.view(n, k), z, s


def dequant(q: torch.Tensor, z: torch.Tensor, s: torch.Tensor, group: int) -> torch.Tensor:
    n, k = q.shape
    group = k if group == -1 else group
    return ((q.view(n, -1, group) - z.unsqueeze(-1)).float() * s.float().unsqueeze(-1)).view(n, k)


def _pack_rows(codes: np.ndarray, bits: int = 4) -> np.ndarray:
    """uint [R * n, C] -> int32 [R, C], n = 32 / bits: code n r + i at bits `bits` i of word r."""
    n = 32 // bits
    words = np.zeros((codes.shape[0] // n, codes.shape[1]), dtype=np.uint32)
    for i in range(n):
        words |= codes[i::n].astype(np.uint32) << np.uint32(bits * i)
    return words.view(np.int32)


def _pack_awq(codes: np.ndarray) -> np.ndarray:
    """uint [R, C * 8] -> int32 [R, C]: nibble i of word j holds column 8j + [0, 2, 4, 6, 1, 3, 5, 7][i]."""
    order = [0, 2, 4, 6, 1, 3, 5, 7]
    words = np.zeros((codes.shape[0], codes.shape[1] // 8), dtype=np.uint32)
    for i in range(8):
        words |= codes[:, order[i]::8].astype(np.uint32) << np.uint32(4 * i)
    return words.view(np.int32)


def pack(method: str, q: torch.Tensor, z: torch.Tensor, s: torch.Tensor, group: int, v1: bool = True,
         g_idx: torch.Tensor | None = None, bits: int = 4) -> dict[str, torch.Tensor]:
    """The module's checkpoint tensors (without the prefix); `g_idx`: GPTQ's group of each input feature
    (default k // group; group -1: all zeros)."""
    qn, zn = q.numpy(), z.numpy()
    if method == "gptq":
        stored_z = (zn - 1) & ((1 << bits) - 1) if v1 else zn
        per_group = q.shape[1] if group == -1 else group
        return {"qweight": torch.from_numpy(_pack_rows(qn.T.copy(), bits)),
                "qzeros": torch.from_numpy(_pack_zeros_gptq(stored_z.T.copy(), bits)),
                "scales": s.t().contiguous(),
                "g_idx": (torch.arange(q.shape[1]) // per_group if g_idx is None else g_idx).to(torch.int32)}
    return {"qweight": torch.from_numpy(_pack_awq(qn.T.copy())), "qzeros": torch.from_numpy(_pack_awq(zn.T.copy())),
            "scales": s.t().contiguous()}


def _pack_zeros_gptq(zt: np.ndarray, bits: int = 4) -> np.ndarray:
    """uint [G, N] -> int32 [G, N / n], n = 32 / bits: zero of column n j + i at bits `bits` i of word j."""
    n = 32 // bits
    words = np.zeros((zt.shape[0], zt.shape[1] // n), dtype=np.uint32)
    for i in range(n):
        words |= zt[:, i::n].astype(np.uint32) << np.uint32(bits * i)
    return words.view(np.int32)


_SHARED_INPUT = {"q_proj": "attn_in", "k_proj": "attn_in", "v_proj": "attn_in", "gate_proj": "mlp_in",
                 "up_proj": "mlp_in"}


def _input_order(module: str, k: int) -> torch.Tensor:
    """A random order of the module's k input features, the same for the projections that share an input."""
    layer, kind = module.rsplit(".", 2)[0], module.rsplit(".", 1)[-1]
    key = f"{layer}.{_SHARED_INPUT.get(kind, kind)}"
    seed = sum(ord(c) * (i + 1) for i, c in enumerate(key))
    return torch.randperm(k, generator=torch.Generator().manual_seed(seed))


def write_prequant(folder: str, hf: torch.nn.Module, method: str, group: int, sym: bool = False,
                   v1: bool = True, desc_act: bool = False, bits: int = 4) -> tuple[dict[str, tuple], torch.nn.Module]:
    """Write `hf` as a `method` checkpoint in `folder`; return ({module: (q, z, s)}, the float reference).
    `desc_act` (GPTQ act-order): each layer input's features are quantized in a random order (one order per
    input, shared by the projections that read it, as GPTQ's Hessian order is), group i of the order being
    positions [i group, (i + 1) group); g_idx names each feature's group. Then `known` holds the codes in that
    order, (q', z, s, order)."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    known: dict[str, tuple] = {}
    tensors: dict[str, torch.Tensor] = {}
    state = hf.state_dict()
    for name, t in state.items():
        module = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and module.rsplit(".", 1)[-1] in LINEARS:
            if desc_act:
                order = _input_order(module, t.shape[1])
                q, z, s = quantize_groups(t[:, order], group, sym, bits)
                known[module] = (q, z, s, order)
                codes = torch.empty_like(q)
                codes[:, order] = q
                g_idx = torch.empty(t.shape[1], dtype=torch.int64)
                g_idx[order] = torch.arange(t.shape[1]) // group
                packed = pack(method, codes, z, s, group, v1, g_idx, bits)
                w = torch.empty_like(t)
                w[:, order] = dequant(q, z, s, group)
            else:
                q, z, s = quantize_groups(t, group, sym, bits)
                known[module] = (q, z, s)
                packed = pack(method, q, z, s, group, v1, bits=bits)
                w = dequant(q, z, s, group)
            for part, value in packed.items():
                tensors[f"{module}.{part}"] = value
            with torch.no_grad():
                t.copy_(w)
        else:
            tensors[name] = t.detach().clone().contiguous()
    if hf.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    cfg = hf.config.to_dict()
    if method == "gptq":
        cfg["quantization_config"] = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": desc_act,
                                      "sym": sym, "checkpoint_format": "gptq" if v1 else "gptq_v2"}
    else:
        cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                                      "version": "gemm"}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    hf.load_state_dict(state)
    return known, hf.eval()


def _quantizable(name: str, w: torch.Tensor, group: int) -> bool:
    """A linear layer's weight as GPTQ tools quantize them: every `*_proj` and Mixtral-style expert `w1/w2/w3`
    weight (not the embedding, LM head or MoE router), whole groups wide."""
    module = name.removesuffix(".weight")
    if module == name or w.dim() != 2 or w.shape[1] % (w.shape[1] if group == -1 else group) or w.shape[0] % 8:
        return False
    return module.endswith("_proj") or module.rsplit(".", 1)[-1] in ("w1", "w2", "w3")


def _quantized_copy(src: str, dst: str, group: int, quantize: Any, quantization_config: dict[str, Any]) -> str:
    """Copy the float checkpoint `src` to `dst` with every `_quantizable` weight replaced by the tensors
    `quantize(name, w)` returns beside its exact float32 dequantized weight, under the weight's module name,
    and `quantization_config` in config.json; `dst` + "_dequantized" gets the float checkpoint with exactly
    those dequantized weights (returned: the reference transformers loads)."""
    import glob
    import shutil

    from safetensors.torch import load_file, save_file

    reference = dst + "_dequantized"
    shutil.copytree(src, dst)
    shutil.copytree(src, reference)
    for path in glob.glob(os.path.join(src, "*.safetensors")):
        packed: dict[str, torch.Tensor] = {}
        floats: dict[str, torch.Tensor] = {}
        for name, w in load_file(path).items():
            floats[name] = packed[name] = w
            if _quantizable(name, w, group):
                tensors, floats[name] = quantize(name, w)
                del packed[name]
                for part, value in tensors.items():
                    packed[f"{name.removesuffix('weight')}{part}"] = value
        save_file(packed, os.path.join(dst, os.path.basename(path)), metadata={"format": "pt"})
        save_file(floats, os.path.join(reference, os.path.basename(path)), metadata={"format": "pt"})
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = quantization_config
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return reference


def gptq_from_folder(src: str, dst: str, group: int, bits: int = 4, sym: bool = False) -> str:
    """A GPTQ copy (checkpoint_format "gptq", desc_act false) of the float checkpoint in `src`, written to `dst`
    from its safetensors files under their own names (so fused projections such as Phi-3's qkv_proj and each
    MoE expert's weights are quantized as stored); returns a third folder, `dst` + "_dequantized": the float
    checkpoint with exactly the dequantized weights, the reference transformers loads."""
    def quantize(name: str, w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        q, z, s = quantize_groups(w.float(), group, sym, bits)
        return pack("gptq", q, z, s, group, True, bits=bits), dequant(q, z, s, group)

    return _quantized_copy(src, dst, group, quantize, {"quant_method": "gptq", "bits": bits, "group_size": group,
                                                       "desc_act": False, "sym": sym})


def compressed_scheme(bits: int, group: int, symmetric: bool) -> Any:
    """compressed-tensors' own QuantizationScheme of integer weights (group -1: strategy "channel")."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    strategy = {"strategy": "channel"} if group == -1 else {"strategy": "group", "group_size": group}
    return QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=bits, type="int", symmetric=symmetric, **strategy))


def compress_weight(w: torch.Tensor, bits: int, group: int, symmetric: bool, scale_dtype: torch.dtype,
                    g_idx: torch.Tensor | None = None) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(the layer's compressed-tensors tensors, its exact dequantized float32 weight): min-max scales (and zero
    points) per group of input features, rounded to `scale_dtype`. Without `g_idx` the library's own
    `PackedQuantizationCompressor.compress` quantizes and packs, and the reference is (q - z) s from its own
    `unpack_from_int32`; with `g_idx` (act-order: each feature's group) the codes are rounded here, feature by
    feature with its group's scale, and packed by the library's `pack_to_int32`."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

    n, k = w.shape
    per = k if group == -1 else group
    gi = (torch.arange(k) // per) if g_idx is None else g_idx.long()
    w, groups, half = w.float(), k // per, 1 << (bits - 1)
    index = gi.expand(n, k)
    lo = torch.full((n, groups), float("inf")).scatter_reduce(1, index, w, "amin").clamp(max=0)
    hi = torch.full((n, groups), -float("inf")).scatter_reduce(1, index, w, "amax").clamp(min=0)
    if symmetric:
        scale = (torch.maximum(-lo, hi) * 2 / (2 * half - 1)).clamp(min=1e-5).to(scale_dtype)
        zp = torch.zeros(n, groups, dtype=torch.int8)
    else:
        scale = ((hi - lo) / (2 * half - 1)).clamp(min=1e-5).to(scale_dtype)
        zp = (torch.round(-lo / scale.float()) - half).clamp(-half, half - 1).to(torch.int8)
    if g_idx is None:
        out = PackedQuantizationCompressor.compress({"weight": w, "weight_scale": scale, "weight_zero_point": zp},
                                                    compressed_scheme(bits, group, symmetric))
        q = unpack_from_int32(out["weight_packed"], bits, torch.Size([n, k])).float()
    else:
        q = (torch.round(w / scale.float()[:, gi]) + zp.float()[:, gi]).clamp(-half, half - 1)
        out = {"weight_packed": pack_to_int32(q.to(torch.int8), bits), "weight_scale": scale,
               "weight_shape": torch.tensor([n, k]), "weight_g_idx": gi.to(torch.int32)}
        if not symmetric:
            out["weight_zero_point"] = pack_to_int32(zp, bits, packed_dim=0)
    exact = (q - zp.float()[:, gi]) * scale.float()[:, gi]
    return {name: t for name, t in out.items() if t is not None}, exact


def compressed_from_folder(src: str, dst: str, bits: int, group: int, symmetric: bool = True,
                           scale_dtype: torch.dtype = torch.bfloat16, act_order: bool = False) -> str:
    """A compressed-tensors copy ("pack-quantized", config written by the library's own QuantizationConfig) of
    the float checkpoint in `src`, written to `dst` as `gptq_from_folder` writes GPTQ (act_order: each layer's
    features grouped in a random order, actorder "group" with weight_g_idx); returns the folder of the exact
    dequantized float checkpoint."""
    from compressed_tensors.quantization import QuantizationConfig

    def quantize(name: str, w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        g_idx = None
        if act_order:
            g_idx = torch.empty(w.shape[1], dtype=torch.int64)
            g_idx[_input_order(name.removesuffix(".weight"), w.shape[1])] = \
                torch.arange(w.shape[1]) // (w.shape[1] if group == -1 else group)
        return compress_weight(w, bits, group, symmetric, scale_dtype, g_idx)

    qc = QuantizationConfig(config_groups={"group_0": compressed_scheme(bits, group, symmetric)},
                            format="pack-quantized", quantization_status="compressed",
                            ignore=["lm_head"]).model_dump(mode="json")
    if act_order:  # the library's versions before 0.20 wrote "group" (weight_g_idx saved); 0.20 refuses to
        qc["config_groups"]["group_0"]["weights"]["actorder"] = "group"
    return _quantized_copy(src, dst, group, quantize, qc)


def w8a8_scheme() -> Any:
    """compressed-tensors' W8A8 int8 scheme: int8 weights per channel, activations int8 per token, dynamic."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    return QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(num_bits=8, type="int", symmetric=True,
                                                                           strategy="channel"),
                              input_activations=QuantizationArgs(num_bits=8, type="int", symmetric=True,
                                                                 strategy="token", dynamic=True))


def w8a8_from_folder(src: str, dst: str, scale_dtype: torch.dtype = torch.bfloat16) -> str:
    """A compressed-tensors W8A8 int8 copy (format "int-quantized", the library's IntQuantizationCompressor: the
    int8 weight as it is, a scale per output channel) of the float checkpoint in `src`; returns the folder of the
    exact dequantized float checkpoint (q s: the activations' quantization happens at run time)."""
    from compressed_tensors.compressors.naive_quantized.base import IntQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig

    scheme = w8a8_scheme()

    def quantize(name: str, w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        scale = (w.float().abs().amax(1, keepdim=True) / 127).clamp(min=1e-6).to(scale_dtype)
        out = IntQuantizationCompressor.compress({"weight": w.float(), "weight_scale": scale}, scheme)
        return out, out["weight"].float() * out["weight_scale"].float()

    qc = QuantizationConfig(config_groups={"group_0": scheme}, format="int-quantized",
                            quantization_status="compressed", ignore=["lm_head"]).model_dump(mode="json")
    return _quantized_copy(src, dst, -1, quantize, qc)
