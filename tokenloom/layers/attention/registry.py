"""Attention backend name (`--attention-backend`) -> implementation class.

The CLI's choices (config.ATTENTION_BACKENDS) and this table must agree; a test checks it.
"""

from __future__ import annotations

from tokenloom.cache.kv_pool import KVPool
from tokenloom.cache.req_to_token import ReqToTokenPool
from tokenloom.layers.attention.base import AttentionBackend
from tokenloom.layers.attention.torch_native import TorchNativeBackend

ATTENTION_BACKEND_CLASSES: dict[str, type[AttentionBackend]] = {"torch_native": TorchNativeBackend}


def create_attention_backend(name: str, req_to_token_pool: ReqToTokenPool, kv_pool: KVPool) -> AttentionBackend:
    try:
        cls = ATTENTION_BACKEND_CLASSES[name]
    except KeyError:
        raise ValueError(f"unknown attention backend {name!r}; choose from "
                         f"{', '.join(ATTENTION_BACKEND_CLASSES)}") from None
    return cls(req_to_token_pool, kv_pool)
