"""Token-to-expert assignments in the form the fused MoE call takes (tokenloom/kernels/quant_gemm.moe_experts):
the (token, expert) pairs sorted by expert and each active expert's run of them. Shared by the kernel tests."""

from __future__ import annotations

import torch


def expert_groups(ids: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [tokens, top_k] -> (order: the flattened pairs sorted by expert, stably; counts [experts]: pairs per
    expert; active: the experts with pairs; group_start [len(active) + 1]: each active expert's first pair in
    `order`)."""
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=experts)
    active = torch.nonzero(counts).flatten()
    group_start = torch.zeros(active.numel() + 1, dtype=torch.int64)
    group_start[1:] = counts.index_select(0, active).cumsum(0)
    return order, counts, active, group_start
