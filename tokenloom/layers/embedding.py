"""Vocab-parallel token embedding and LM head.

The vocabulary is padded to a multiple of `tp_size * 64` and split in contiguous ranges. The embedding masks
ids outside the local range and all-reduces; the LM head computes local logits and all-gathers them, then
drops the padding. At tp_size 1 both are a plain lookup / matmul.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenloom.distributed.parallel_state import ParallelContext
from tokenloom.layers import cpu_gemm
from tokenloom.layers.linear import _check_full_shape, _copy_checked


def _padded_vocab(vocab_size: int, tp_size: int) -> int:
    if tp_size == 1:
        return vocab_size
    multiple = 64 * tp_size
    return (vocab_size + multiple - 1) // multiple * multiple


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, ctx: ParallelContext, dtype: torch.dtype) -> None:
        super().__init__()
        self.ctx = ctx
        self.vocab_size = vocab_size
        padded = _padded_vocab(vocab_size, ctx.tp_size)
        self.local_vocab = padded // ctx.tp_size
        self.vocab_start = ctx.tp_rank * self.local_vocab
        self.weight = nn.Parameter(torch.zeros(self.local_vocab, hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.ctx.tp_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.local_vocab)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.ctx.all_reduce(out)

    def load_full(self, name: str, tensor: torch.Tensor) -> None:
        rows = max(0, min(self.local_vocab, self.vocab_size - self.vocab_start))
        _check_full_shape(name, tensor, (self.vocab_size, self.weight.shape[1]))
        _copy_checked(self.weight[:rows], tensor.narrow(0, self.vocab_start, rows), name)


class ParallelLMHead(nn.Module):
    """hidden -> float32 logits over the full vocabulary. May share its weight with the embedding (tied).

    Logits are never rounded to the model dtype: with a bf16 model on the CPU the native kernels keep the
    matmul's float32 sums (`cpu_gemm.native_linear_f32`); elsewhere a float32 copy of the weight is kept and
    the hidden states are widened (exact), so every path gives float32 sums of exact products.
    """

    def __init__(self, embedding: VocabParallelEmbedding, tied: bool, ctx: ParallelContext,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.ctx = ctx
        self.vocab_size = embedding.vocab_size
        self.vocab_start = embedding.vocab_start
        self.local_vocab = embedding.local_vocab
        if tied:
            self.weight = embedding.weight
        else:
            shape = embedding.weight.shape
            self.weight = nn.Parameter(torch.zeros(*shape, dtype=dtype), requires_grad=False)

    packed: cpu_gemm.PackedWeight | None = None
    weight_f32: torch.Tensor | None = None  # the float32 copy, where no native float32-output kernel runs

    def prepare_for_inference(self) -> None:
        self.packed = cpu_gemm.pack_weight(self.weight, onednn=False)
        if self.weight.dtype != torch.float32 and self.packed is None:
            self.weight_f32 = self.weight.float()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        flat = hidden.reshape(-1, hidden.shape[-1])
        logits = None
        if self.weight_f32 is None:
            logits = cpu_gemm.native_linear_f32(flat, self.weight, self.packed)
        if logits is None:
            weight = self.weight_f32 if self.weight_f32 is not None else self.weight.float()
            logits = F.linear(flat.float(), weight)
        logits = self.ctx.all_gather_last_dim(logits.view(*hidden.shape[:-1], -1))
        return logits[..., : self.vocab_size]

    load_full = VocabParallelEmbedding.load_full
