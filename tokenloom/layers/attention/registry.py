"""Attention backend name (`--attention-backend`) -> implementation class.

`auto` picks `cpu` (native paged decode kernel) on the CPU when it builds for the pool's dtype and the
model's GQA group, else `torch_native`. The CLI's choices (config.ATTENTION_BACKENDS) and this table must
agree; a test checks it.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenloom.cache.kv_pool import KVPool
from tokenloom.cache.req_to_token import ReqToTokenPool
from tokenloom.layers.attention.base import AttentionBackend
from tokenloom.layers.attention.cpu_paged import CpuPagedBackend
from tokenloom.layers.attention.torch_native import TorchNativeBackend

ATTENTION_BACKEND_CLASSES: dict[str, type[AttentionBackend]] = {
    "torch_native": TorchNativeBackend,
    "cpu": CpuPagedBackend,
}


def resolve_attention_backend(name: str, kv_pool: KVPool, num_heads: int) -> str:
    k = kv_pool.k_buffers[0] if kv_pool.k_buffers else None
    if name != "auto":
        if name not in ATTENTION_BACKEND_CLASSES:
            raise ValueError(f"unknown attention backend {name!r}; choose from auto, "
                             f"{', '.join(ATTENTION_BACKEND_CLASSES)}")
        if name == "cpu" and (k is None or not CpuPagedBackend.supported(
                k.dtype, k.device, num_heads // k.shape[0], k.shape[2])):
            raise ValueError("--attention-backend cpu is not available here (needs a C compiler, the CPU "
                             "device, float32/bfloat16/fp8 KV and a GQA group <= 16, head_dim <= 256)")
        return name
    if k is not None and CpuPagedBackend.supported(k.dtype, k.device, num_heads // k.shape[0], k.shape[2]):
        return "cpu"
    return "torch_native"


def create_attention_backend(name: str, req_to_token_pool: ReqToTokenPool, kv_pool: KVPool,
                             num_heads: int, cascade: bool = True, layer_windows: Sequence[int] = ()
                             ) -> AttentionBackend:
    """`cascade`: let the `cpu` backend attend a prefix shared by several decode requests once for all.
    `layer_windows[layer_id]`: that layer's sliding window (0 = full attention; `ModelConfig.layer_window`)."""
    resolved = resolve_attention_backend(name, kv_pool, num_heads)
    if resolved == "cpu":
        return CpuPagedBackend(req_to_token_pool, kv_pool, num_heads, cascade=cascade, layer_windows=layer_windows)
    return ATTENTION_BACKEND_CLASSES[resolved](req_to_token_pool, kv_pool, layer_windows)
