"""SmolLM3 decoder: Llama whose layers listed in `ModelConfig.no_rope_layers` apply no rotary embedding
(NoPE layers: q and k enter attention as projected); every other layer is Llama's, as are TP, PP and the
weights' names. (The config's 1/0 flags or `no_rope_layer_interval` are turned into those layer ids by
model_families.py; a GGUF file carries neither, and llama.cpp fixes the interval at 4.)
"""

from __future__ import annotations

import torch
from torch import nn

from tokenloom.distributed.parallel_state import ParallelContext
from tokenloom.forward_batch import ForwardBatch
from tokenloom.layers.attention.base import AttentionBackend
from tokenloom.layers.rotary import RotaryStep
from tokenloom.model_config import ModelConfig
from tokenloom.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


class NoRopeAttention(LlamaAttention):
    """LlamaAttention without the rotation (the step's `rotary` is ignored)."""

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch, attn: AttentionBackend,
                rotary: RotaryStep) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        t, h, kv, d = hidden.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        q = qkv[:, : h * d].view(t, h, d)
        k = qkv[:, h * d: (h + kv) * d].view(t, kv, d)
        v = qkv[:, (h + kv) * d:].view(t, kv, d)
        return self.o_proj(attn.forward(q, k, v, self.layer_id, self.scaling, batch))


class SmolLM3ForCausalLM(LlamaForCausalLM):
    def make_layer(self, cfg: ModelConfig, layer_id: int, ctx: ParallelContext, dtype: torch.dtype) -> nn.Module:
        if layer_id not in cfg.no_rope_layers:
            return LlamaDecoderLayer(cfg, layer_id, ctx, dtype)
        return LlamaDecoderLayer(cfg, layer_id, ctx, dtype, attention=NoRopeAttention(cfg, layer_id, ctx, dtype))
