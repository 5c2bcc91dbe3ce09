"""GGUF-quantized weights kept quantized: the `QuantMatrix` every loader and layer exchanges, and the
operations on it (matmul, row lookup, dequantize).

A `QuantMatrix` is a [rows, cols] weight whose every row is a run of GGUF blocks of one type, in the file's
byte layout (`data`: uint8 [rows, row_bytes]). Rows are independent, so a tensor-parallel shard of output
features is a row range, a shard of input features is a column range on block boundaries, and merged
projections (QKV, gate/up) concatenate rows of the same type. `prepare` may re-lay the bytes out for the
kernel (same byte count, same information: memory stays the file's size); after that the matrix is
read-only and cannot be sliced.

Supported types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (32-element blocks) and Q4_K, Q5_K, Q6_K (256-element
super-blocks): the types of llama.cpp's Q4_0 / Q4_1 / Q8_0 / Q4_K_M / Q5_K_M files (in these, llama-quantize
writes Q5_0 / Q5_1 for the tensors whose rows are not whole super-blocks). Any other type is a `QuantTypeError`
that names the tensor and the type.

The operations run the native kernels (csrc/quant_gemm.c and its per-type families) where the library builds
and has the type; elsewhere the reference implementation (dequantize with the `gguf` package, then a float32
matmul). Native numerics: a few rows of bf16 x (decode), and where AMX does not run any number of rows of
bf16 x on the types with 32-column scales (all but Q6_K), are quantized to int8 per 32-element block (two
terms: the second is the first one's remainder) and multiplied by the quantized weight in integers (error per
output <= sum_i |w_i| * d_x(i) / 256, d_x = the block's max|x| / 127); the other cases (more rows where AMX
runs, Q6_K, every float32 x) multiply the exactly dequantized weight (rounded once to bf16 for bf16 x, as a
bf16 copy of the GGUF would be; exact for float32 x) with float32 sums. csrc/quant_gemm.c's `quant_path`
says which path a call takes. On x86 CPUs with AVX2 but without those AVX-512 families (`native_isa() == 1`:
AMD Zen 2/3, Intel client cores) csrc/quant_avx2.c runs instead: each type re-laid out once by `prepare`
(in a lane order: csrc/kquant_avx2.c, csrc/legacy_avx2.c; the file's size but for Q4_K / Q5_K, whose
scales it unpacks: 2.8% / 2.3% more), bf16 x below
quant_tile_m rows through the same two int8 terms (same bound), float32 x and more rows on the exact weight;
its Q5_0 / Q5_1 are the Q4 types' lane order plus a word of fifth bits per 32 quants (csrc/legacy_avx2.c). A
type a build lacks takes the reference (the loader then dequantizes such a file at load unless --quantization
gguf is given).
`native_args(qm)` gives the C side (type, data pointer, rows, cols) of a prepared matrix for native callers.
"""

from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass

import numpy as np
import torch

from tokenloom.kernels.cpu_build import load_library

# GGUF type id -> (name, elements per block, bytes per block): gguf.constants.GGML_QUANT_SIZES.
QUANT_TYPES: dict[int, tuple[str, int, int]] = {
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
}
TYPE_IDS = {name: tid for tid, (name, _, _) in QUANT_TYPES.items()}
# Byte offsets of each type's f16 fields in a block (d, and m / dmin where the type has one): ggml's block
# structs. Every other field is an integer whose every value is valid.
F16_FIELDS: dict[int, tuple[int, ...]] = {2: (0,), 3: (0, 2), 6: (0,), 7: (0, 2), 8: (0,), 12: (0, 2), 13: (0, 2),
                                          14: (208,)}


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
        if self.packed and self.data.dtype == torch.uint8 and self.data.dim() == 2 \
                and self.data.shape[0] == self.rows and self.data.shape[1] >= expected[1]:
            return  # re-laid out: the file's row bytes or more (prepare)
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
        data = data.reshape(rows, -1).view(torch.uint8).clone()
        check_block_scales(qtype, data, tensor_name)
        return cls(qtype, rows, cols, data)

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



def check_block_scales(qtype: int, data: torch.Tensor, tensor_name: str = "") -> None:
    """Refuse file-layout blocks (uint8 [rows, row_bytes]) with a NaN or infinite f16 scale or minimum (an f16
    whose exponent bits are all ones): the kernels would turn them into NaN outputs. A `QuantTypeError` that names
    the tensor, the type, the first such block and its row."""
    size = QUANT_TYPES[qtype][2]
    blocks = data.reshape(-1, size)
    for offset in F16_FIELDS[qtype]:
        bits = blocks[:, offset:offset + 2].contiguous().view(torch.int16).reshape(-1)
        bad = (bits & 0x7C00) == 0x7C00
        if bool(bad.any()):
            first = int(bad.nonzero()[0, 0])
            per_row = blocks.shape[0] // max(1, data.shape[0])
            raise QuantTypeError(
                f"{tensor_name}: malformed {type_name(qtype)} block {first} (row {first // max(1, per_row)}): its f16 "
                f"field at byte {offset} is {int(bits[first]) & 0xFFFF:#06x}, not a finite number (NaN or Inf); the "
                f"file is corrupt or was written wrong")


# csrc/quant_gemm.c's return codes
_ERRORS = {-1: "type not built", -2: "shape not whole blocks or rows too long", -3: "row index out of range",
           -4: "out of memory"}


@functools.cache
def _native() -> ctypes.CDLL | None:
    """The kernel library when it has the quantized-matmul driver, else None."""
    lib = load_library("kernels")
    if lib is None or not hasattr(lib, "quant_linear"):
        return None
    # declared argument types: a call converts plain ints (a decode step makes hundreds of calls)
    i32, i64, ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
    lib.quant_linear.argtypes = [i32, ptr, i64, i64, ptr, i64, i32, i64, ptr, i32, ptr, i64, i32, i32]
    lib.quant_dequant_rows.argtypes = [i32, ptr, i64, i64, ptr, i64, ptr, i32, i32]
    lib.quant_repack.argtypes = [i32, ptr, i64, i64]
    lib.quant_packed_bytes.argtypes = [i32, i64, i64]
    lib.quant_packed_bytes.restype = i64
    lib.quant_path.argtypes = [i32, i64, i64, i32]
    lib.quant_moe.argtypes = [i64, i64, i64, ptr, i64, ptr, ptr, i64, ptr, ptr, ptr, ptr, ptr, ptr, i32]
    lib.moe_route_bf16.argtypes = [ptr, i64, i64, i64, ptr, i64, i32, i32, ptr, ptr, i32]
    prefetch = os.environ.get("TOKENLOOM_QUANT_PREFETCH")  # the small-row kernels' prefetch distance (A/B runs)
    if prefetch is not None:
        lib.quant_prefetch(ctypes.c_int(int(prefetch)))
    prefetch_l2 = os.environ.get("TOKENLOOM_QUANT_PREFETCH_L2")  # 1: the prefetch fills L2, 0: L1 (A/B runs)
    if prefetch_l2 is not None:
        lib.quant_prefetch_l2(ctypes.c_int(int(prefetch_l2)))
    batch_terms = os.environ.get("TOKENLOOM_QUANT_BATCH_TERMS")  # the many-row path's int8 terms, 1 or 2 (A/B runs)
    if batch_terms is not None:
        lib.quant_batch_residual(ctypes.c_int(int(batch_terms) == 2))
    seq_m = os.environ.get("TOKENLOOM_QUANT_SEQ_M")  # rows up to which the row-sequential stream runs (A/B runs)
    if seq_m is not None:
        lib.quant_seq_m(ctypes.c_int(int(seq_m)))
    tile_m = os.environ.get("TOKENLOOM_QUANT_TILE_M")  # rows from which the bf16 tile replaces the int8 path (A/B runs)
    if tile_m is not None:
        lib.quant_tile_m(ctypes.c_int(int(tile_m)))
    i8_tile_m = os.environ.get("TOKENLOOM_QUANT_I8_TILE_M")  # AVX2: rows from which the one-term int8 tile runs
    if i8_tile_m is not None:
        lib.quant_i8_tile_m(ctypes.c_int(int(i8_tile_m)))
    return lib


@functools.cache
def native_isa() -> int:
    """The native kernel family this machine runs (csrc/quant_gemm.c's quant_isa): 2 the AVX-512 families (every
    path, the fused MoE call), 1 the AVX2 one (csrc/quant_avx2.c: int8 terms for bf16 x below quant_tile_m
    rows, float32 tiles from there, no fused MoE call), 0 none (the reference)."""
    lib = _native()
    return 0 if lib is None else int(lib.quant_isa())


def native_moe_supported() -> bool:
    """Whether the fused MoE call (`moe_experts`) runs here: either native family (the AVX2 one expert by expert,
    csrc/quant_moe.c)."""
    return native_isa() >= 1


@functools.cache
def native_supported(qtype: int) -> bool:
    """Whether the native kernels handle `qtype` on this machine (else the reference runs)."""
    lib = _native()
    return lib is not None and bool(lib.quant_type_supported(ctypes.c_int(qtype)))


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what}: native quantized kernel failed ({_ERRORS.get(rc, rc)})")


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def native_args(qm: QuantMatrix) -> tuple[int, int, int, int]:
    """(GGUF type id, data address, rows, cols) of a prepared matrix: what csrc/quant_gemm.c's entry points
    take as (type, w, n, k). The matrix must stay alive while the address is used."""
    if not qm.packed:
        raise ValueError(f"{qm.name} [{qm.rows}, {qm.cols}]: native callers need a prepared QuantMatrix")
    return qm.qtype, qm.data.data_ptr(), qm.rows, qm.cols


def dequantize(qm: QuantMatrix) -> torch.Tensor:
    """float32 [rows, cols]: the `gguf` package's dequantize of the file-layout bytes (the reference), or for a
    prepared matrix the native kernel's (bit-identical)."""
    if qm.packed:
        out = torch.empty(qm.rows, qm.cols, dtype=torch.float32)
        _check(_native().quant_dequant_rows(qm.qtype, _ptr(qm.data), qm.rows, qm.cols, None, qm.rows, _ptr(out), 0,
                                            torch.get_num_threads()), f"dequantize {qm.name}")
        return out
    return _reference_dequantize(qm.data, qm.qtype, qm.rows, qm.cols)


def _reference_dequantize(data: torch.Tensor, qtype: int, rows: int, cols: int) -> torch.Tensor:
    import gguf

    values = gguf.quants.dequantize(data.numpy(), gguf.GGMLQuantizationType(qtype))
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(rows, cols)


def prepare(qm: QuantMatrix) -> QuantMatrix:
    """The matrix as the kernel wants it: a re-laid-out copy (`packed`; the file's size, but for the AVX2
    family's Q4_K / Q5_K: 2.8% / 2.3% more, their 6-bit scales unpacked to bytes) where the native kernels
    handle the type, else `qm` unchanged (the reference reads the file layout)."""
    if qm.packed or not native_supported(qm.qtype):
        return qm
    where = f"prepare {qm.name} [{qm.rows}, {qm.cols}]"
    size = _native().quant_packed_bytes(qm.qtype, qm.rows, qm.cols)
    if size < qm.nbytes:
        raise RuntimeError(f"{where}: the kernels take no {qm.name} matrix of this shape")
    data = torch.empty(size, dtype=torch.uint8)
    data[:qm.nbytes] = qm.data.reshape(-1)
    _check(_native().quant_repack(qm.qtype, _ptr(data), qm.rows, qm.cols), where)
    row_bytes = size // qm.rows if qm.rows else qm.data.shape[1]
    return QuantMatrix(qm.qtype, qm.rows, qm.cols, data.view(qm.rows, row_bytes), packed=True)


_NATIVE_DTYPES = (torch.bfloat16, torch.float32)


def linear(x: torch.Tensor, qm: QuantMatrix, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [..., cols] @ W.T (+ bias) -> [..., rows] in `out_dtype` (default x's dtype). float32 sums (see the
    module docstring for the native kernels' numerics). An unprepared matrix is prepared per call (a copy):
    prepare it once at load."""
    if x.shape[-1] != qm.cols:
        raise ValueError(f"linear: input features {x.shape[-1]} != {qm.name} weight [{qm.rows}, {qm.cols}]")
    if bias is not None and tuple(bias.shape) != (qm.rows,):
        raise ValueError(f"linear: bias {tuple(bias.shape)} != ({qm.rows},) of {qm.name} weight")
    out_dtype = out_dtype or x.dtype
    if not native_supported(qm.qtype) or x.device.type != "cpu" or x.dtype not in _NATIVE_DTYPES:
        # the reference (a prepared matrix dequantizes through the kernel, bit-identically)
        w = dequantize(qm).to(x.device)
        out = torch.nn.functional.linear(x.float(), w, None if bias is None else bias.float())
        return out.to(out_dtype)
    qm = prepare(qm)
    x2 = x.reshape(-1, qm.cols)
    if x2.stride(-1) != 1 or x2.stride(0) % 2:
        x2 = x2.contiguous()
    if bias is not None and (bias.dtype not in _NATIVE_DTYPES or not bias.is_contiguous()):
        bias = bias.float().contiguous()
    direct = out_dtype in _NATIVE_DTYPES
    out = torch.empty(x2.shape[0], qm.rows, dtype=out_dtype if direct else torch.float32)
    rc = _native().quant_linear(qm.qtype, _ptr(qm.data), qm.rows, qm.cols, _ptr(x2), x2.stride(0),
                                x2.dtype == torch.float32, x2.shape[0], _ptr(bias),
                                bias is not None and bias.dtype == torch.float32, _ptr(out), out.stride(0),
                                out.dtype == torch.float32, torch.get_num_threads())
    if rc:
        _check(rc, f"linear {qm.name} [{qm.rows}, {qm.cols}]")
    if x.dim() != 2:
        out = out.view(*x.shape[:-1], qm.rows)
    return out if direct else out.to(out_dtype)


def moe_experts(x: torch.Tensor, pair_token: torch.Tensor, pair_weight: torch.Tensor, group_start: torch.Tensor,
                gate_up: tuple[torch.Tensor, torch.Tensor], down: tuple[torch.Tensor, torch.Tensor], inter: int
                ) -> torch.Tensor:
    """An MoE layer's experts in one native call (csrc/quant_moe.c): x bf16 [T, H]; the (token, expert) pairs
    sorted by expert as pair_token (int64 [P]) and pair_weight (float32 [P]); group_start (int64 [G + 1]) the
    pair offset of each active expert; gate_up and down each (GGUF type ids int32 [G], data pointers int64 [G])
    of those experts' prepared matrices ([2 * inter, H] gate rows then up rows; [H, inter]). Returns float32
    [T, H]: per token, the routing-weighted sum of its experts' SwiGLU outputs."""
    if x.dtype != torch.bfloat16 or x.dim() != 2 or not x.is_contiguous():
        raise ValueError(f"moe_experts: x must be contiguous bf16 [T, H], got {x.dtype} {tuple(x.shape)}")
    out = torch.empty(x.shape[0], x.shape[1], dtype=torch.float32)
    groups = group_start.numel() - 1
    rc = _native().quant_moe(x.shape[0], x.shape[1], inter, _ptr(x), pair_token.numel(), _ptr(pair_token),
                             _ptr(pair_weight), groups, _ptr(group_start), _ptr(gate_up[0]), _ptr(gate_up[1]),
                             _ptr(down[0]), _ptr(down[1]), _ptr(out), torch.get_num_threads())
    if rc:
        _check(rc, f"moe experts (hidden {x.shape[1]}, inter {inter})")
    return out


def moe_route(x: torch.Tensor, router: torch.Tensor, top_k: int, renormalize: bool
              ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """An MoE router in one native call (csrc/quant_moe.c's moe_route_bf16, the native decode step's router):
    (weights float32 [T, k], expert ids int64 [T, k]) of each bf16 row of x [T, H] against the float32 router
    [E, H]: softmax over the experts, top-k by descending weight (ties: the lower expert), renormalized to sum 1
    when asked. None when the native library is not built or the tensors are not these dtypes (the caller then
    routes with torch)."""
    lib = _native()
    if lib is None or x.dtype != torch.bfloat16 or router.dtype != torch.float32 or x.dim() != 2 \
            or x.device.type != "cpu" or x.stride(1) != 1 or not router.is_contiguous():
        return None
    t, experts = x.shape[0], router.shape[0]
    weights = torch.empty(t, top_k, dtype=torch.float32)
    ids = torch.empty(t, top_k, dtype=torch.int64)
    _check(lib.moe_route_bf16(_ptr(x), x.stride(0), t, x.shape[1], _ptr(router), experts, top_k, int(renormalize),
                              _ptr(weights), _ptr(ids), torch.get_num_threads()),
           f"moe router ({experts} experts, top {top_k}, hidden {x.shape[1]})")
    return weights, ids


def embedding(ids: torch.Tensor, qm: QuantMatrix, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` of W, dequantized, in `dtype`: [*ids.shape, cols]."""
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= qm.rows):
        raise IndexError(f"embedding: ids must be in [0, {qm.rows}), got {int(flat.min())}..{int(flat.max())}")
    if not qm.packed:  # the reference on the looked-up rows only
        rows = _reference_dequantize(qm.data.index_select(0, flat), qm.qtype, flat.numel(), qm.cols)
        return rows.to(dtype).view(*ids.shape, qm.cols)
    direct = dtype in _NATIVE_DTYPES
    out = torch.empty(flat.numel(), qm.cols, dtype=dtype if direct else torch.float32)
    _check(_native().quant_dequant_rows(qm.qtype, _ptr(qm.data), qm.rows, qm.cols, _ptr(flat), flat.numel(),
                                        _ptr(out), 0 if out.dtype == torch.float32 else 1,
                                        torch.get_num_threads()), f"embedding {qm.name}")
    return (out if direct else out.to(dtype)).view(*ids.shape, qm.cols)
