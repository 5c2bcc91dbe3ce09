"""Mixture-of-experts feed-forward: a router picks `top_k` of `num_experts` SwiGLU experts per token.

Routing (`route`): router logits in float32, softmax over all experts, top-k, optionally renormalised to sum 1
(`norm_topk_prob`; Mixtral and Qwen3-MoE checkpoints renormalise, OLMoE and Qwen2-MoE do not); bf16 rows on the
CPU in one native call (csrc/quant_moe.c's router, which the one-call native decode step also runs).

Grouped execution (`FusedMoE.forward`): the step's (token, expert) pairs are sorted by expert, so each active
expert runs its gate_up and down projections once on all of its rows: an expert's weights are read once per
step, not once per token, and an expert no token picked is not touched (at batch 1 only the k chosen ones).
Each expert's output rows are scaled by their routing weight and summed back per token with `index_add_` in
float32; the sum is rounded to the activation dtype once, at the end. With GGUF-quantized experts and bf16
activations (the default) the whole grouped computation is one native call (csrc/quant_moe.c): expert by
expert in Python costs ~10 small ops and two OpenMP regions per expert, several times the weight reads at
decode; the kernel keeps float32 between the projections where the modular path rounds to bf16.

Weights: float experts are two stacked tensors, `w13` [E_local, 2 * I_local, H] (gate rows then up rows) and
`w2` [E_local, H, I_local], in the model dtype. A GGUF's quantized experts (--quantization gguf) stay in the
file's blocks: per expert one `QuantWeight` for gate+up and one for down (layers/quant_linear.py, run by
kernels/quant_gemm.py), and the float stacks are dropped at `prepare_for_inference`.

Parallelism: tensor parallel (ep_size 1): each rank holds a slice of every expert (gate/up rows and down
columns split like the dense MLP's column/row-parallel layers) and the combined output is all-reduced once.
Expert parallel (ctx.ep_size == tp_size, SGLang's --ep-size / --enable-ep-moe): each rank holds whole experts,
a contiguous group of num_experts / ep_size, computes only the pairs routed to them, and the same one
all-reduce sums the groups. The router is replicated (every rank routes every token identically).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenloom.distributed.parallel_state import ParallelContext, divide
from tokenloom.kernels import quant_gemm
from tokenloom.kernels.quant_gemm import QuantMatrix
from tokenloom.layers.quant_linear import QUANT_MATRICES, QuantWeight, Weight

EXPERT_KINDS = ("gate_proj", "up_proj", "down_proj")


class MoEWeightError(ValueError):
    """An expert tensor does not fit the layer built from the config (the message names the tensor)."""


def route(hidden: torch.Tensor, router: torch.Tensor, top_k: int, renormalize: bool
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k] int64) of each token's top-k experts. bf16 rows on the CPU
    route in one native call (the native decode step's router, so the two paths pick the same experts with
    the same weights); otherwise torch."""
    native = quant_gemm.moe_route(hidden, router, top_k, renormalize)
    if native is not None:
        return native
    logits = F.linear(hidden.float(), router.float())
    probs = torch.softmax(logits, dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def float_weight(name: str, t: Weight) -> torch.Tensor:
    """A small tensor (router, shared-expert gate) as float32, dequantizing a GGUF's quantized rows."""
    if isinstance(t, QuantMatrix):
        return quant_gemm.dequantize(t).float()
    if isinstance(t, QUANT_MATRICES):
        raise MoEWeightError(f"{name}: integer-quantized router weights are not supported")
    return t.float()


class FusedMoE(nn.Module):
    """Router + experts of one MoE layer (see the module docstring). Input x [T, H] in the model dtype."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool, ctx: ParallelContext, dtype: torch.dtype) -> None:
        super().__init__()
        self.ctx = ctx
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        ep = ctx.ep_size
        if ep > 1:
            self.num_local = divide(num_experts, ep, "num_experts over --ep-size")
            self.first_expert = ctx.tp_rank * self.num_local
            self.inter_local = intermediate_size
        else:
            self.num_local, self.first_expert = num_experts, 0
            self.inter_local = divide(intermediate_size, ctx.tp_size, "MoE intermediate features")
        i, h = self.inter_local, hidden_size
        self.router = nn.Parameter(torch.empty(num_experts, h, dtype=torch.float32), requires_grad=False)
        self.w13 = nn.Parameter(torch.empty(self.num_local, 2 * i, h, dtype=dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(self.num_local, h, i, dtype=dtype), requires_grad=False)
        # quantized experts while loading: (local expert, kind index) -> shard; after prepare, per expert
        self._quant_parts: dict[tuple[int, int], Weight] = {}
        self.quant13: list[QuantWeight] | None = None
        self.quant2: list[QuantWeight] | None = None
        self.active_experts = 0  # experts the last forward ran on this rank (tests, step logs)
        # quantized experts that the one-call native kernel can run: per local expert (type ids, data
        # pointers) of gate_up and of down; None: expert by expert through quant_linear
        self.native_tables: tuple[torch.Tensor, ...] | None = None
        self.use_native = True  # tests compare the two paths

    # --- loading ------------------------------------------------------------------------------------------

    def load_router(self, name: str, tensor: Weight) -> None:
        w = float_weight(name, tensor)
        if tuple(w.shape) != tuple(self.router.shape):
            raise MoEWeightError(f"{name}: router shape {tuple(w.shape)} != expected {tuple(self.router.shape)}")
        self.router.copy_(w)

    def holds(self, expert: int) -> bool:
        return self.first_expert <= expert < self.first_expert + self.num_local

    def load_expert(self, name: str, expert: int, kind: str, tensor: Weight) -> bool:
        """Take this rank's share of expert `expert`'s `kind` (gate_proj / up_proj / down_proj) weight, given
        whole [I, H] (gate/up) or [H, I] (down); False when this rank does not hold the expert."""
        if not 0 <= expert < self.num_experts:
            raise MoEWeightError(f"{name}: expert {expert} outside 0..{self.num_experts - 1}")
        if not self.holds(expert):
            return False
        i_full, h = self.intermediate_size, self.hidden_size
        full = (h, i_full) if kind == "down_proj" else (i_full, h)
        if tuple(tensor.shape) != full:
            raise MoEWeightError(f"{name}: checkpoint shape {tuple(tensor.shape)} != expected {full}")
        local, i = expert - self.first_expert, self.inter_local
        start = 0 if self.ctx.ep_size > 1 else self.ctx.tp_rank * i
        kind_id = EXPERT_KINDS.index(kind)
        if kind == "down_proj":
            if isinstance(tensor, QUANT_MATRICES):
                shard = tensor if i == i_full else tensor.narrow_cols(
                    start, i, f"{name} at --tp-size {self.ctx.tp_size}")
                self._quant_parts[(local, kind_id)] = shard
            else:
                self.w2[local].copy_(tensor.narrow(1, start, i).to(self.w2.dtype))
            return True
        if isinstance(tensor, QUANT_MATRICES):
            self._quant_parts[(local, kind_id)] = tensor.narrow_rows(start, i) if i != i_full else tensor
        else:
            self.w13[local].narrow(0, kind_id * i, i).copy_(tensor.narrow(0, start, i).to(self.w13.dtype))
        return True

    def prepare_for_inference(self) -> None:
        """Quantized experts (a GGUF kept in its blocks) become one QuantWeight per expert for gate+up and one
        for down; the float stacks are then dropped (no float copy of a quantized expert)."""
        if not self._quant_parts:
            return
        dtype, i = self.w13.dtype, self.inter_local
        quant13, quant2 = [], []
        for e in range(self.num_local):
            parts = [self._quant_parts.get((e, k)) for k in range(3)]
            gate = parts[0] if parts[0] is not None else self.w13[e, :i].clone()
            up = parts[1] if parts[1] is not None else self.w13[e, i:].clone()
            down = parts[2] if parts[2] is not None else self.w2[e].clone()
            q13, q2 = QuantWeight.from_parts([gate, up]), QuantWeight.from_parts([down])
            q13.prepare(dtype, f"expert {e} gate_up")
            q2.prepare(dtype, f"expert {e} down")
            quant13.append(q13)
            quant2.append(q2)
        self.quant13, self.quant2 = quant13, quant2
        self._quant_parts = {}
        self.w13 = None
        self.w2 = None
        self.native_tables = self._native_expert_tables()

    def _native_expert_tables(self) -> tuple[torch.Tensor, ...] | None:
        """(gate_up types, gate_up data pointers, down types, down data pointers) over the local experts when
        every expert is one prepared GGUF matrix per projection of a type the native kernels run, else None.
        The pointers stay valid: quant13 / quant2 hold the matrices for the layer's life."""
        if not quant_gemm.native_moe_supported():
            return None
        tables: list[list[int]] = [[], [], [], []]
        for q13, q2 in zip(self.quant13 or (), self.quant2 or (), strict=True):
            for slot, q in ((0, q13), (2, q2)):
                if len(q.segments) != 1:
                    return None
                w = q.segments[0].weight
                if not isinstance(w, QuantMatrix) or not w.packed or not quant_gemm.native_supported(w.qtype) \
                        or q.segments[0].in_perm is not None:  # (act-order: the fused call gathers no input)
                    return None
                tables[slot].append(w.qtype)
                tables[slot + 1].append(w.data.data_ptr())
        if not tables[0] or self.hidden_size % 32 or self.inter_local % 32:
            return None
        return (torch.tensor(tables[0], dtype=torch.int32), torch.tensor(tables[1], dtype=torch.int64),
                torch.tensor(tables[2], dtype=torch.int32), torch.tensor(tables[3], dtype=torch.int64))

    # --- forward ------------------------------------------------------------------------------------------

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """SwiGLU of local expert `e` on rows x [n, H] -> [n, H] (this rank's partial sum under TP)."""
        i = self.inter_local
        if self.quant13 is not None:
            gate_up = self.quant13[e].linear(x, None, x.dtype)
            act = F.silu(gate_up[:, :i]) * gate_up[:, i:]
            return self.quant2[e].linear(act, None, x.dtype)
        gate_up = F.linear(x, self.w13[e])
        return F.linear(F.silu(gate_up[:, :i]) * gate_up[:, i:], self.w2[e])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(x, self.router, self.top_k, self.renormalize)
        out = self.combine(x, weights, ids)
        return self.ctx.all_reduce(out).to(x.dtype)

    def combine(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Sum over each token's routed (local) experts of weight * expert(x), float32 [T, H], unreduced."""
        if (self.native_tables is not None and self.use_native and x.dtype == torch.bfloat16
                and x.device.type == "cpu"):
            return self._combine_native(x, weights, ids)
        k = ids.shape[1]
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # pair indices grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        out = torch.zeros(x.shape[0], self.hidden_size, dtype=torch.float32, device=x.device)
        flat_w = weights.reshape(-1)
        start, active = 0, 0
        for e, n in enumerate(counts):
            if n and self.holds(e):
                pairs = order[start:start + n]
                tokens = pairs // k
                y = self._expert(e - self.first_expert, x.index_select(0, tokens))
                out.index_add_(0, tokens, y.float() * flat_w.index_select(0, pairs).unsqueeze(1))
                active += 1
            start += n
        self.active_experts = active
        return out

    def _combine_native(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """`combine` in one native call (csrc/quant_moe.c): the same grouping by expert, this rank's experts
        only, every projection and the weighted sum inside the kernel."""
        k = ids.shape[1]
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # pair indices grouped by expert, tokens ascending within
        counts = torch.bincount(flat, minlength=self.num_experts)
        local = counts[self.first_expert:self.first_expert + self.num_local]
        first = int(counts[:self.first_expert].sum()) if self.first_expert else 0
        pairs = order[first:first + int(local.sum())]
        active = torch.nonzero(local).flatten()
        group_start = torch.zeros(active.numel() + 1, dtype=torch.int64)
        group_start[1:] = local.index_select(0, active).cumsum(0)
        gu_types, gu_data, down_types, down_data = self.native_tables
        self.active_experts = int(active.numel())
        return quant_gemm.moe_experts(
            x.contiguous(), pairs // k, weights.reshape(-1).float().index_select(0, pairs).contiguous(),
            group_start, (gu_types.index_select(0, active), gu_data.index_select(0, active)),
            (down_types.index_select(0, active), down_data.index_select(0, active)), self.inter_local)
