"""Phi-3 / Phi-3.5 / Phi-4-mini (`Phi3ForCausalLM`): a Llama-shaped decoder whose checkpoints fuse the
attention input projection (`qkv_proj`: q rows, then k, then v) and the MLP input projection (`gate_up_proj`:
gate rows, then up), with LongRoPE scaling (`longrope`, older `su`) and, on Phi-4-mini, a partial rotary
(`partial_rotary_factor`). Both live in layers/rotary.py; the compute is llama.py's.

Loading splits each fused tensor into its parts on row boundaries and hands every part to tokenloom's merged
parallel linears (`QKVParallelLinear.load_part`, `MergedColumnParallelLinear.load_part`), which take each TP rank's
shard of q, k, v and of gate, up: slicing the fused tensor by rank directly would give a rank q rows of one
head range and k/v rows of the wrong one. A GGUF's kept-quantized fused tensor (`QuantMatrix`) splits the
same way (`narrow_rows`: quantized blocks run along a row, so whole rows are exact).

Phi-3's `sliding_window` (e.g. 2047 on Phi-3-mini-4k) applies to every layer; the attention backends honour
it (ModelConfig.sliding_window).
"""

from __future__ import annotations

import torch

from tokenloom.layers.linear import WeightShapeError
from tokenloom.layers.quant_linear import Weight, narrow_rows
from tokenloom.models.llama import LlamaForCausalLM

_FUSED = ("self_attn.qkv_proj", "mlp.gate_up_proj")


class Phi3ForCausalLM(LlamaForCausalLM):
    """LlamaForCausalLM with Phi-3's fused checkpoint tensors (see the module docstring)."""

    def required_weight_names(self) -> set[str]:
        names = set()
        for name in super().required_weight_names():
            for part, fused in (("self_attn.q_proj", "self_attn.qkv_proj"), ("self_attn.k_proj", None),
                                ("self_attn.v_proj", None), ("mlp.gate_proj", "mlp.gate_up_proj"),
                                ("mlp.up_proj", None)):
                if f".{part}." in name:
                    name = name.replace(part, fused) if fused else ""
                    break
            if name:
                names.add(name)
        return names

    def _split_sizes(self, module: str) -> list[tuple[str, int]]:
        cfg = self.cfg
        if module == "self_attn.qkv_proj":
            kv = cfg.num_key_value_heads * cfg.head_dim
            return [("self_attn.q_proj", cfg.num_attention_heads * cfg.head_dim), ("self_attn.k_proj", kv),
                    ("self_attn.v_proj", kv)]
        return [("mlp.gate_proj", cfg.intermediate_size), ("mlp.up_proj", cfg.intermediate_size)]

    def _load_one(self, name: str, tensor: Weight) -> bool:
        parts = name.split(".")
        module = ".".join(parts[3:-1]) if len(parts) >= 5 and parts[:2] == ["model", "layers"] else ""
        if module not in _FUSED:
            return super()._load_one(name, tensor)
        sizes = self._split_sizes(module)
        total = sum(n for _, n in sizes)
        rows = int(tensor.shape[0])
        if rows != total:
            what = " + ".join(f"{n} {part.rsplit('.', 1)[1]}" for part, n in sizes)
            raise WeightShapeError(f"{name}: checkpoint has {rows} rows, expected {total} ({what})")
        prefix, suffix = ".".join(parts[:3]), parts[-1]
        loaded = False
        start = 0
        for part, n in sizes:
            piece = narrow_rows(tensor, start, n)
            if isinstance(piece, torch.Tensor):
                piece = piece.contiguous()
            loaded = super()._load_one(f"{prefix}.{part}.{suffix}", piece) or loaded
            start += n
        return loaded
