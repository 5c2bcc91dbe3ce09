"""Linear layers sharded for tensor parallelism; at tp_size 1 they are plain `F.linear`.

Column-parallel layers split output features (no communication); row-parallel layers split input features
and all-reduce their output. Each layer knows how to take its shard from a full checkpoint tensor
(`load_full`), so the loader never needs to know the sharding scheme. Merged layers (QKV, gate/up) keep one
weight so the forward runs one matmul instead of several.

Quantized weights (a GGUF's tensors under --quantization gguf) arrive as `QuantMatrix`: a layer takes its
shard the same way (output rows; for row-parallel layers input columns on block boundaries, a split that cuts
a block is refused naming the tensor), keeps the parts until `prepare_for_inference`, then holds them as a
`QuantWeight` (layers/quant_linear.py) and drops its float parameter (`weight` becomes None), so no float
copy of a quantized weight is ever kept. Layers loaded with float weights run exactly as before.

Hugging Face checkpoints: GPTQ/AWQ weights arrive as `IntQuantMatrix` (layers/int_quant.py) and take the same
path (a row-parallel shard must hold whole groups). Under `--torchao-config` (`quant_method` set by the loader)
a layer loads its float shard as usual and quantizes it in `prepare_for_inference`, so each rank quantizes only
its own rows and columns (a row-parallel shard that cuts a group is refused there, naming the tensor).
"""

from __future__ import annotations

import torch
from torch import nn

from tokenloom.distributed.parallel_state import ParallelContext, divide
from tokenloom.kernels.quant_gemm import QuantMatrix
from tokenloom.layers import cpu_gemm
from tokenloom.layers.int_quant import quantize_for_method
from tokenloom.layers.quant_linear import QUANT_MATRICES, QuantWeight, Weight, narrow_rows


class WeightShapeError(ValueError):
    """A checkpoint tensor does not fit the parameter built from the config."""


def _check_full_shape(name: str, tensor: Weight, expected: tuple[int, ...]) -> None:
    """Check a whole checkpoint tensor before taking a shard of it (a shard could fit by accident)."""
    if tuple(tensor.shape) != tuple(expected):
        raise WeightShapeError(f"{name}: checkpoint shape {tuple(tensor.shape)} != expected {tuple(expected)}")


def _copy_checked(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise WeightShapeError(f"{name}: checkpoint shape {tuple(src.shape)} != expected {tuple(dst.shape)}")
    dst.copy_(src.to(dst.dtype))


class _PackedLinear(nn.Module):
    """Shared forward plumbing: `prepare_for_inference` packs the loaded weight for the CPU kernel, or turns
    the quantized parts loaded into a `QuantWeight`."""

    packed: cpu_gemm.PackedWeight | None = None
    quant: QuantWeight | None = None
    _quant_parts: dict[int, QuantMatrix] | None = None  # part index -> local shard, while loading
    quant_method: str | None = None  # --torchao-config: quantize the loaded float weight at prepare
    weight_name: str = ""  # the checkpoint name of the weight (its first part), for errors

    def part_rows(self) -> list[tuple[int, int]]:
        """(first local row, rows) of each part of the weight, in order."""
        return [(0, self.weight.shape[0])]

    def _keep_quant(self, part: int, shard: QuantMatrix) -> None:
        if self._quant_parts is None:
            self._quant_parts = {}
        self._quant_parts[part] = shard

    def prepare_for_inference(self) -> None:
        what = self.weight_name or type(self).__name__
        if self.quant_method is not None and not self._quant_parts and self.weight is not None:
            # Rows are quantized independently, so the whole local weight at once = each part on its own.
            self.quant = QuantWeight.from_parts([quantize_for_method(self.weight.detach(), self.quant_method, what)])
            self.quant.prepare(self.weight.dtype, what)
            self.weight = None
            return
        if self._quant_parts:
            # Parts loaded as floats (a file's F16 tensor beside quantized ones) sit in `weight`: keep their rows.
            parts = [self._quant_parts.get(i) for i in range(len(self.part_rows()))]
            parts = [p if p is not None else self.weight.detach().narrow(0, start, n).clone()
                     for p, (start, n) in zip(parts, self.part_rows(), strict=True)]
            self.quant = QuantWeight.from_parts(parts)
            self.quant.prepare(self.weight.dtype, what)
            self._quant_parts = None
            self.weight = None  # no float copy of a quantized weight
            return
        self.packed = cpu_gemm.pack_weight(self.weight)

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.quant is not None:
            return self.quant.linear(x, bias, x.dtype)
        return cpu_gemm.linear(x, self.weight, self.packed, bias)


class ColumnParallelLinear(_PackedLinear):
    """y = x W^T (+ b) with W's rows (output features) split across TP ranks; output stays split."""

    def __init__(self, in_features: int, out_features: int, bias: bool, ctx: ParallelContext,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.ctx = ctx
        self.out_local = divide(out_features, ctx.tp_size, "output features")
        self.weight = nn.Parameter(torch.empty(self.out_local, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(self.out_local, dtype=dtype), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, self.bias)

    def load_full(self, name: str, tensor: Weight, is_bias: bool = False) -> None:
        full = (self.out_local * self.ctx.tp_size, *self.weight.shape[1:])
        _check_full_shape(name, tensor, full[:1] if is_bias else full)
        shard = narrow_rows(tensor, self.ctx.tp_rank * self.out_local, self.out_local)
        if isinstance(shard, QUANT_MATRICES):
            self._keep_quant(0, shard)
            return
        _copy_checked(self.bias if is_bias else self.weight, shard, name)


class MergedColumnParallelLinear(_PackedLinear):
    """Several column-parallel projections of the same input stored as one weight (gate_up_proj).

    Local layout: [shard of part 0 | shard of part 1 | ...], so each rank's output splits into the parts
    with `torch.split(sizes_local)`.
    """

    def __init__(self, in_features: int, part_sizes: list[int], bias: bool, ctx: ParallelContext,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.ctx = ctx
        self.local_sizes = [divide(s, ctx.tp_size, "output features") for s in part_sizes]
        self.offsets = [sum(self.local_sizes[:i]) for i in range(len(part_sizes))]
        total = sum(self.local_sizes)
        self.weight = nn.Parameter(torch.empty(total, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(total, dtype=dtype), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, self.bias)

    def full_part_rows(self, part: int) -> int:
        return self.local_sizes[part] * self.ctx.tp_size

    def part_rows(self) -> list[tuple[int, int]]:
        return list(zip(self.offsets, self.local_sizes, strict=True))

    def load_part(self, name: str, part: int, tensor: Weight, is_bias: bool = False) -> None:
        size = self.local_sizes[part]
        full = (self.full_part_rows(part), *self.weight.shape[1:])
        _check_full_shape(name, tensor, full[:1] if is_bias else full)
        self._store_part(name, part, narrow_rows(tensor, self.ctx.tp_rank * size, size), is_bias)

    def _store_part(self, name: str, part: int, shard: Weight, is_bias: bool) -> None:
        if isinstance(shard, QUANT_MATRICES):
            self._keep_quant(part, shard)
            return
        dst = (self.bias if is_bias else self.weight).narrow(0, self.offsets[part], self.local_sizes[part])
        _copy_checked(dst, shard, name)


class QKVParallelLinear(MergedColumnParallelLinear):
    """Q, K and V projections in one weight, split by heads. KV heads are replicated when tp > kv heads."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 ctx: ParallelContext, dtype: torch.dtype) -> None:
        self.num_heads_local = divide(num_heads, ctx.tp_size, "attention heads")
        if num_kv_heads >= ctx.tp_size:
            self.num_kv_heads_local = divide(num_kv_heads, ctx.tp_size, "kv heads")
            self.kv_replicas = 1
        else:
            self.num_kv_heads_local = 1
            self.kv_replicas = divide(ctx.tp_size, num_kv_heads, "tp_size over kv heads")
        self.head_dim = head_dim
        q_size = self.num_heads_local * head_dim
        kv_size = self.num_kv_heads_local * head_dim
        # MergedColumnParallelLinear divides by tp; pass the global sizes of what each rank holds.
        tp = ctx.tp_size
        super().__init__(hidden_size, [q_size * tp, kv_size * tp, kv_size * tp], bias, ctx, dtype)

    def load_part(self, name: str, part: int, tensor: Weight, is_bias: bool = False) -> None:
        if part == 0 or self.kv_replicas == 1:
            super().load_part(name, part, tensor, is_bias)
            return
        size = self.local_sizes[part]
        full = (size * self.ctx.tp_size // self.kv_replicas, *self.weight.shape[1:])
        _check_full_shape(name, tensor, full[:1] if is_bias else full)
        kv_head = self.ctx.tp_rank // self.kv_replicas
        self._store_part(name, part, narrow_rows(tensor, kv_head * size, size), is_bias)


class RowParallelLinear(_PackedLinear):
    """y = all_reduce(x_shard W_shard^T) + b, with W's columns (input features) split across TP ranks."""

    def __init__(self, in_features: int, out_features: int, bias: bool, ctx: ParallelContext,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.ctx = ctx
        self.in_local = divide(in_features, ctx.tp_size, "input features")
        self.weight = nn.Parameter(torch.empty(out_features, self.in_local, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ctx.all_reduce(self._matmul(x, None))
        return y + self.bias if self.bias is not None else y

    def load_full(self, name: str, tensor: Weight, is_bias: bool = False) -> None:
        if is_bias:
            _copy_checked(self.bias, tensor, name)
            return
        _check_full_shape(name, tensor, (self.weight.shape[0], self.in_local * self.ctx.tp_size))
        start = self.ctx.tp_rank * self.in_local
        if isinstance(tensor, QUANT_MATRICES):
            # A shard must hold whole blocks (groups) of every row (QuantSplitError names the tensor and the type).
            self._keep_quant(0, tensor.narrow_cols(start, self.in_local, f"{name} at --tp-size {self.ctx.tp_size}"))
            return
        _copy_checked(self.weight, tensor.narrow(1, start, self.in_local), name)
