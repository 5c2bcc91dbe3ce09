"""`cpu` attention: `torch_native` for extend, and the native paged decode kernel
(tokenloom/kernels/paged_attention.py) for decode, which reads K/V in place from the pool through
`kv_indptr`/`kv_indices` instead of gathering a padded copy. Used when the kernel builds on this machine.
"""

from __future__ import annotations

import torch

from tokenloom.executor.forward_batch import ForwardBatch
from tokenloom.kernels import paged_attention
from tokenloom.layers.attention.torch_native import TorchNativeBackend
from tokenloom.layers.kv_indices import build_kv_indices


class CpuPagedBackend(TorchNativeBackend):
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        if not batch.forward_mode.is_decode():
            super().init_forward_metadata(batch)
            return
        kv_indptr, kv_indices = build_kv_indices(
            self.req_to_token_pool.req_to_token, batch.req_pool_indices, batch.seq_lens)
        batch.attn_metadata = (kv_indptr, kv_indices)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, scaling: float,
                batch: ForwardBatch) -> torch.Tensor:
        if not batch.forward_mode.is_decode():
            return super().forward(q, k, v, layer_id, scaling, batch)
        k_buf, v_buf = self.kv_pool.get_kv(layer_id)
        kv_indptr, kv_indices = batch.attn_metadata
        out = paged_attention.decode(q, k_buf, v_buf, kv_indptr, kv_indices, scaling,
                                     k_new=k, v_new=v, out_loc=batch.out_cache_loc)  # stores k/v, then attends
        return out.to(q.dtype)

    @staticmethod
    def supported(dtype: torch.dtype, device: torch.device, group: int, head_dim: int) -> bool:
        return device.type == "cpu" and paged_attention.available(dtype, group, head_dim)
