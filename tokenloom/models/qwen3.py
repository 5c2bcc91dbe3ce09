"""Qwen3 decoder: Llama's layers with a per-head RMSNorm on q and k (`q_norm`, `k_norm`, weights of head_dim
shared by every head) applied after the projection and before RoPE; head_dim comes from the config and may
differ from hidden_size / num_attention_heads; no QKV bias unless the config sets it.

Everything else (TP sharding, PP stages, the float32 residual stream, logits) is LlamaForCausalLM's. The norms
act per head, so under TP each rank normalizes its own heads with the same (replicated) weights.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from tokenloom.distributed.parallel_state import ParallelContext
from tokenloom.forward_batch import ForwardBatch
from tokenloom.kernels import cpu_ops
from tokenloom.layers.attention.base import AttentionBackend
from tokenloom.layers.linear import _copy_checked
from tokenloom.layers.norm import RMSNorm
from tokenloom.layers.rotary import RotaryEmbedding, RotaryStep
from tokenloom.model_config import ModelConfig
from tokenloom.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM

_QK_NORM = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(q_norm|k_norm)\.weight$")


class Qwen3Attention(LlamaAttention):
    def __init__(self, cfg: ModelConfig, layer_id: int, ctx: ParallelContext, dtype: torch.dtype) -> None:
        super().__init__(cfg, layer_id, ctx, dtype)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype)

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch, attn: AttentionBackend,
                rotary: RotaryStep) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        t, h, kv, d = hidden.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        if cpu_ops.qk_head_norm_(qkv, h, kv, d, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps):
            qk = qkv[:, : (h + kv) * d].view(t, h + kv, d)  # normalized in place (the native decode step's kernel)
        else:
            # One row per head: the norm runs over head_dim (the slices are strided, so this copies once).
            q = self.q_norm(qkv[:, : h * d].reshape(t * h, d)).view(t, h, d)
            k = self.k_norm(qkv[:, h * d: (h + kv) * d].reshape(t * kv, d)).view(t, kv, d)
            qk = torch.cat((q, k), dim=1)
        qk = RotaryEmbedding.apply(qk, rotary)  # q and k heads rotated in one pass
        v = qkv[:, (h + kv) * d:].view(t, kv, d)
        return self.o_proj(attn.forward(qk[:, :h], qk[:, h:], v, self.layer_id, self.scaling, batch))


class Qwen3ForCausalLM(LlamaForCausalLM):
    def make_layer(self, cfg: ModelConfig, layer_id: int, ctx: ParallelContext, dtype: torch.dtype) -> nn.Module:
        return LlamaDecoderLayer(cfg, layer_id, ctx, dtype, attention=Qwen3Attention(cfg, layer_id, ctx, dtype))

    def required_weight_names(self) -> set[str]:
        names = super().required_weight_names()
        for i in range(self.start_layer, self.end_layer):
            names.update(f"model.layers.{i}.self_attn.{n}.weight" for n in ("q_norm", "k_norm"))
        return names

    def _load_one(self, name: str, tensor: torch.Tensor) -> bool:
        m = _QK_NORM.match(name)
        if m is None:
            return super()._load_one(name, tensor)
        layer_id = int(m.group(1))
        if not self.start_layer <= layer_id < self.end_layer:
            return False
        _copy_checked(getattr(self.layers[layer_id - self.start_layer].self_attn, m.group(2)).weight, tensor, name)
        return True
