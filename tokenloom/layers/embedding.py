"""Vocab-parallel token embedding and LM head.

The vocabulary is padded to a multiple of `tp_size * 64` and split in contiguous ranges. The embedding masks
ids outside the local range and all-reduces; the LM head computes local logits and all-gathers them, then
drops the padding. At tp_size 1 both are a plain lookup / matmul.

A quantized checkpoint tensor (`QuantMatrix`, --quantization gguf) is kept quantized: the embedding looks its
rows up with `quant_gemm.embedding`, the LM head (tied: the embedding's own matrix, one copy) runs
`quant_gemm.linear` with float32 output; the float parameter is dropped. Vocabulary padding rows are zero
bytes, which every supported type dequantizes to 0 (all scales 0).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenloom.distributed.parallel_state import ParallelContext
from tokenloom.kernels import quant_gemm
from tokenloom.kernels.quant_gemm import QuantMatrix
from tokenloom.layers import cpu_gemm
from tokenloom.layers.linear import _check_full_shape, _copy_checked
from tokenloom.layers.quant_linear import Weight


def _padded_vocab(vocab_size: int, tp_size: int) -> int:
    if tp_size == 1:
        return vocab_size
    multiple = 64 * tp_size
    return (vocab_size + multiple - 1) // multiple * multiple


class VocabParallelEmbedding(nn.Module):
    quant: QuantMatrix | None = None  # the local rows, when the checkpoint's tensor is quantized

    def __init__(self, vocab_size: int, hidden_size: int, ctx: ParallelContext, dtype: torch.dtype) -> None:
        super().__init__()
        self.ctx = ctx
        self.dtype = dtype
        self.vocab_size = vocab_size
        padded = _padded_vocab(vocab_size, ctx.tp_size)
        self.local_vocab = padded // ctx.tp_size
        self.vocab_start = ctx.tp_rank * self.local_vocab
        self.weight = nn.Parameter(torch.zeros(self.local_vocab, hidden_size, dtype=dtype), requires_grad=False)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            return quant_gemm.embedding(ids, self.quant, self.dtype)
        return F.embedding(ids, self.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.ctx.tp_size == 1:
            return self._lookup(ids)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.local_vocab)
        out = self._lookup(local.masked_fill(outside, 0))
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.ctx.all_reduce(out)

    def prepare_for_inference(self) -> None:
        if self.quant is not None:
            self.quant = quant_gemm.prepare(self.quant)

    def load_full(self, name: str, tensor: Weight) -> None:
        rows = max(0, min(self.local_vocab, self.vocab_size - self.vocab_start))
        _check_full_shape(name, tensor, (self.vocab_size, self.weight.shape[1]))
        if isinstance(tensor, QuantMatrix):
            self.quant = _quant_vocab_shard(tensor, self.vocab_start, rows, self.local_vocab)
            self.weight = None  # (a tied LM head drops its reference in prepare_for_inference)
            return
        _copy_checked(self.weight[:rows], tensor.narrow(0, self.vocab_start, rows), name)


def _quant_vocab_shard(qm: QuantMatrix, start: int, rows: int, local_vocab: int) -> QuantMatrix:
    """Rows [start, start + rows) of `qm`, padded with zero-byte rows (which dequantize to 0) to `local_vocab`."""
    parts = [qm.narrow_rows(start, rows)] if rows else []
    if rows < local_vocab:
        pad = torch.zeros(local_vocab - rows, qm.data.shape[1], dtype=torch.uint8)
        parts.append(QuantMatrix(qm.qtype, local_vocab - rows, qm.cols, pad))
    return parts[0] if len(parts) == 1 else QuantMatrix.cat_rows(parts)


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
        # A plain list, so the embedding is not registered twice as a submodule.
        self._tied_to = [embedding] if tied else []
        if tied:
            self.weight = embedding.weight
        else:
            shape = embedding.weight.shape
            self.weight = nn.Parameter(torch.zeros(*shape, dtype=dtype), requires_grad=False)

    packed: cpu_gemm.PackedWeight | None = None
    weight_f32: torch.Tensor | None = None  # the float32 copy, where no native float32-output kernel runs
    quant: QuantMatrix | None = None  # untied and quantized: this head's own local rows

    def quant_matrix(self) -> QuantMatrix | None:
        return self._tied_to[0].quant if self._tied_to else self.quant

    def prepare_for_inference(self) -> None:
        if self.quant_matrix() is not None:
            if not self._tied_to:
                self.quant = quant_gemm.prepare(self.quant)
            self.weight = None  # tied: the embedding's float parameter, dropped there too
            return
        self.packed = cpu_gemm.pack_weight(self.weight, onednn=False)
        if self.weight.dtype != torch.float32 and self.packed is None:
            self.weight_f32 = self.weight.float()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        flat = hidden.reshape(-1, hidden.shape[-1])
        logits = None
        qm = self.quant_matrix()
        if qm is not None:
            logits = quant_gemm.linear(flat, qm, None, torch.float32)
        elif self.weight_f32 is None:
            logits = cpu_gemm.native_linear_f32(flat, self.weight, self.packed)
        if logits is None:
            weight = self.weight_f32 if self.weight_f32 is not None else self.weight.float()
            logits = F.linear(flat.float(), weight)
        logits = self.ctx.all_gather_last_dim(logits.view(*hidden.shape[:-1], -1))
        return logits[..., : self.vocab_size]

    load_full = VocabParallelEmbedding.load_full
