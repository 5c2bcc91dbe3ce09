"""Integer weights of float (Hugging Face) checkpoints: `IntQuantMatrix`, int8 per output channel or int4 per
group of input features, run with torch's CPU weight-only kernels.

Where they come from: `--torchao-config int8wo | int4wo-<group>` quantizes a bf16/fp16 checkpoint's linear
weights at load (`quantize_int8_per_channel`, `quantize_int4_grouped`, torchao's formulas); GPTQ and AWQ
checkpoints arrive already quantized (models/prequant.py unpacks their int32 packing into the form below).
`--quantization w8a8_int8` quantizes the weights as int8wo does and also the activations: each row (token) of
x to int8 with its own scale max|x_row| / 127, an int8 x int8 -> int32 matmul (`torch._int_mm`, VNNI), then
y = acc * s_x[row] * s_w[col] in float32 (SGLang's w8a8_int8 scheme).

Form before `prepare` (sliceable, like `QuantMatrix`): `q` [rows, cols] integer codes (int8 for 8 bits: [-127,
127] from torchao's formula, [-128, 127] from an 8-bit GPTQ checkpoint; uint8 in [0, 15] for 4 bits), `scales`
and `zeros` float32 [rows, cols // group] (8 bits: one group per row, or GPTQ's groups); the weight is
    w[r, c] = (q[r, c] - zeros[r, c // group]) * scales[r, c // group]       (zeros None = symmetric, 0).
With bf16 / fp16 activations, where the native quantized kernels run (kernels/quant_gemm.py), the weight is
re-expressed in GGUF blocks instead (`as_gguf_blocks`, which layers/quant_linear.py's `QuantWeight.prepare`
prefers) and runs those kernels (the native decode step included): 4 bits as Q4_1, each 32-element block of a
group d = s and m = -z s in f16 (w = q d + m; GPTQ/AWQ scales are f16 already and stay exact, the minimum m is
rounded once to f16: at most 1/128 of the group's step, since |z| <= 16), or as Q4_0 where every zero point is
8 (symmetric GPTQ, AutoGPTQ's default: w = (q - 8) d, exact, 4.5 bits a weight), 8 bits weight-only as Q8_0
(d = the row's or group's scale in f16; an 8-bit GPTQ checkpoint's f16 scales stay exact). Against torch's
int4 op, whose scales and zero points are rounded to bf16 (8 bits of mantissa), this keeps 3 more bits and
runs the AVX-512 / AVX2 kernels (bench/hf_quant.py); it holds 5 bits a weight (Q4_1) or 4.5 (Q4_0) where a
group of 128 takes 4.25 (a GPTQ file: 1.17x / 1.06x its bytes). float32 activations keep torch's kernels,
whose float32 scales are exact.
`prepare(dtype)` packs for torch's kernels: 8 bits keeps `q` and per-row scales in `dtype`
(`aten._weight_int8pack_mm`); 4 bits packs `q` with `aten._convert_weight_to_int4pack_for_cpu` and folds the
zero points into torch's form w = (q - 8) * s + z' (`aten._weight_int4pack_mm_for_cpu`, scales_and_zeros
[groups, rows, 2] in `dtype`). `kernel_weight()` is that weight as float32 (the dequantized weight with scales
and zeros rounded to `dtype`): the exact reference the kernels are tested against. Forms no torch kernel takes
(8 bits in groups, 4 bits in one group a row: GPTQ checkpoints) stay as loaded and `linear` dequantizes them in
float32 on each call, rounded to `dtype` (exact in float32; slow, the path only where the GGUF blocks are not
used).

Invariants: a prepared matrix is read-only and cannot be sliced; shards of input features fall on group
boundaries (QuantSplitError naming the tensor otherwise); 4-bit matrices need rows % 16 == 0 and an even
group (torch's int4pack layout), refused with the tensor's name otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenloom.kernels import quant_gemm
from tokenloom.kernels.quant_gemm import QuantMatrix, QuantSplitError, QuantTypeError

BLOCK = 32  # elements per Q4_0 / Q4_1 / Q8_0 block
Q4_0, Q4_1, Q8_0 = (quant_gemm.TYPE_IDS[name] for name in ("Q4_0", "Q4_1", "Q8_0"))
INT4_GROUPS = (32, 64, 128, 256)  # torchao int4wo's group sizes (and GPTQ/AWQ's usual ones)
# Above this many rows the int8 kernel (its time grows with the rows) loses to converting the weight to the
# activation dtype and one float matmul (2048x2048, 1 thread, CPU time: 8 rows 0.80 vs 1.56 ms, 12 rows 1.20 vs
# 1.33, 16 rows 1.59 vs 1.40, 32 rows 3.0 vs 1.5).
INT8PACK_MAX_ROWS = 12


@dataclass(eq=False)
class IntQuantMatrix:
    """A [rows, cols] integer weight (see the module docstring). `name`: what the load summary calls it."""

    bits: int
    group: int
    q: torch.Tensor
    scales: torch.Tensor | None
    zeros: torch.Tensor | None
    name: str
    rows: int = 0
    cols: int = 0
    packed: bool = False
    sz: torch.Tensor | None = None  # prepared 4 bits: scales_and_zeros [groups, rows, 2]
    dtype: torch.dtype | None = None  # prepared: the activation dtype the kernels take
    act_quant: bool = False  # w8a8_int8: activations quantized per row to int8 too
    # act-order (GPTQ desc_act): the columns are the input features in this order (x[..., in_perm] meets them)
    in_perm: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if not self.packed:
            self.rows, self.cols = self.q.shape
            groups = self.cols // self.group if self.group else 0
            if self.bits not in (4, 8) or not self.group or self.cols % self.group:
                raise QuantTypeError(f"{self.name}: {self.bits} bits in groups of {self.group} do not fit "
                                     f"{self.cols} input features")
            if self.scales is None or tuple(self.scales.shape) != (self.rows, groups):
                raise QuantTypeError(f"{self.name}: scales must be [{self.rows}, {groups}]")

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    def _check_unpacked(self) -> None:
        if self.packed:
            raise RuntimeError("a prepared IntQuantMatrix cannot be sliced or joined")

    def _with(self, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
              group: int | None = None) -> IntQuantMatrix:
        return IntQuantMatrix(self.bits, group or self.group, q, scales, zeros, self.name, act_quant=self.act_quant,
                              in_perm=self.in_perm)

    def narrow_rows(self, start: int, length: int) -> IntQuantMatrix:
        self._check_unpacked()
        z = None if self.zeros is None else self.zeros.narrow(0, start, length)
        return self._with(self.q.narrow(0, start, length), self.scales.narrow(0, start, length), z)

    def narrow_cols(self, start: int, length: int, what: str = "") -> IntQuantMatrix:
        """Input features [start, start + length), on group boundaries (QuantSplitError otherwise)."""
        self._check_unpacked()
        if self.in_perm is not None and (start, length) != (0, self.cols):
            raise QuantSplitError(f"{what or 'tensor'}: an act-order (desc_act) layer's groups gather input "
                                  f"features from all over its {self.cols}; its input features cannot be split "
                                  "across tensor-parallel ranks (use --tp-size 1, or a desc_act false checkpoint)")
        if self.group == self.cols:  # one group a row (per channel): any split keeps each row's scale and zero
            return self._with(self.q.narrow(1, start, length), self.scales, self.zeros, group=length)
        if start % self.group or length % self.group:
            raise QuantSplitError(f"{what or 'tensor'}: splitting its {self.cols} input features at {start} "
                                  f"(+{length}) cuts a {self.name} group of {self.group}; choose a tp-size that "
                                  f"divides its {self.cols // self.group} groups")
        g0, gn = start // self.group, length // self.group
        z = None if self.zeros is None else self.zeros.narrow(1, g0, gn)
        return self._with(self.q.narrow(1, start, length), self.scales.narrow(1, g0, gn), z)

    @staticmethod
    def cat_rows(parts: list[IntQuantMatrix]) -> IntQuantMatrix:
        first = parts[0]
        for p in parts:
            p._check_unpacked()
            if p.name != first.name or p.cols != first.cols or (p.zeros is None) != (first.zeros is None):
                raise QuantTypeError(f"cannot join {p.name} [{p.rows}, {p.cols}] to {first.name} rows of "
                                     f"width {first.cols}")
            if (p.in_perm is None) != (first.in_perm is None) or (
                    p.in_perm is not None and not torch.equal(p.in_perm, first.in_perm)):
                raise QuantTypeError(f"cannot join {p.name} rows whose act-order (g_idx) differs from the rows "
                                     "beside them in one merged projection")
        zeros = None if first.zeros is None else torch.cat([p.zeros for p in parts])
        return first._with(torch.cat([p.q for p in parts]), torch.cat([p.scales for p in parts]), zeros)

    def dequantize(self) -> torch.Tensor:
        """float32 [rows, cols]: (q - zeros) * scales, unrounded (before `prepare`), in the input features'
        own order."""
        self._check_unpacked()
        return self._unpermuted(self._dequantized_columns())

    def _dequantized_columns(self) -> torch.Tensor:
        """float32 [rows, cols]: (q - zeros) * scales with the columns in this matrix's order (in_perm's)."""
        q = self.q.float().view(self.rows, -1, self.group)
        z = 0.0 if self.zeros is None else self.zeros.unsqueeze(-1)
        return ((q - z) * self.scales.unsqueeze(-1)).reshape(self.rows, self.cols)

    def _no_torch_kernel(self) -> bool:
        """Weight-only forms no torch CPU kernel takes: 8 bits in groups (torch's int8 op has one scale a row),
        4 bits in groups other than INT4_GROUPS (GPTQ's group_size -1: one group a row). `prepare` keeps these
        as they are and `linear` dequantizes them on each call."""
        if self.act_quant:
            return False
        return self.group != self.cols if self.bits == 8 else self.group not in INT4_GROUPS

    def _unpermuted(self, w: torch.Tensor) -> torch.Tensor:
        """Columns in `in_perm` order -> the input features' own order."""
        if self.in_perm is None:
            return w
        out = torch.empty_like(w)
        out[:, self.in_perm] = w
        return out

    def as_gguf_blocks(self, dtype: torch.dtype) -> QuantMatrix | None:
        """This weight as GGUF blocks for activations of `dtype` where the native quantized kernels run them (see
        the module docstring: 4 bits -> Q4_0 when every zero point is 8, else Q4_1; 8 bits weight-only -> Q8_0),
        else None (float32 activations, w8a8_int8, widths that are not whole 32-element blocks, scales f16
        cannot hold)."""
        self._check_unpacked()
        if dtype == torch.float32 or self.act_quant or self.cols % BLOCK or self.group % BLOCK:
            return None
        if self.bits == 8 and self.zeros is not None:
            return None
        symmetric = self.bits == 4 and self.zeros is not None and bool((self.zeros == 8).all())
        qtype = Q8_0 if self.bits == 8 else Q4_0 if symmetric else Q4_1
        if not quant_gemm.native_supported(qtype):
            return None
        nb = self.cols // BLOCK
        s = self.scales.double().repeat_interleave(self.group // BLOCK, dim=1)
        d = s.to(torch.float16)
        fields = [d]
        if qtype == Q4_1:
            z = 0.0 if self.zeros is None else self.zeros.double().repeat_interleave(self.group // BLOCK, dim=1)
            fields.append((-z * s).to(torch.float16))
        if not all(bool(torch.isfinite(f).all()) for f in fields) or bool(((d == 0) & (s != 0)).any()):
            return None  # a scale or minimum out of f16's range: torch's kernels keep the weight
        head = torch.stack(fields, -1).view(torch.uint8).view(self.rows, nb, 2 * len(fields))
        q = self.q.view(self.rows, nb, BLOCK)
        if self.bits == 4:  # Q4's 16 bytes: element j in the low nibble of byte j, element j + 16 in its high one
            codes = (q[..., :16] | (q[..., 16:] << 4)).to(torch.uint8)
        else:
            codes = q.to(torch.int8).view(torch.uint8)
        data = torch.cat([head, codes], -1).reshape(self.rows, -1)
        return QuantMatrix(qtype, self.rows, self.cols, data.contiguous())

    def _kernel_params(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(scales, z') rounded to `dtype` as the kernels hold them (z' only for 4 bits: w = (q - 8) s + z')."""
        if self.bits == 8:
            return self.scales.to(dtype), None
        z = torch.zeros_like(self.scales) if self.zeros is None else self.zeros
        return self.scales.to(dtype), ((8.0 - z) * self.scales).to(dtype)

    def kernel_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """float32 [rows, cols]: the weight the prepared kernels multiply by (the GGUF blocks' where
        `as_gguf_blocks` gives them, else torch's: scales and zeros in `dtype`)."""
        blocks = self.as_gguf_blocks(dtype)
        if blocks is not None:
            return self._unpermuted(quant_gemm.dequantize(blocks))
        if self._no_torch_kernel():
            return self.dequantize().to(dtype).float()
        s, zp = self._kernel_params(dtype)
        if self.bits == 8:
            w = self.q.float().view(self.rows, -1, self.group) * (self.scales if self.act_quant else s.float()
                                                                   ).unsqueeze(-1)
            return self._unpermuted(w.reshape(self.rows, self.cols))
        q = self.q.float().view(self.rows, -1, self.group)
        w = (q - 8.0) * s.float().unsqueeze(-1) + zp.float().unsqueeze(-1)
        return self._unpermuted(w.reshape(self.rows, self.cols))

    def prepare(self, dtype: torch.dtype, what: str = "") -> IntQuantMatrix:
        """The kernel's form for activations of `dtype` (a new, read-only matrix)."""
        self._check_unpacked()
        if self._no_torch_kernel():
            return IntQuantMatrix(self.bits, self.group, self.q.contiguous(), self.scales, self.zeros, self.name,
                                  self.rows, self.cols, packed=True, dtype=dtype, in_perm=self.in_perm)
        if self.bits == 8:
            if self.zeros is not None or self.act_quant and self.group != self.cols:
                raise QuantTypeError(f"{what or self.name}: 8-bit weights must be symmetric (w8a8_int8: one "
                                     "scale per row)")
            # w8a8 keeps float32 weight scales: they multiply the int32 sums in float32.
            s = self.scales[:, 0].contiguous() if self.act_quant else self._kernel_params(dtype)[0][:, 0].contiguous()
            return IntQuantMatrix(8, self.group, self.q.to(torch.int8).contiguous(), s, None, self.name,
                                  self.rows, self.cols, packed=True, dtype=dtype, act_quant=self.act_quant,
                                  in_perm=self.in_perm)
        if self.rows % 16 or self.group % 2:
            raise QuantTypeError(f"{what or self.name}: {self.rows} output rows; torch's int4 CPU kernel needs a "
                                 f"multiple of 16 (use --torchao-config int8wo, or no quantization)")
        s, zp = self._kernel_params(dtype)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(self.q.to(torch.int32).contiguous(), 8)
        sz = torch.stack([s, zp], -1).transpose(0, 1).contiguous()
        return IntQuantMatrix(4, self.group, packed, None, None, self.name, self.rows, self.cols,
                              packed=True, sz=sz, dtype=dtype, in_perm=self.in_perm)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.scales, self.zeros, self.sz)
                   if t is not None)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
        """x [..., cols] -> [..., rows] in `out_dtype` (prepared matrices only)."""
        if not self.packed:
            raise RuntimeError(f"{self.name}: linear() needs a prepared matrix")
        if self.act_quant:
            return self._linear_w8a8(x, bias, out_dtype)
        x2 = x.reshape(-1, self.cols)
        if self.in_perm is not None:
            x2 = x2[:, self.in_perm]
        x2 = x2.to(self.dtype).contiguous()
        if self._no_torch_kernel():  # the weight dequantized in float32 and rounded to the activations' dtype
            y = F.linear(x2, self._dequantized_columns().to(self.dtype))
        elif self.bits == 8:
            if x2.shape[0] <= INT8PACK_MAX_ROWS:
                y = torch.ops.aten._weight_int8pack_mm(x2, self.q, self.scales)
            else:
                y = F.linear(x2, self.q.to(self.dtype)) * self.scales
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.q, self.group, self.sz)
        if bias is not None:
            y = y + bias.to(y.dtype)
        return y.to(out_dtype).view(*x.shape[:-1], self.rows)

    def _linear_w8a8(self, x: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
        xq, sx = quantize_rows_int8(x.reshape(-1, self.cols))
        # q [rows, cols] seen as [cols, rows]: torch's CPU _int_mm is fastest on this transposed view (measured
        # 1x2048x2048: 1.6 ms vs 3.5 ms for a contiguous [cols, rows] copy, under load).
        y = torch._int_mm(xq, self.q.t()).float() * sx * self.scales
        if bias is not None:
            y = y + bias.float()
        return y.to(out_dtype).view(*x.shape[:-1], self.rows)


def quantize_rows_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int8 of x [m, k]: (q int8 [m, k], scales float32 [m, 1]), x ~ q * s."""
    xf = x.float()
    s = (xf.abs().amax(1, keepdim=True) / 127.0).clamp(min=torch.finfo(torch.float32).tiny)
    return torch.round(xf / s).to(torch.int8), s


def quantize_int8_per_channel(w: torch.Tensor, name: str = "int8wo") -> IntQuantMatrix:
    """Symmetric int8, one scale per output row: s = max|w| / 127, q = round(w / s) (torchao's int8wo)."""
    q, scales = quantize_rows_int8(w)
    return IntQuantMatrix(8, w.shape[1], q, scales, None, name, act_quant=name == "w8a8_int8")


def quantize_int4_grouped(w: torch.Tensor, group: int, what: str = "") -> IntQuantMatrix:
    """Asymmetric int4 per group of `group` input features: s = (max - min) / 15, q = round((w - min) / s),
    zero point -min / s (torchao's int4wo: min-max affine, the zero point kept as a float)."""
    rows, cols = w.shape
    if group not in INT4_GROUPS or cols % group:
        raise QuantTypeError(f"{what}: {cols} input features are not whole groups of {group} (int4wo-{group}); "
                             f"choose a group in {INT4_GROUPS} that divides them")
    wg = w.float().view(rows, cols // group, group)
    lo, hi = wg.amin(-1), wg.amax(-1)
    scales = ((hi - lo) / 15.0).clamp(min=1e-6)
    q = torch.round((wg - lo.unsqueeze(-1)) / scales.unsqueeze(-1)).clamp(0, 15).to(torch.uint8)
    return IntQuantMatrix(4, group, q.view(rows, cols), scales, -lo / scales, f"int4wo-{group}")


def quantize_for_method(w: torch.Tensor, method: str, what: str = "") -> IntQuantMatrix:
    """`--torchao-config` value or w8a8_int8 -> the quantized weight (`what`: the tensor, for errors)."""
    if method in ("int8wo", "w8a8_int8"):
        return quantize_int8_per_channel(w, method)
    if method.startswith("int4wo-"):
        return quantize_int4_grouped(w, int(method.removeprefix("int4wo-")), what)
    raise QuantTypeError(f"{what}: unknown weight quantization {method!r}")
