"""Paged decode attention on the CPU (csrc/paged_attention.c): reads each request's K/V rows in place from
the KV pool through `kv_indptr`/`kv_indices`, so a decode step reads every KV byte once instead of
gathering a padded copy first. The same call can first store the step's new K/V rows in the pool.

`available(dtype, group, head_dim)` says whether the native kernel can run; `decode(...)` runs it.

fp8 pools (torch.float8_e4m3fn / float8_e5m2, `--kv-cache-dtype`): the kernels of csrc/paged_attention_fp8.c
take float32 or bf16 queries (the model's dtype; others are computed in float32) and return that dtype; the
new K/V rows are cast to fp8 by the kernel as `KVPool.set_kv` casts them (round to nearest even, saturating).

Soft-capped scores (Gemma 2's `attn_logit_softcapping`): `decode(..., logit_cap=c)` replaces every scaled score
s = q.k * scale by c * tanh(s / c) before the softmax, in every path of the kernel (cascade prefixes included).

`plan_shared_prefixes` finds, once per step, groups of requests whose index lists begin with the same slots
(a radix-cache prefix they share); `decode(..., shared=plan)` then reads each such prefix once for all the
group's queries and merges it with each request's own suffix (the flash-decoding merge): "cascade" decode.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from tokenloom.kernels.cpu_build import load_library

# (activation dtype, pool dtype) -> kernel
_FUNCS = {(torch.float32, torch.float32): "paged_decode_attention_f32",
          (torch.bfloat16, torch.bfloat16): "paged_decode_attention_bf16",
          (torch.float32, torch.float8_e4m3fn): "paged_decode_attention_f32_e4m3",
          (torch.bfloat16, torch.float8_e4m3fn): "paged_decode_attention_bf16_e4m3",
          (torch.float32, torch.float8_e5m2): "paged_decode_attention_f32_e5m2",
          (torch.bfloat16, torch.float8_e5m2): "paged_decode_attention_bf16_e5m2"}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _lib() -> ctypes.CDLL | None:
    return load_library("kernels")


def available(dtype: torch.dtype, group: int, head_dim: int) -> bool:
    lib = _lib()
    if lib is None or not any(kv == dtype for _, kv in _FUNCS):
        return False
    max_group, max_dim = ctypes.c_int(), ctypes.c_int()
    lib.kernel_limits(ctypes.byref(max_group), ctypes.byref(max_dim))
    return group <= max_group.value and head_dim <= max_dim.value


def rounds_probabilities(pool_dtype: torch.dtype) -> bool:
    """Whether bf16 queries at head_dim 64/128 over a pool of this dtype take the AVX512-BF16 path, which rounds
    the softmax numerators to bf16 before the weighted sum of V (CPUs with AVX512-BF16; for an fp8 pool also
    AVX512-VBMI); elsewhere they stay float32."""
    lib = _lib()
    return lib is not None and bool(lib.paged_attention_rounds_probs(int(pool_dtype.itemsize == 1)))


def _ptr(t: torch.Tensor | None) -> ctypes.c_void_p:
    return ctypes.c_void_p(None if t is None else t.data_ptr())


# Shared prefixes shorter than this are read per request: grouping them saves less than it costs.
MIN_SHARED_PREFIX = 32


@dataclass
class SharedPrefixPlan:
    """Groups of a step's requests that share the first `share_len[b]` slots of their index lists (see
    `plan_shared_prefixes` in csrc/paged_attention.c): group g is members[group_ptr[g]:group_ptr[g+1]]."""

    share_len: torch.Tensor  # [B] int64, 0 for requests in no group
    group_ptr: torch.Tensor  # [groups + 1] int32
    members: torch.Tensor  # [B] int32 (the first group_ptr[-1] entries are used)
    groups: int


@functools.cache  # called once per decode step; the kernel's limit cannot change within a process
def max_group_members(group: int) -> int:
    """How many requests one shared-prefix item can serve: their query rows (members x group) must fit the
    kernel's row limit."""
    max_rows = ctypes.c_int()
    _lib().kernel_limits(ctypes.byref(max_rows), ctypes.byref(ctypes.c_int()))
    return max_rows.value // max(group, 1)


def plan_shared_prefixes(kv_indptr: torch.Tensor, kv_indices: torch.Tensor, group: int,
                         min_shared: int = MIN_SHARED_PREFIX) -> SharedPrefixPlan | None:
    """The step's shared-prefix groups, or None when no two requests share `min_shared` leading slots (or the
    GQA group is too large for two requests' queries to share one work item)."""
    batch = kv_indptr.numel() - 1
    members_max = max_group_members(group)
    if batch < 2 or members_max < 2:
        return None
    indptr = kv_indptr.to(torch.int64).contiguous()
    indices = kv_indices.to(torch.int64).contiguous()
    share_len = torch.empty(batch, dtype=torch.int64)
    group_ptr = torch.empty(batch // 2 + 1, dtype=torch.int32)
    members = torch.empty(batch, dtype=torch.int32)
    groups = _lib().plan_shared_prefixes(_ptr(indptr), _ptr(indices), ctypes.c_int(batch), ctypes.c_int(members_max),
                                         ctypes.c_int64(min_shared), _ptr(share_len), _ptr(group_ptr), _ptr(members))
    if groups <= 0:
        return None
    return SharedPrefixPlan(share_len, group_ptr, members, groups)


def plan_arguments(plan: SharedPrefixPlan | None) -> tuple:
    if plan is None:
        return (ctypes.c_void_p(None), ctypes.c_void_p(None), ctypes.c_void_p(None), ctypes.c_int(0))
    return (_ptr(plan.share_len), _ptr(plan.group_ptr), _ptr(plan.members), ctypes.c_int(plan.groups))


def _rows_of_heads(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [B, H, D] with each token's heads contiguous (any stride between tokens), in `dtype`."""
    x = x.to(dtype)
    if x.stride(-1) != 1 or x.stride(-2) != x.shape[-1]:
        x = x.contiguous()
    return x


def activation_dtype(q_dtype: torch.dtype, pool_dtype: torch.dtype) -> torch.dtype:
    """The dtype the kernel takes queries / new K/V in and returns: the pool's, or for an fp8 pool the
    query's when it is float32 or bf16 (else float32)."""
    if pool_dtype not in FP8_DTYPES:
        return pool_dtype
    return q_dtype if q_dtype in (torch.float32, torch.bfloat16) else torch.float32


def fp8_encode(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x (float32) cast to fp8 `dtype` by the kernels' own conversion (the bytes their K/V write stores)."""
    src = x.detach().to(torch.float32).contiguous()
    out = torch.empty(src.shape, dtype=torch.uint8)
    _lib().fp8_encode_f32(_ptr(src), _ptr(out), ctypes.c_int64(src.numel()), ctypes.c_int(dtype == torch.float8_e5m2))
    return out.view(dtype)


def decode(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, kv_indptr: torch.Tensor,
           kv_indices: torch.Tensor, scale: float, k_new: torch.Tensor | None = None,
           v_new: torch.Tensor | None = None, out_loc: torch.Tensor | None = None,
           shared: SharedPrefixPlan | None = None, logit_cap: float = 0.0) -> torch.Tensor:
    """q [B, Hq, D]; k_pool/v_pool [Hkv, rows, D] (q is cast to `activation_dtype`) -> [B, Hq * D] in that dtype.

    With `k_new`/`v_new` [B, Hkv, D] and `out_loc` [B], those rows are first written into the pools at
    row `out_loc[b]` (which the indices of request b are expected to include). q, k_new and v_new may be
    views into a packed qkv tensor: only each token's heads need to be contiguous. `shared`: this step's
    `plan_shared_prefixes` result for the same indices (None: each request reads all its own KV).
    `logit_cap` > 0 soft-caps every scaled score, s -> cap * tanh(s / cap), before the softmax (Gemma 2's
    `attn_logit_softcapping`); 0: none."""
    if not logit_cap >= 0.0 or logit_cap == float("inf"):  # NaN fails the first test
        raise ValueError(f"logit_cap must be a finite number >= 0 (0: no soft-cap), got {logit_cap}")
    lib = _lib()
    dtype = activation_dtype(q.dtype, k_pool.dtype)
    q = _rows_of_heads(q, dtype)
    batch, num_heads, head_dim = q.shape
    num_kv_heads, rows = k_pool.shape[0], k_pool.shape[1]
    out = torch.empty(batch, num_heads, head_dim, dtype=dtype)
    indptr = kv_indptr.to(torch.int64).contiguous()
    indices = kv_indices.to(torch.int64).contiguous()
    k_stride = v_stride = 0
    if k_new is not None:
        if v_new is None or out_loc is None:
            raise ValueError("k_new needs v_new and out_loc")
        k_new, v_new = _rows_of_heads(k_new, dtype), _rows_of_heads(v_new, dtype)
        if k_new.shape != (batch, num_kv_heads, head_dim) or v_new.shape != k_new.shape:
            raise ValueError(f"k_new/v_new must both be {(batch, num_kv_heads, head_dim)}")
        k_stride, v_stride = k_new.stride(0), v_new.stride(0)
        out_loc = out_loc.to(torch.int64).contiguous()
    fn = getattr(lib, _FUNCS[dtype, k_pool.dtype])
    rc = fn(_ptr(q), ctypes.c_int64(q.stride(0)), _ptr(k_pool), _ptr(v_pool), _ptr(indptr), _ptr(indices),
            _ptr(out), ctypes.c_int(batch), ctypes.c_int(num_heads), ctypes.c_int(num_kv_heads),
            ctypes.c_int(head_dim), ctypes.c_int64(rows), ctypes.c_float(scale), ctypes.c_float(logit_cap),
            ctypes.c_int(torch.get_num_threads()), _ptr(k_new), ctypes.c_int64(k_stride), _ptr(v_new),
            ctypes.c_int64(v_stride), _ptr(out_loc), *plan_arguments(shared))
    if rc != 0:
        raise MemoryError("paged decode attention could not allocate its work buffers")
    return out.view(batch, num_heads * head_dim)
