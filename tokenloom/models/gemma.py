"""Gemma 2 and Gemma 3 (text) decoders: Llama's parallel layers with Gemma's differences, all from the config.

- RMSNorm multiplies by (1 + w) and, as the reference does, normalizes and scales in float32 before the one
  rounding to the model dtype (transformers PR 29402); the weight is kept in float32 (`GemmaRMSNorm`).
- Sandwich norms: the attention output is normalized (post_attention_layernorm) before the residual add,
  the MLP input by pre_feedforward_layernorm and its output by post_feedforward_layernorm.
- Embeddings are multiplied by sqrt(hidden_size) rounded to the model dtype (as transformers does).
- GeGLU with the tanh GELU; attention scale query_pre_attn_scalar ** -0.5; attention logits soft-capped
  by the backend (`logit_cap`, Gemma 2) and final logits soft-capped here, cap * tanh(x / cap).
- Gemma 3: per-head (1 + w) q/k norms before RoPE; sliding layers rotate with `rope_local_theta` and no
  scaling, global layers with `rope_theta` and `rope_scaling`.
- Sliding-window layers: which keys a layer sees is the attention backend's business
  (`ModelConfig.layer_window`); the model only picks each layer's rotation.

Interface, TP and pipeline stages as `LlamaForCausalLM` (a subclass: weight loading is shared); the residual
stream is float32 as there.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenloom.distributed.parallel_state import ParallelContext
from tokenloom.forward_batch import ForwardBatch
from tokenloom.kernels import cpu_ops
from tokenloom.layers.activation import GeluTanhAndMul
from tokenloom.layers.attention.base import AttentionBackend
from tokenloom.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tokenloom.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    WeightShapeError,
    _copy_checked,
)
from tokenloom.layers.rotary import RotaryEmbedding, RotaryStep
from tokenloom.model_config import SLIDING_ATTENTION, ModelConfig
from tokenloom.models.llama import LlamaForCausalLM, select_logit_rows


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (offset + w) in float32, rounded once to x's dtype. `weight` is the checkpoint's w
    (float32); with `residual` (float32, the decoder's stream) returns (norm(x + residual), x + residual)."""

    def __init__(self, hidden_size: int, eps: float, offset: float) -> None:
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.zeros(hidden_size, dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        scale = self.weight.float() + self.offset
        if x.dtype == torch.float32 and cpu_ops.available(x) and (residual is None or residual.dtype == x.dtype):
            return cpu_ops.rms_norm(x, scale, self.eps, residual)  # all float32: the same arithmetic, native
        src = x if residual is None else x.to(residual.dtype) + residual
        out = torch.nn.functional.rms_norm(src.float(), scale.shape, scale, self.eps).to(x.dtype)
        return out if residual is None else (out, src)


class GemmaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, ctx: ParallelContext, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads,
                                          cfg.num_key_value_heads, False, ctx, dtype)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, False, ctx, dtype)
        self.num_heads = self.qkv_proj.num_heads_local
        self.num_kv_heads = self.qkv_proj.num_kv_heads_local
        self.head_dim = cfg.head_dim
        self.scaling = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
        self.logit_cap = cfg.attn_logit_softcap or 0.0
        self.q_norm = self.k_norm = None
        if cfg.qk_norm == "head":
            self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.norm_weight_offset)
            self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.norm_weight_offset)

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch, attn: AttentionBackend,
                rotary: RotaryStep) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        t, h, kv = hidden.shape[0], self.num_heads, self.num_kv_heads
        qk = qkv[:, : (h + kv) * self.head_dim].view(t, h + kv, self.head_dim)
        if self.q_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, :h]), self.k_norm(qk[:, h:])), dim=1)
        qk = RotaryEmbedding.apply(qk, rotary)
        v = qkv[:, (h + kv) * self.head_dim:].view(t, kv, self.head_dim)
        cap = {"logit_cap": self.logit_cap} if self.logit_cap else {}  # backends without caps stay callable
        return self.o_proj(attn.forward(qk[:, :h], qk[:, h:], v, self.layer_id, self.scaling, batch, **cap))


class GemmaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, [cfg.intermediate_size, cfg.intermediate_size], False, ctx, dtype)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, False, ctx, dtype)
        self.act = GeluTanhAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, ctx: ParallelContext, dtype: torch.dtype) -> None:
        super().__init__()
        norm = lambda: GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_weight_offset)  # noqa: E731
        self.is_sliding = bool(cfg.layer_types) and cfg.layer_types[layer_id] == SLIDING_ATTENTION
        self.input_layernorm = norm()
        self.self_attn = GemmaAttention(cfg, layer_id, ctx, dtype)
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.mlp = GemmaMLP(cfg, ctx, dtype)
        self.post_feedforward_layernorm = norm()

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch,
                attn: AttentionBackend, rotary: RotaryStep) -> tuple[torch.Tensor, torch.Tensor]:
        """`hidden`: the previous layer's normalized MLP output (added to `residual` here), or the embeddings."""
        if residual is None:
            residual = hidden.float()  # the residual stream is float32 whatever the model dtype
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(hidden, batch, attn, rotary))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma2ForCausalLM and Gemma3ForCausalLM (text)."""

    _EXTRA_LAYER_NORMS = ("pre_feedforward_layernorm", "post_feedforward_layernorm")

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, dtype: torch.dtype,
                 start_layer: int = 0, end_layer: int | None = None) -> None:
        nn.Module.__init__(self)  # Llama's layers are not built: the fields below mirror LlamaForCausalLM's
        end_layer = cfg.num_hidden_layers if end_layer is None else end_layer
        if not 0 <= start_layer < end_layer <= cfg.num_hidden_layers:
            raise ValueError(f"layer range [{start_layer}, {end_layer}) outside 0..{cfg.num_hidden_layers}")
        self.cfg = cfg
        self.start_layer, self.end_layer = start_layer, end_layer
        self.is_first = start_layer == 0
        self.is_last = end_layer == cfg.num_hidden_layers
        self.dtype = dtype
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, ctx, dtype) \
            if self.is_first or (self.is_last and cfg.tie_word_embeddings) else None
        self.layers = nn.ModuleList(GemmaDecoderLayer(cfg, i, ctx, dtype) for i in range(start_layer, end_layer))
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.rotary_local = None
        if cfg.rope_local_theta is not None:
            self.rotary_local = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_local_theta,
                                                None)
        # sqrt(hidden_size) rounded to the model dtype, as transformers multiplies (55.4256 -> 55.5 in bf16)
        self.embed_scale = torch.tensor(cfg.embedding_multiplier or 1.0, dtype=dtype)
        self.final_cap = cfg.final_logit_softcap or 0.0
        if self.is_last:
            self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_weight_offset)
            self.lm_head = ParallelLMHead(self.embed_tokens or VocabParallelEmbedding(
                cfg.vocab_size, cfg.hidden_size, ctx, dtype), cfg.tie_word_embeddings, ctx, dtype)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor | dict[str, torch.Tensor]:
        if self.is_first:
            hidden, residual = self.embed_tokens(batch.input_ids) * self.embed_scale, None
        else:
            hidden, residual = batch.pp_proxy["hidden_states"], batch.pp_proxy["residual"]
        rotary = self.rotary.lookup(batch.positions, self.dtype)
        local = self.rotary_local.lookup(batch.positions, self.dtype) if self.rotary_local is not None else rotary
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, batch, attn, local if layer.is_sliding else rotary)
        if not self.is_last:
            return {"hidden_states": hidden, "residual": residual}
        rows = select_logit_rows(batch)
        hidden, _ = self.norm(hidden.index_select(0, rows), residual.index_select(0, rows))
        logits = self.lm_head(hidden)
        if self.final_cap:
            logits = torch.tanh(logits / self.final_cap).mul_(self.final_cap)
        return logits

    def required_weight_names(self) -> set[str]:
        names = super().required_weight_names()
        per_layer = [f"{n}.weight" for n in self._EXTRA_LAYER_NORMS]
        if self.cfg.qk_norm == "head":
            per_layer += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
        for i in range(self.start_layer, self.end_layer):
            names.update(f"model.layers.{i}.{p}" for p in per_layer)
        return names

    def _load_one(self, name: str, tensor: torch.Tensor) -> bool:
        parts = name.split(".")
        module = ".".join(parts[3:-1])
        if parts[:2] == ["model", "layers"] and len(parts) >= 5 and (
                module in self._EXTRA_LAYER_NORMS or module in ("self_attn.q_norm", "self_attn.k_norm")):
            layer_id = int(parts[2])
            if not self.start_layer <= layer_id < self.end_layer:
                return False
            target: nn.Module | None = self.layers[layer_id - self.start_layer]
            for attr in module.split("."):
                target = getattr(target, attr, None)
            if target is None:
                raise WeightShapeError(f"unexpected tensor {name!r} in checkpoint (this config has no q/k norm)")
            _copy_checked(target.weight, tensor, name)
            return True
        return super()._load_one(name, tensor)
