"""A linear layer's weight kept quantized: its local output rows as runs of `QuantMatrix` segments.

A GGUF file quantizes each tensor on its own, so the parts of a merged projection may have different types
(llama.cpp's Q4_K_M keeps attn_v in Q6_K beside Q4_K attn_q/attn_k). `QuantWeight` holds one segment per run
of consecutive parts of one type (the parts joined with `cat_rows`) and runs one `quant_gemm.linear` per
segment, writing each segment's output into its slice of the output features. A part the file stores as
floats (F16/F32) inside an otherwise quantized layer is a float segment in the model dtype. A Hugging Face
checkpoint's integer weights (GPTQ/AWQ, --torchao-config, w8a8_int8: `IntQuantMatrix`, layers/int_quant.py)
are segments of the same kind: `prepare` turns them into GGUF blocks where the native kernels take them
(`IntQuantMatrix.as_gguf_blocks`; an act-order weight's segment then gathers its input features in the
blocks' order, `in_perm`), else they run torch's kernels through their own `linear`.

Invariants: segments cover the local rows [0, rows) in order without gaps; once `prepare`d, the matrices
are the kernel's (read-only); the layer keeps no float copy of a quantized part (memory = the file's bytes).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from tokenloom.kernels import quant_gemm
from tokenloom.kernels.quant_gemm import QuantMatrix
from tokenloom.layers.int_quant import IntQuantMatrix

Weight = QuantMatrix | IntQuantMatrix | torch.Tensor
QUANT_MATRICES = (QuantMatrix, IntQuantMatrix)  # the quantized kinds a layer keeps (a GGUF's, an HF model's)


@dataclass(eq=False)
class QuantSegment:
    start: int  # first local output row
    weight: Weight  # a QuantMatrix, or float rows [n, cols] in the model dtype
    # GGUF blocks of an act-order (GPTQ desc_act) weight: its columns are the input features in this order
    in_perm: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        return self.weight.shape[0]


@dataclass(eq=False)
class QuantWeight:
    segments: list[QuantSegment]
    part_types: list[str] = field(default_factory=list)  # the file type of each part (for the load summary)
    quant_types: list[str] = field(default_factory=list)  # the types of its quantized parts (as loaded)

    @property
    def rows(self) -> int:
        return sum(s.rows for s in self.segments)

    @classmethod
    def from_parts(cls, parts: list[Weight]) -> QuantWeight:
        """`parts`: the layer's local parts in row order (QuantMatrix or float rows)."""
        segments: list[QuantSegment] = []
        run: list[Weight] = []
        start = row = 0
        for part in [*parts, None]:
            if run and (part is None or not _same_kind(run[0], part)):
                joined = run[0] if len(run) == 1 else type(run[0]).cat_rows(run) \
                    if isinstance(run[0], QUANT_MATRICES) else torch.cat(run, 0)
                segments.append(QuantSegment(start, joined))
                start, run = row, []
            if part is not None:
                run.append(part)
                row += part.shape[0]
        types = [p.name if isinstance(p, QUANT_MATRICES) else str(p.dtype).removeprefix("torch.") for p in parts]
        return cls(segments, types, [p.name for p in parts if isinstance(p, QUANT_MATRICES)])

    def prepare(self, dtype: torch.dtype, what: str = "") -> None:
        """Each quantized segment in its kernel's form (`dtype`: the activations', for integer weights)."""
        for seg in self.segments:
            if isinstance(seg.weight, QuantMatrix):
                seg.weight = quant_gemm.prepare(seg.weight)
            elif isinstance(seg.weight, IntQuantMatrix):
                blocks = seg.weight.as_gguf_blocks(dtype)  # the native kernels' form where they take it
                if blocks is None:
                    seg.weight = seg.weight.prepare(dtype, what)  # (its own linear gathers an act-order input)
                else:
                    seg.in_perm, seg.weight = seg.weight.in_perm, quant_gemm.prepare(blocks)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
        """x [..., cols] -> [..., rows] in `out_dtype`, each segment's output in its slice."""
        if len(self.segments) == 1:
            return _segment_linear(x, self.segments[0], bias, out_dtype)
        out = torch.empty(*x.shape[:-1], self.rows, dtype=out_dtype, device=x.device)
        for seg in self.segments:
            b = None if bias is None else bias.narrow(0, seg.start, seg.rows)
            out[..., seg.start: seg.start + seg.rows] = _segment_linear(x, seg, b, out_dtype)
        return out


def _same_kind(a: Weight, b: Weight) -> bool:
    if isinstance(a, QuantMatrix) and isinstance(b, QuantMatrix):
        return a.qtype == b.qtype
    if isinstance(a, IntQuantMatrix) and isinstance(b, IntQuantMatrix):
        return a.name == b.name and (a.zeros is None) == (b.zeros is None)
    return not isinstance(a, QUANT_MATRICES) and not isinstance(b, QUANT_MATRICES)


def _segment_linear(x: torch.Tensor, seg: QuantSegment, bias: torch.Tensor | None, out_dtype: torch.dtype
                    ) -> torch.Tensor:
    w = seg.weight
    if seg.in_perm is not None:
        x = x[..., seg.in_perm]  # (advanced indexing: 2x index_select's speed along the last dim here)
    if isinstance(w, QuantMatrix):
        return quant_gemm.linear(x, w, bias, out_dtype)
    if isinstance(w, IntQuantMatrix):
        return w.linear(x, bias, out_dtype)
    return F.linear(x.to(w.dtype), w, None if bias is None else bias.to(w.dtype)).to(out_dtype)


def narrow_rows(t: Weight, start: int, length: int) -> Weight:
    return t.narrow_rows(start, length) if isinstance(t, QUANT_MATRICES) else t.narrow(0, start, length)


def quantized_weights(model: nn.Module) -> tuple[int, Counter[str]]:
    """(parameters held quantized, file tensors kept quantized by type name) of `model`'s layers."""
    params, types = 0, Counter[str]()
    for module in model.modules():
        for value, counted in _held_values(module):
            if isinstance(value, QuantWeight):
                params += sum(s.weight.shape[0] * s.weight.shape[1] for s in value.segments
                              if isinstance(s.weight, QUANT_MATRICES))
                if counted:
                    types.update(value.quant_types)
            elif isinstance(value, QuantMatrix):
                params += value.rows * value.cols
                types[value.name] += counted
    return params, types


def _held_values(module: nn.Module):
    """(value, counted) for `module`'s attributes, the items of its lists and tuples among them: a MoE layer keeps
    one QuantWeight per expert in a list, cut from one file tensor per projection, so only a list's first item
    counts toward the file's tensors (`counted`)."""
    for value in vars(module).values():
        if isinstance(value, list | tuple):
            yield from ((item, i == 0) for i, item in enumerate(value))
        else:
            yield value, True


def format_types(types: Counter[str]) -> str:
    """Counter({"Q4_1": 210, "Q8_0": 1}) -> "Q4_1 x 210, Q8_0 x 1" (most first)."""
    return ", ".join(f"{name} x {n}" for name, n in types.most_common())
