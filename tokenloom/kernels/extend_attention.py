"""Paged extend (prefill) attention on the CPU (csrc/extend_attention.c): each request's new tokens attend
causally to its cached prefix and to each other, reading K/V in place from the KV pool through
`kv_indptr`/`kv_indices`: no gathered copy of K/V, no mask tensor, and the causal upper triangle is skipped
rather than masked (torch's SDPA with a prefix mask computes every block).

`available(dtype, group, head_dim)` says whether the native kernel runs here (bf16, head_dim 64 or 128, an
AVX-512 CPU); `extend(...)` runs it. Numerics: float32 scores, softmax and sums from exact products of the bf16
inputs; on the AVX512-BF16 dot-product path the probabilities are rounded to bf16 before the weighted sum of
V (as the decode kernel does), on the FMA path (CPUs whose vdpbf16ps is slow) they stay float32; the output
is rounded to bf16.
"""

from __future__ import annotations

import ctypes

import torch

from tokenloom.kernels.cpu_build import load_library


def _lib() -> ctypes.CDLL | None:
    return load_library("kernels")


def available(dtype: torch.dtype, group: int, head_dim: int) -> bool:
    """True when the kernel library builds here and has a path for this pool dtype, GQA group and head_dim."""
    lib = _lib()
    return dtype == torch.bfloat16 and lib is not None and bool(lib.extend_attention_supported(head_dim, group))


def path(value: int = -1) -> int:
    """The kernel's arithmetic path: 1 AVX512-BF16 dot products, 2 float32 FMAs. `value` 1 or 2 sets it (tests
    and A/B runs), 0 returns to the automatic choice (decided once per process: the dot products where this
    core issues vdpbf16ps about as fast as vpdpbusd, else FMAs); the default only reads it."""
    return int(_lib().extend_attention_path(ctypes.c_int(value)))


def _ptr(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


def extend(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, kv_indptr: torch.Tensor,
           kv_indices: torch.Tensor, q_start: torch.Tensor, q_len: torch.Tensor, scale: float,
           logit_cap: float = 0.0) -> torch.Tensor:
    """q [T, Hq, D] (cast to bf16; each token's heads contiguous); k_pool/v_pool [Hkv, rows, D] bf16 holding
    every request's K/V already, the new tokens' included; request b's slots in position order are
    kv_indices[kv_indptr[b]:kv_indptr[b + 1]], its q_len[b] new tokens are q rows q_start[b]... and are the
    last q_len[b] of those positions. Returns [T, Hq * D] bf16. `logit_cap` > 0 soft-caps every scaled score,
    s -> cap * tanh(s / cap) (Gemma 2); 0: none."""
    if not logit_cap >= 0.0 or logit_cap == float("inf"):  # NaN fails the first test
        raise ValueError(f"logit_cap must be a finite number >= 0 (0: no soft-cap), got {logit_cap}")
    if k_pool.dtype != torch.bfloat16 or v_pool.dtype != torch.bfloat16:
        raise ValueError(f"the native extend attention takes a bf16 KV pool, got {k_pool.dtype}")
    q = q.to(torch.bfloat16)
    if q.stride(-1) != 1 or q.stride(-2) != q.shape[-1]:
        q = q.contiguous()
    tokens, num_heads, head_dim = q.shape
    num_kv_heads, rows = k_pool.shape[0], k_pool.shape[1]
    indptr = kv_indptr.to(torch.int64).contiguous()
    indices = kv_indices.to(torch.int64).contiguous()
    starts, lens = q_start.to(torch.int64).contiguous(), q_len.to(torch.int64).contiguous()
    batch = lens.numel()
    if indptr.numel() != batch + 1 or starts.numel() != batch:
        raise ValueError(f"kv_indptr needs {batch + 1} entries and q_start {batch}")
    out = torch.empty(tokens, num_heads, head_dim, dtype=torch.bfloat16)
    rc = _lib().paged_extend_attention_bf16(
        _ptr(q), ctypes.c_int64(q.stride(0)), _ptr(k_pool), _ptr(v_pool), _ptr(indptr), _ptr(indices), _ptr(starts),
        _ptr(lens), _ptr(out), ctypes.c_int(batch), ctypes.c_int(num_heads), ctypes.c_int(num_kv_heads),
        ctypes.c_int(head_dim), ctypes.c_int64(rows), ctypes.c_float(scale), ctypes.c_float(logit_cap),
        ctypes.c_int(torch.get_num_threads()))
    if rc == -2:
        raise ValueError(f"no native extend attention for head_dim {head_dim}, {num_heads} heads over "
                         f"{num_kv_heads} KV heads on this CPU (see available())")
    if rc != 0:
        raise MemoryError("paged extend attention could not allocate its work buffers")
    return out.view(tokens, num_heads * head_dim)
