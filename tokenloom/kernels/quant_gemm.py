"""GGUF-quantized weights kept quantized: the `QuantMatrix` every loader and layer exchanges, and the
operations on it (matmul, row lookup, dequantize).

A `QuantMatrix` is a [rows, cols] weight whose every row is a run of GGUF blocks of one type, in the file's
byte layout (`data`: uint8 [rows, row_bytes]). Rows are independent, so a tensor-parallel shard of output
features is a row range, a shard of input features is a column range on block boundaries, and merged
projections (QKV, gate/up) concatenate rows of the same type. `prepare` may re-lay the bytes out for the
kernel (same byte count, same information: memory stays the file's size); after that the matrix is
read-only and cannot be sliced.

Supported types: Q4_0, Q4_1, Q8_0 (32-element blocks) and Q4_K, Q5_K, Q6_K (256-element super-blocks): the
types of llama.cpp's Q4_0 / Q4_1 / Q8_0 / Q4_K_M / Q5_K_M files. Any other type is a `QuantTypeError` that
names the tensor and the type.

This module holds the reference implementation (dequantize with the `gguf` package, then a float32 matmul);
the native kernels in csrc/ replace it where they are built.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# GGUF type id -> (name, elements per block, bytes per block): gguf.constants.GGML_QUANT_SIZES.
QUANT_TYPES: dict[int, tuple[str, int, int]] = {
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    8: ("Q8_0", 32, 34),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
}
TYPE_IDS = {name: tid for tid, (name, _, _) in QUANT_TYPES.items()}


class QuantTypeError(ValueError):
    """A tensor's quantization type is not one tokenloom keeps quantized, or its bytes do not fit its shape."""


class QuantSplitError(ValueError):
    """A tensor-parallel split would cut a quantization block."""


def type_name(qtype: int) -> str:
    return QUANT_TYPES[qtype][0] if qtype in QUANT_TYPES else f"type {qtype}"


@dataclass(eq=False)
class QuantMatrix:
    """A [rows, cols] weight of GGUF type `qtype`; `data` uint8 [rows, row_bytes] (see the module docstring).
    `packed` is True once `prepare` has re-laid it out for the kernel (then it is read-only)."""

    qtype: int
    rows: int
    cols: int
    data: torch.Tensor
    packed: bool = False

    def __post_init__(self) -> None:
        if self.qtype not in QUANT_TYPES:
            raise QuantTypeError(f"unsupported quantization type {type_name(self.qtype)}; tokenloom keeps "
                                 f"{', '.join(n for n, _, _ in QUANT_TYPES.values())} quantized")
        _, block, size = QUANT_TYPES[self.qtype]
        if self.cols % block:
            raise QuantTypeError(f"{self.name}: {self.cols} columns are not whole {block}-element blocks")
        expected = (self.rows, self.cols // block * size)
        if self.data.dtype != torch.uint8 or tuple(self.data.shape) != expected:
            raise QuantTypeError(f"{self.name}: data {self.data.dtype} {tuple(self.data.shape)} != uint8 "
                                 f"{expected} for [{self.rows}, {self.cols}]")

    @property
    def name(self) -> str:
        return type_name(self.qtype)

    @property
    def block(self) -> int:
        return QUANT_TYPES[self.qtype][1]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    @classmethod
    def from_gguf(cls, qtype: int, shape: tuple[int, int], raw: np.ndarray | torch.Tensor,
                  tensor_name: str = "") -> QuantMatrix:
        """From a GGUF tensor's raw bytes (any shape holding rows x row_bytes bytes) and its HF shape
        [rows, cols]. Errors name `tensor_name`."""
        data = torch.from_numpy(np.ascontiguousarray(raw)) if isinstance(raw, np.ndarray) else raw
        if qtype not in QUANT_TYPES:
            raise QuantTypeError(f"{tensor_name}: unsupported quantization type {type_name(qtype)}")
        rows, cols = shape
        _, block, size = QUANT_TYPES[qtype]
        if cols % block or data.numel() != rows * (cols // block) * size:
            raise QuantTypeError(f"{tensor_name}: {type_name(qtype)} data of {data.numel()} bytes does not fit "
                                 f"shape [{rows}, {cols}] ({block}-element blocks of {size} bytes)")
        return cls(qtype, rows, cols, data.reshape(rows, -1).view(torch.uint8).clone())

    def _check_unpacked(self) -> None:
        if self.packed:
            raise RuntimeError("a prepared QuantMatrix cannot be sliced or joined")

    def narrow_rows(self, start: int, length: int) -> QuantMatrix:
        self._check_unpacked()
        return QuantMatrix(self.qtype, length, self.cols, self.data.narrow(0, start, length).contiguous())

    def narrow_cols(self, start: int, length: int, what: str = "") -> QuantMatrix:
        """Columns [start, start + length): both must fall on block boundaries (QuantSplitError otherwise)."""
        self._check_unpacked()
        _, block, size = QUANT_TYPES[self.qtype]
        if start % block or length % block:
            raise QuantSplitError(f"{what or 'tensor'}: splitting its {self.cols} input features at {start} "
                                  f"(+{length}) cuts a {self.name} block of {block} elements; choose a "
                                  f"tp-size that divides {self.cols // block} blocks, or dequantize it "
                                  f"(--quantization none)")
        data = self.data.narrow(1, start // block * size, length // block * size).contiguous()
        return QuantMatrix(self.qtype, self.rows, length, data)

    @staticmethod
    def cat_rows(parts: list[QuantMatrix]) -> QuantMatrix:
        """Row concatenation of matrices of one type and width."""
        first = parts[0]
        for p in parts:
            p._check_unpacked()
            if p.qtype != first.qtype or p.cols != first.cols:
                raise QuantTypeError(f"cannot join {p.name} [{p.rows}, {p.cols}] to {first.name} rows of "
                                     f"width {first.cols}")
        return QuantMatrix(first.qtype, sum(p.rows for p in parts), first.cols,
                           torch.cat([p.data for p in parts], 0))

    def permute_rows(self, order: torch.Tensor) -> QuantMatrix:
        """Rows reordered (`order[i]` is the source row of row i): llama.cpp's Q/K permutation undone."""
        self._check_unpacked()
        return QuantMatrix(self.qtype, self.rows, self.cols, self.data.index_select(0, order).contiguous())


def dequantize(qm: QuantMatrix) -> torch.Tensor:
    """float32 [rows, cols]: the `gguf` package's dequantize of the file-layout bytes (the reference)."""
    import gguf

    if qm.packed:
        raise RuntimeError("dequantize of a prepared QuantMatrix goes through the kernel")
    values = gguf.quants.dequantize(qm.data.numpy(), gguf.GGMLQuantizationType(qm.qtype))
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(qm.rows, qm.cols)


def prepare(qm: QuantMatrix) -> QuantMatrix:
    """The matrix as the kernel wants it (may re-lay out bytes; same size). Reference: unchanged."""
    return qm


def linear(x: torch.Tensor, qm: QuantMatrix, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [..., cols] @ W.T (+ bias) -> [..., rows] in `out_dtype` (default x's dtype). float32 sums."""
    out = torch.nn.functional.linear(x.float(), dequantize(qm), None if bias is None else bias.float())
    return out.to(out_dtype or x.dtype)


def embedding(ids: torch.Tensor, qm: QuantMatrix, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` of W, dequantized, in `dtype`: [*ids.shape, cols]."""
    rows = qm.narrow_rows(0, qm.rows) if not qm.packed else qm
    return torch.nn.functional.embedding(ids, dequantize(rows)).to(dtype)
