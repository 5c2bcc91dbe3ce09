"""Mixture-of-experts decoders: Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, from one config-driven implementation.

They are Llama decoders (models/llama.py: attention, RoPE, norms, embedding, head, pipeline stages, TP) whose
feed-forward is an MoE block (layers/moe.py) on the layers `ModelConfig.is_moe_layer` names (a plain Llama MLP
on the others: Qwen's mlp_only_layers / decoder_sparse_step), plus what each family adds:
- q/k RMSNorm (`qk_norm`): "head" (Qwen3-MoE) normalises each head over head_dim, before RoPE; "full"
  (OLMoE) normalises the whole q and the whole k projection, so under TP each rank's sum of squares is
  all-reduced first (a replicated KV head counted once);
- Qwen2-MoE's shared expert: a dense SwiGLU of shared_expert_intermediate_size on every token, scaled by
  sigmoid(shared_expert_gate(x)) and added to the routed experts' sum.

Checkpoint names: per-expert (`mlp.experts.{e}.gate_proj.weight`; Mixtral's `block_sparse_moe.experts.{e}.w1/
w3/w2` and `block_sparse_moe.gate`) as the Hub's checkpoints and transformers' save_pretrained write them, or
the fused 3-D form transformers holds in memory (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj`
[E, H, I]); models/gguf_file.py turns a GGUF's 3-D expert tensors into the per-expert names.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from tokenloom.distributed.parallel_state import ParallelContext
from tokenloom.forward_batch import ForwardBatch
from tokenloom.kernels import cpu_ops
from tokenloom.layers.attention.base import AttentionBackend
from tokenloom.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tokenloom.layers.linear import WeightShapeError, _copy_checked
from tokenloom.layers.moe import FusedMoE, float_weight
from tokenloom.layers.norm import RMSNorm
from tokenloom.layers.quant_linear import Weight
from tokenloom.layers.rotary import RotaryEmbedding, RotaryStep
from tokenloom.model_config import ModelConfig
from tokenloom.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP

_EXPERT_RE = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_MIXTRAL_KINDS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def canonical_names(weights: Iterable[tuple[str, Weight]]) -> Iterator[tuple[str, Weight]]:
    """HF names in the one form the model loads: Mixtral's block_sparse_moe / w1 w2 w3 renamed, transformers'
    fused 3-D expert tensors split per expert."""
    for name, tensor in weights:
        name = name.replace(".block_sparse_moe.", ".mlp.")
        m = re.match(r"^(.*\.mlp\.experts\.\d+)\.(w[123])\.weight$", name)
        if m:
            name = f"{m.group(1)}.{_MIXTRAL_KINDS[m.group(2)]}.weight"
        if name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")) and tensor.dim() == 3:
            base = name.rsplit(".", 1)[0]
            if name.endswith("down_proj"):
                for e in range(tensor.shape[0]):
                    yield f"{base}.{e}.down_proj.weight", tensor[e]
            else:
                inter = tensor.shape[1] // 2
                for e in range(tensor.shape[0]):
                    yield f"{base}.{e}.gate_proj.weight", tensor[e, :inter]
                    yield f"{base}.{e}.up_proj.weight", tensor[e, inter:]
            continue
        yield name, tensor


class QKNormAttention(LlamaAttention):
    """Llama attention with q/k RMSNorm before RoPE: per head ("head") or over the whole projection ("full")."""

    def __init__(self, cfg: ModelConfig, layer_id: int, ctx: ParallelContext, dtype: torch.dtype) -> None:
        super().__init__(cfg, layer_id, ctx, dtype)
        self.ctx, self.mode, self.eps = ctx, cfg.qk_norm, cfg.rms_norm_eps
        d = cfg.head_dim
        q_size, k_size = (d, d) if self.mode == "head" else (self.num_heads * d, self.num_kv_heads * d)
        # RMSNorm modules only as weight holders (the forward normalises itself: "full" needs the TP sum)
        self.q_norm = RMSNorm(q_size, cfg.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(k_size, cfg.rms_norm_eps, dtype)
        self.full_sizes = (cfg.num_attention_heads * d, cfg.num_key_value_heads * d)

    def load_norm(self, name: str, which: str, tensor: torch.Tensor) -> None:
        dst = (self.q_norm if which == "q_norm" else self.k_norm).weight
        if self.mode == "head":
            _copy_checked(dst, tensor, name)
            return
        full = self.full_sizes[0 if which == "q_norm" else 1]
        if tuple(tensor.shape) != (full,):
            raise WeightShapeError(f"{name}: checkpoint shape {tuple(tensor.shape)} != expected ({full},)")
        qkv = self.qkv_proj
        head = qkv.ctx.tp_rank if which == "q_norm" else qkv.ctx.tp_rank // qkv.kv_replicas
        _copy_checked(dst, tensor.narrow(0, head * dst.shape[0], dst.shape[0]), name)

    def _norm(self, x: torch.Tensor, w: torch.Tensor, sumsq: torch.Tensor, count: int) -> torch.Tensor:
        # HF's order: normalise in float32, round to the dtype, then scale by the weight
        x = x.float() * torch.rsqrt(sumsq / count + self.eps)
        return w * x.to(w.dtype)

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch, attn: AttentionBackend,
                rotary: RotaryStep) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        t, h, kv, d = hidden.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        q = qkv[:, : h * d].view(t, h, d)
        k = qkv[:, h * d: (h + kv) * d].view(t, kv, d)
        if self.mode == "head":
            # native: in place on qkv, so q and k (its views) hold the result (the native decode step's kernel)
            if not cpu_ops.qk_head_norm_(qkv, h, kv, d, self.q_norm.weight, self.k_norm.weight, self.eps):
                q = self._norm(q, self.q_norm.weight, q.float().pow(2).sum(-1, keepdim=True), d)
                k = self._norm(k, self.k_norm.weight, k.float().pow(2).sum(-1, keepdim=True), d)
        else:
            # the whole projection's mean square: each rank's partial sums, all-reduced (a KV head replicated
            # on several ranks contributes once)
            sums = torch.stack([q.float().pow(2).sum((1, 2)),
                                k.float().pow(2).sum((1, 2)) / self.qkv_proj.kv_replicas], dim=1)
            sums = self.ctx.all_reduce(sums)
            q = self._norm(q.reshape(t, h * d), self.q_norm.weight, sums[:, :1], self.full_sizes[0]).view(t, h, d)
            k = self._norm(k.reshape(t, kv * d), self.k_norm.weight, sums[:, 1:], self.full_sizes[1]).view(t, kv, d)
        qk = RotaryEmbedding.apply(torch.cat([q, k], dim=1), rotary)
        v = qkv[:, (h + kv) * d:].view(t, kv, d)
        return self.o_proj(attn.forward(qk[:, :h], qk[:, h:], v, self.layer_id, self.scaling, batch))


class MoEBlock(nn.Module):
    """Routed experts (layers/moe.py) and, for Qwen2-MoE, the sigmoid-gated shared expert."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, dtype: torch.dtype) -> None:
        super().__init__()
        self.experts = FusedMoE(cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size,
                                cfg.moe_intermediate_size, cfg.norm_topk_prob, ctx, dtype)
        self.shared_expert: LlamaMLP | None = None
        if cfg.shared_expert_intermediate_size:
            from dataclasses import replace

            self.shared_expert = LlamaMLP(replace(cfg, intermediate_size=cfg.shared_expert_intermediate_size),
                                          ctx, dtype)
            self.shared_expert_gate = nn.Parameter(torch.empty(1, cfg.hidden_size, dtype=torch.float32),
                                                   requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x)
        if self.shared_expert is not None:
            gate = torch.sigmoid(x.float() @ self.shared_expert_gate.t())
            out = (out.float() + gate * self.shared_expert(x).float()).to(x.dtype)
        return out


class MoEDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, ctx: ParallelContext, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = QKNormAttention(cfg, layer_id, ctx, dtype) if cfg.qk_norm \
            else LlamaAttention(cfg, layer_id, ctx, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp: nn.Module = MoEBlock(cfg, ctx, dtype) if cfg.is_moe_layer(layer_id) else LlamaMLP(cfg, ctx, dtype)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch,
                attn: AttentionBackend, rotary: RotaryStep) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden.float()
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, batch, attn, rotary)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class MoEForCausalLM(LlamaForCausalLM):
    """LlamaForCausalLM's interface, forward and stage layout with MoE decoder layers."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, dtype: torch.dtype,
                 start_layer: int = 0, end_layer: int | None = None) -> None:
        nn.Module.__init__(self)  # LlamaForCausalLM's attributes, built with this family's layers
        end_layer = cfg.num_hidden_layers if end_layer is None else end_layer
        if not 0 <= start_layer < end_layer <= cfg.num_hidden_layers:
            raise ValueError(f"layer range [{start_layer}, {end_layer}) outside 0..{cfg.num_hidden_layers}")
        self.cfg = cfg
        self.start_layer, self.end_layer = start_layer, end_layer
        self.is_first = start_layer == 0
        self.is_last = end_layer == cfg.num_hidden_layers
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, ctx, dtype) \
            if self.is_first or (self.is_last and cfg.tie_word_embeddings) else None
        self.layers = nn.ModuleList(MoEDecoderLayer(cfg, i, ctx, dtype) for i in range(start_layer, end_layer))
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.dtype = dtype
        if self.is_last:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
            self.lm_head = ParallelLMHead(self.embed_tokens or VocabParallelEmbedding(
                cfg.vocab_size, cfg.hidden_size, ctx, dtype), cfg.tie_word_embeddings, ctx, dtype)

    def required_weight_names(self) -> set[str]:
        cfg = self.cfg
        names = {n for n in super().required_weight_names() if ".mlp." not in n}
        for i in range(self.start_layer, self.end_layer):
            p = f"model.layers.{i}"
            if cfg.qk_norm:
                names.update({f"{p}.self_attn.q_norm.weight", f"{p}.self_attn.k_norm.weight"})
            if not cfg.is_moe_layer(i):
                names.update(f"{p}.mlp.{k}.weight" for k in ("gate_proj", "up_proj", "down_proj"))
                continue
            names.add(f"{p}.mlp.gate.weight")
            experts = self.layers[i - self.start_layer].mlp.experts
            for e in range(experts.first_expert, experts.first_expert + experts.num_local):
                names.update(f"{p}.mlp.experts.{e}.{k}.weight" for k in ("gate_proj", "up_proj", "down_proj"))
            if cfg.shared_expert_intermediate_size:
                names.add(f"{p}.mlp.shared_expert_gate.weight")
                names.update(f"{p}.mlp.shared_expert.{k}.weight" for k in ("gate_proj", "up_proj", "down_proj"))
        return names

    def load_weights(self, weights: Iterable[tuple[str, Weight]]) -> None:
        super().load_weights(canonical_names(weights))

    def _load_one(self, name: str, tensor: Weight) -> bool:
        parts = name.split(".")
        if len(parts) < 5 or parts[:2] != ["model", "layers"]:
            return super()._load_one(name, tensor)
        layer_id = int(parts[2])
        if not self.start_layer <= layer_id < self.end_layer:
            return False
        layer = self.layers[layer_id - self.start_layer]
        local = ".".join(parts[3:])
        if local in ("self_attn.q_norm.weight", "self_attn.k_norm.weight"):
            if not isinstance(layer.self_attn, QKNormAttention):
                raise WeightShapeError(f"unexpected tensor {name!r}: the config declares no q/k norm")
            layer.self_attn.load_norm(name, parts[4], float_weight(name, tensor))
            return True
        if not local.startswith("mlp.") or not isinstance(layer.mlp, MoEBlock):
            return super()._load_one(name, tensor)
        block: MoEBlock = layer.mlp
        if local == "mlp.gate.weight":
            block.experts.load_router(name, tensor)
            return True
        m = _EXPERT_RE.match(local)
        if m:
            return block.experts.load_expert(name, int(m.group(1)), m.group(2), tensor)
        if block.shared_expert is not None:
            if local == "mlp.shared_expert_gate.weight":
                w = float_weight(name, tensor).reshape(-1, self.cfg.hidden_size)
                _copy_checked(block.shared_expert_gate, w, name)
                return True
            kind = local.removeprefix("mlp.shared_expert.").removesuffix(".weight")
            if kind in ("gate_proj", "up_proj"):
                block.shared_expert.gate_up_proj.load_part(name, 0 if kind == "gate_proj" else 1, tensor)
                return True
            if kind == "down_proj":
                block.shared_expert.down_proj.load_full(name, tensor)
                return True
        raise WeightShapeError(f"unexpected tensor {name!r} in checkpoint")
