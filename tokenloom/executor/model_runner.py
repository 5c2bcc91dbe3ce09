"""`ModelRunner`: the loaded model of one rank, its attention backend and sampler over the rank's `KVMemory`;
runs one `ForwardBatch` at a time.

Construction: `LoadedModel.load` reads the memory available at start, then loads the weights (the memory
budget of `--mem-fraction-static` covers both, so the KV memory is sized after them); the rank's entry builds
the `KVMemory` from it and hands the same object to the runner and the scheduler. Given no memory, the runner
builds its own (the scheduler-less users: benchmarks and the forward-path tests).

Per step: `prepare(batch)` writes the new tokens' KV slots into `req_to_token` and lets the attention backend
build its metadata once (`forward` does it when the caller did not); `forward(batch)` runs the model and
returns float32 logits (one row per request, or per token with `return_all_logits`), through the one-call
native step (`NativeDecode`) for small decode batches where it applies; `sample(logits, info)` turns them
into next tokens. The runner never decides what to run, and never allocates or frees KV memory: that is the
scheduler's job (or a test's).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenloom.cache.allocator import PagedAllocator, TokenAllocator
from tokenloom.cache.kv_memory import KVMemory
from tokenloom.cache.kv_pool import KVPool, kv_storage_dtype
from tokenloom.cache.memory_budget import model_nbytes
from tokenloom.cache.req_to_token import ReqToTokenPool
from tokenloom.config import ServerArgs
from tokenloom.device import available_memory_bytes, configure_threads, resolve_device
from tokenloom.distributed.parallel_state import SINGLE_PROCESS, ParallelContext
from tokenloom.executor.inference import inference
from tokenloom.executor.native_decode import NativeDecode
from tokenloom.forward_batch import ForwardBatch
from tokenloom.layers.attention.registry import create_attention_backend
from tokenloom.layers.sampler import SampleOutput, Sampler
from tokenloom.models.llama import LlamaForCausalLM
from tokenloom.models.loader import ModelSource, load_model, resolve_dtype, resolve_model_source
from tokenloom.sampling.sampling_batch import SamplingBatchInfo


@dataclass
class LoadedModel:
    """One rank's weights, loaded, and what its KV memory is sized beside."""

    source: ModelSource
    device: torch.device
    dtype: torch.dtype
    model: LlamaForCausalLM
    memory_at_start: int  # bytes available before the weights loaded (what --mem-fraction-static shares)

    @classmethod
    def load(cls, args: ServerArgs, parallel: ParallelContext = SINGLE_PROCESS, source: ModelSource | None = None,
             start_layer: int = 0, end_layer: int | None = None) -> LoadedModel:
        device = resolve_device(args.device)
        configure_threads(args.num_threads)
        source = source or resolve_model_source(args)
        dtype = resolve_dtype(args.dtype, device)
        memory_at_start = available_memory_bytes(device)  # before the weights: --mem-fraction-static
        # the model's layers see the expert-parallel size (layers/moe.py); the rest of the rank does not need it
        model_ctx = dataclasses.replace(parallel, ep_size=args.moe_ep_size) if args.moe_ep_size > 1 else parallel
        model = load_model(source, dtype, device, model_ctx, start_layer, end_layer, seed=args.random_seed)
        return cls(source, device, dtype, model, memory_at_start)

    def kv_memory(self, args: ServerArgs, parallel: ParallelContext = SINGLE_PROCESS,
                  agree: Callable[[list[int]], list[int]] | None = None) -> KVMemory:
        """The KV memory for this model's layers and TP shard, sized from the flags and the memory budget
        (`agree`: see `KVMemory.from_server_args`)."""
        return KVMemory.from_server_args(args, self.source.config, self.dtype, self.device, parallel,
                                         self.model.start_layer, self.model.end_layer,
                                         memory_at_start=self.memory_at_start, weight_bytes=model_nbytes(self.model),
                                         agree=agree)


class ModelRunner:
    def __init__(self, args: ServerArgs, parallel: ParallelContext = SINGLE_PROCESS,
                 source: ModelSource | None = None, start_layer: int = 0, end_layer: int | None = None,
                 memory: KVMemory | None = None, loaded: LoadedModel | None = None) -> None:
        """`loaded`: weights loaded already (else loaded here from `source`/args and the layer range);
        `memory`: the rank's KV memory (else built here for the loaded model)."""
        self.args = args
        loaded = loaded or LoadedModel.load(args, parallel, source, start_layer, end_layer)
        self.device, self.source, self.dtype, self.model = loaded.device, loaded.source, loaded.dtype, loaded.model
        self.model_config = self.source.config
        self.parallel = parallel
        self.context_len = self.model_config.context_length
        self.memory = memory if memory is not None else loaded.kv_memory(args, parallel)
        self._check_memory_fits()
        heads = max(1, self.model_config.num_attention_heads // parallel.tp_size)
        self.attn_backend = create_attention_backend(args.attention_backend, self.memory.req_to_token_pool,
                                                     self.memory.kv_pool, heads,
                                                     cascade=not args.disable_cascade_attention,
                                                     layer_windows=[self.model_config.layer_window(i) for i in
                                                                    range(self.model_config.num_hidden_layers)])
        self.sampler = Sampler(seed=args.random_seed, device=self.device)
        self.native_decode = None if args.disable_native_decode else NativeDecode.build(
            self.model, self.memory.kv_pool, self.attn_backend, self.dtype, self.device, parallel)

    def _check_memory_fits(self) -> None:
        """A KV memory built elsewhere must be shaped for this model's layers, shard, dtype and device."""
        pool, cfg = self.memory.kv_pool, self.model_config
        kv_heads = max(1, cfg.num_key_value_heads // self.parallel.tp_size)
        want = ((self.model.start_layer, self.model.end_layer), kv_heads, cfg.head_dim,
                kv_storage_dtype(self.args.kv_cache_dtype, self.dtype), self.device.type)
        have = ((pool.start_layer, pool.end_layer), pool.num_kv_heads, pool.head_dim, pool.dtype,
                self.memory.device.type)
        if want != have:
            raise ValueError(f"KVMemory (layers, kv heads, head_dim, dtype, device) {have} does not fit the "
                             f"model's {want}")
        if self.memory.context_len < self.context_len:
            raise ValueError(f"KVMemory rows hold {self.memory.context_len} tokens; the model's context is "
                             f"{self.context_len}")

    # Aliases of the memory's parts, read by the scheduler-less users (benchmarks, tests).
    @property
    def req_to_token_pool(self) -> ReqToTokenPool:
        return self.memory.req_to_token_pool

    @property
    def token_allocator(self) -> TokenAllocator | PagedAllocator:
        return self.memory.token_allocator

    @property
    def kv_pool(self) -> KVPool:
        return self.memory.kv_pool

    @property
    def max_total_num_tokens(self) -> int:
        return self.memory.max_total_num_tokens

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    @inference
    def prepare(self, batch: ForwardBatch) -> None:
        """Record the new tokens' slots in `req_to_token` and build the attention metadata (which snapshots
        the KV indices). The overlap scheduler calls this on its own thread, so the forward thread never
        reads `req_to_token` while the scheduler edits it."""
        if not self.attn_backend.stores_new_slots(batch):  # else the backend writes them with its metadata
            rows = batch.req_pool_indices if batch.forward_mode.is_decode() \
                else batch.req_pool_indices[batch.token_req_index]  # decode: one token per request, in order
            self.memory.req_to_token_pool.write(rows, batch.positions, batch.out_cache_loc)
        self.attn_backend.init_forward_metadata(batch)

    @inference
    def forward(self, batch: ForwardBatch) -> torch.Tensor | dict[str, torch.Tensor]:
        if batch.attn_metadata is None:
            self.prepare(batch)
        if self.native_decode is not None and self.native_decode.applies(batch):
            return self.native_decode.run(batch)
        return self.model(batch, self.attn_backend)

    @inference
    def sample(self, logits: torch.Tensor, info: SamplingBatchInfo) -> SampleOutput:
        return self.sampler(logits, info)
