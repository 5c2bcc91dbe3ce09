"""`ModelRunner`: loads the model, owns the KV memory (request table, allocator, KV pool), the attention
backend and the sampler, and runs one `ForwardBatch` at a time.

Per step: `prepare(batch)` writes the new tokens' KV slots into `req_to_token` and lets the attention backend
build its metadata once (`forward` does it when the caller did not); `forward(batch)` runs the model and
returns float32 logits (one row per request, or per token with `return_all_logits`), through the one-call
native step (`NativeDecode`) for small decode batches where it applies; `sample(logits, info)` turns them
into next tokens. The runner never decides what to run: that is the scheduler's job (or a test's).
"""

from __future__ import annotations

import logging

import torch

from tokenloom.cache.allocator import PagedAllocator, TokenAllocator
from tokenloom.cache.kv_pool import KVPool
from tokenloom.cache.req_to_token import ReqToTokenPool
from tokenloom.config import ServerArgs
from tokenloom.device import (
    available_memory_bytes,
    configure_threads,
    default_mem_fraction_static,
    resolve_device,
)
from tokenloom.distributed.parallel_state import SINGLE_PROCESS, ParallelContext
from tokenloom.executor.forward_batch import ForwardBatch
from tokenloom.executor.memory_budget import CPU_KV_SHARE_OF_FREE, kv_pool_bytes, model_nbytes
from tokenloom.executor.native_decode import NativeDecode
from tokenloom.layers.attention.registry import create_attention_backend
from tokenloom.layers.sampler import SampleOutput, Sampler
from tokenloom.models.loader import ModelSource, load_model, resolve_dtype, resolve_model_source
from tokenloom.sampling.sampling_batch import SamplingBatchInfo

logger = logging.getLogger(__name__)

# Extra columns in req_to_token beyond the context length (room for a token sampled at the limit).
_REQ_TO_TOKEN_SLACK = 4


class ModelRunner:
    def __init__(self, args: ServerArgs, parallel: ParallelContext = SINGLE_PROCESS,
                 source: ModelSource | None = None, start_layer: int = 0, end_layer: int | None = None) -> None:
        self.args = args
        self.device = resolve_device(args.device)
        configure_threads(args.num_threads)
        self.source = source or resolve_model_source(args)
        self.model_config = self.source.config
        self.dtype = resolve_dtype(args.dtype, self.device)
        self.parallel = parallel
        self.memory_at_start = available_memory_bytes(self.device)  # before the weights: --mem-fraction-static
        self.model = load_model(self.source, self.dtype, self.device, parallel, start_layer, end_layer,
                                seed=args.random_seed)
        self.context_len = self.model_config.context_length
        self._init_memory(start_layer, self.model.end_layer)
        heads = max(1, self.model_config.num_attention_heads // parallel.tp_size)
        self.attn_backend = create_attention_backend(args.attention_backend, self.req_to_token_pool, self.kv_pool,
                                                     heads, cascade=not args.disable_cascade_attention)
        self.sampler = Sampler(seed=args.random_seed, device=self.device)
        self.native_decode = None if args.disable_native_decode else NativeDecode.build(
            self.model, self.kv_pool, self.attn_backend, self.dtype, self.device, parallel.tp_size)

    def _init_memory(self, start_layer: int, end_layer: int) -> None:
        cfg, args = self.model_config, self.args
        per_token = cfg.kv_bytes_per_token(self.dtype, self.parallel.tp_size, end_layer - start_layer)
        if args.max_total_tokens is not None:
            tokens = args.max_total_tokens
        else:
            fraction = args.mem_fraction_static
            if fraction is None:
                fraction = default_mem_fraction_static(self.device)
            weights = model_nbytes(self.model)
            tokens = kv_pool_bytes(self.memory_at_start, weights, fraction) // per_token
            logger.info("Memory: %.2f GiB available at start, weights %.2f GiB, KV budget %.2f GiB (%s)",
                        self.memory_at_start / 2**30, weights / 2**30, tokens * per_token / 2**30,
                        f"--mem-fraction-static {fraction}" if fraction is not None else
                        f"{CPU_KV_SHARE_OF_FREE:.0%} of the memory left after the weights")
        tokens = tokens // args.page_size * args.page_size
        if tokens < 2 * args.page_size:
            raise RuntimeError(f"KV pool would hold only {tokens} tokens; raise --max-total-tokens, "
                               "--mem-fraction-static or memory")
        self.max_total_num_tokens = tokens
        requests = args.max_running_requests or min(max(tokens * 512 // self.context_len, 256), 4096)
        self.req_to_token_pool = ReqToTokenPool(requests, self.context_len + _REQ_TO_TOKEN_SLACK, self.device)
        self.token_allocator = (TokenAllocator(tokens, self.device, args.decode_slot_run) if args.page_size == 1
                                else PagedAllocator(tokens, args.page_size, self.device))
        kv_heads = max(1, cfg.num_key_value_heads // self.parallel.tp_size)
        self.kv_pool = KVPool(tokens, args.page_size, kv_heads, cfg.head_dim, self.dtype, self.device,
                              start_layer, end_layer)
        logger.info("KV pool: %d tokens (%.1f MiB), %d request slots, page size %d", tokens,
                    self.kv_pool.nbytes() / 2**20, requests, args.page_size)

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    @torch.inference_mode()
    def prepare(self, batch: ForwardBatch) -> None:
        """Record the new tokens' slots in `req_to_token` and build the attention metadata (which snapshots
        the KV indices). The overlap scheduler calls this on its own thread, so the forward thread never
        reads `req_to_token` while the scheduler edits it."""
        rows = batch.req_pool_indices[batch.token_req_index]
        self.req_to_token_pool.write(rows, batch.positions, batch.out_cache_loc)
        self.attn_backend.init_forward_metadata(batch)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor | dict[str, torch.Tensor]:
        if batch.attn_metadata is None:
            self.prepare(batch)
        if self.native_decode is not None and self.native_decode.applies(batch):
            return self.native_decode.run(batch)
        return self.model(batch, self.attn_backend)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, info: SamplingBatchInfo) -> SampleOutput:
        return self.sampler(logits, info)
