"""Llama-family decoder (Llama, Mistral, SmolLM2, Qwen2): config-driven QKV bias, tied or untied
embeddings, GQA, RoPE with the config's theta and scaling, RMSNorm, SwiGLU.

Written for tensor parallelism (QKV and gate/up column-parallel, o/down row-parallel, vocab-parallel
embedding and head) and for pipeline stages: a model holds layers [start_layer, end_layer) only; the first
stage owns the embedding, the last the final norm and LM head. A stage that is not first takes
`batch.pp_proxy` ({"hidden_states", "residual"}) as input; a stage that is not last returns it.

Numerics: weights, activations and the KV cache are in the model dtype, but the residual stream is float32
(each layer's output is added to it unrounded) and the logits leave the LM head as float32 sums, never
rounded to bf16: those two roundings cost bf16 most of its accuracy (docs/benchmarks.md, issue 16).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from tokenloom.distributed.parallel_state import ParallelContext
from tokenloom.forward_batch import ForwardBatch
from tokenloom.layers.activation import SiluAndMul
from tokenloom.layers.attention.base import AttentionBackend
from tokenloom.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tokenloom.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    WeightShapeError,
    _copy_checked,
)
from tokenloom.layers.norm import RMSNorm
from tokenloom.layers.rotary import RotaryEmbedding, RotaryStep
from tokenloom.model_config import ModelConfig


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, ctx: ParallelContext, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads,
                                          cfg.num_key_value_heads, cfg.attention_bias, ctx, dtype)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, False, ctx, dtype)
        self.num_heads = self.qkv_proj.num_heads_local
        self.num_kv_heads = self.qkv_proj.num_kv_heads_local
        self.head_dim = cfg.head_dim
        self.scaling = cfg.head_dim ** -0.5

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch, attn: AttentionBackend,
                rotary: RotaryStep) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        t, h, kv = hidden.shape[0], self.num_heads, self.num_kv_heads
        qk = qkv[:, : (h + kv) * self.head_dim].view(t, h + kv, self.head_dim)
        qk = RotaryEmbedding.apply(qk, rotary)  # q and k heads rotated in one pass
        v = qkv[:, (h + kv) * self.head_dim:].view(t, kv, self.head_dim)
        return self.o_proj(attn.forward(qk[:, :h], qk[:, h:], v, self.layer_id, self.scaling, batch))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, [cfg.intermediate_size, cfg.intermediate_size], False, ctx, dtype)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, False, ctx, dtype)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, ctx: ParallelContext, dtype: torch.dtype,
                 attention: nn.Module | None = None) -> None:
        """`attention`: a family's own attention module (same forward signature), else LlamaAttention."""
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = attention if attention is not None else LlamaAttention(cfg, layer_id, ctx, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = LlamaMLP(cfg, ctx, dtype)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch,
                attn: AttentionBackend, rotary: RotaryStep
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden.float()  # the residual stream is float32 whatever the model dtype
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, batch, attn, rotary)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, dtype: torch.dtype,
                 start_layer: int = 0, end_layer: int | None = None) -> None:
        super().__init__()
        end_layer = cfg.num_hidden_layers if end_layer is None else end_layer
        if not 0 <= start_layer < end_layer <= cfg.num_hidden_layers:
            raise ValueError(f"layer range [{start_layer}, {end_layer}) outside 0..{cfg.num_hidden_layers}")
        self.cfg = cfg
        self.start_layer, self.end_layer = start_layer, end_layer
        self.is_first = start_layer == 0
        self.is_last = end_layer == cfg.num_hidden_layers
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, ctx, dtype) \
            if self.is_first or (self.is_last and cfg.tie_word_embeddings) else None
        self.layers = nn.ModuleList(self.make_layer(cfg, i, ctx, dtype) for i in range(start_layer, end_layer))
        self.rotary = RotaryEmbedding.for_model(cfg)
        self.dtype = dtype
        if self.is_last:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
            self.lm_head = ParallelLMHead(self.embed_tokens or VocabParallelEmbedding(
                cfg.vocab_size, cfg.hidden_size, ctx, dtype), cfg.tie_word_embeddings, ctx, dtype)

    def make_layer(self, cfg: ModelConfig, layer_id: int, ctx: ParallelContext, dtype: torch.dtype) -> nn.Module:
        """Decoder layer `layer_id`; a family's subclass overrides this (its attention, norms or MLP), which
        builds each layer once (no Llama layer allocated and then replaced)."""
        return LlamaDecoderLayer(cfg, layer_id, ctx, dtype)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor | dict[str, torch.Tensor]:
        """Last stage: logits (float32) of the positions `select_logit_rows` picks; else hidden states."""
        if self.is_first:
            hidden, residual = self.embed_tokens(batch.input_ids), None
        else:
            hidden, residual = batch.pp_proxy["hidden_states"], batch.pp_proxy["residual"]
        rotary = self.rotary.lookup_batch(batch, self.dtype)  # shared by every layer of this step
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, batch, attn, rotary)
        if not self.is_last:
            return {"hidden_states": hidden, "residual": residual}
        hidden = hidden.index_select(0, select_logit_rows(batch))
        residual = residual.index_select(0, select_logit_rows(batch))
        hidden, _ = self.norm(hidden, residual)
        return self.lm_head(hidden)

    def required_weight_names(self) -> set[str]:
        """HF tensor names this stage cannot run without."""
        names: set[str] = set()
        if self.is_first or (self.is_last and self.cfg.tie_word_embeddings):
            names.add("model.embed_tokens.weight")
        if self.is_last:
            names.add("model.norm.weight")
            if not self.cfg.tie_word_embeddings:
                names.add("lm_head.weight")
        per_layer = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                     "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                     "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight"]
        if self.cfg.attention_bias:
            per_layer += ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"]
        for i in range(self.start_layer, self.end_layer):
            names.update(f"model.layers.{i}.{p}" for p in per_layer)
        return names

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into this stage's shard; raise on unknown, missing or misshapen ones."""
        required = self.required_weight_names()
        for name, tensor in weights:
            if self._load_one(name, tensor):
                required.discard(name)
        if required:
            missing = sorted(required)
            raise WeightShapeError(f"checkpoint lacks {len(missing)} tensor(s), e.g. {missing[:4]}")

    def _load_one(self, name: str, tensor: torch.Tensor) -> bool:
        """Load one tensor if this stage holds it; return whether it did."""
        if "rotary_emb.inv_freq" in name:
            return False
        if name == "model.embed_tokens.weight":
            if self.embed_tokens is None:
                return False
            self.embed_tokens.load_full(name, tensor)
            return True
        if name == "lm_head.weight":
            if not self.is_last or self.cfg.tie_word_embeddings:
                return False
            self.lm_head.load_full(name, tensor)
            return True
        if name == "model.norm.weight":
            if not self.is_last:
                return False
            _copy_checked(self.norm.weight, tensor, name)
            return True
        parts = name.split(".")
        if len(parts) < 5 or parts[:2] != ["model", "layers"]:
            raise WeightShapeError(f"unexpected tensor {name!r} in checkpoint")
        layer_id = int(parts[2])
        if not self.start_layer <= layer_id < self.end_layer:
            return False
        layer = self.layers[layer_id - self.start_layer]
        local = ".".join(parts[3:])
        is_bias = local.endswith(".bias")
        qkv = {"self_attn.q_proj": 0, "self_attn.k_proj": 1, "self_attn.v_proj": 2}
        gate_up = {"mlp.gate_proj": 0, "mlp.up_proj": 1}
        module = local.rsplit(".", 1)[0]
        if module in qkv:
            layer.self_attn.qkv_proj.load_part(name, qkv[module], tensor, is_bias)
            return True
        if module in gate_up:
            layer.mlp.gate_up_proj.load_part(name, gate_up[module], tensor, is_bias)
            return True
        if module in ("self_attn.o_proj", "mlp.down_proj"):
            target = layer.self_attn.o_proj if module == "self_attn.o_proj" else layer.mlp.down_proj
            target.load_full(name, tensor, is_bias)
            return True
        if module in ("input_layernorm", "post_attention_layernorm"):
            _copy_checked(getattr(layer, module).weight, tensor, name)
            return True
        raise WeightShapeError(f"unexpected tensor {name!r} in checkpoint")


def select_logit_rows(batch: ForwardBatch) -> torch.Tensor:
    """Rows of the hidden states whose logits are needed: the batch's planned rows (prompt logprobs), every
    token, or each request's last token."""
    if batch.logit_rows is not None:
        return batch.logit_rows
    if batch.return_all_logits:
        return torch.arange(batch.input_ids.numel(), device=batch.input_ids.device)
    return batch.extend_start_loc + batch.extend_seq_lens - 1
