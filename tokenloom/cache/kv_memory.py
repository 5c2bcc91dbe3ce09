"""`KVMemory`: the one owner of a rank's KV memory — the request table (`ReqToTokenPool`), the KV slot
allocator, the KV pool and the prefix cache over them — and their sizing from the flags and the memory budget.

Lifecycle: built once per rank by the rank's entry (entrypoints/scheduler_process.py; `ModelRunner` builds its own when
given none, for the scheduler-less users) after the weights are loaded, since `--mem-fraction-static`
budgets weights plus KV together; then handed to both the runner and the scheduler. Capacities
(`max_total_num_tokens`, `request_slots`, `page_size`, `context_len`) never change afterwards.

Who may mutate what:
- the scheduler (its `BatchMemory`, `OutputProcessor`, retraction) is the only one that allocates and frees
  request rows and KV slots, writes a cached prefix into a row, and inserts into, locks, evicts from or
  resets the prefix cache;
- the runner (`ModelRunner.prepare`, on the scheduler's thread) writes the KV slots the scheduler allocated
  for a batch's new tokens into their rows of `req_to_token`, and its attention backend writes K/V into the
  pool at those slots (on the forward side); it frees nothing and never touches the allocator or the cache.
  A slot a launched batch writes stays allocated until the scheduler has processed that batch's results.

Invariants (checked by `check_integrity` / `check_idle_integrity`, when no request is running):
    free slots + evictable (cached, unlocked) + locked (cached, in use) == max_total_num_tokens
    free request rows == request_slots

Layout of the KV pool (`KVPool`): one contiguous buffer [layers, 2 (K, V), kv_heads, max_total_num_tokens +
page_size, head_dim]; each layer's K and V are views of it, [kv_heads, rows, head_dim] and head-major, which
is what the native paged attention kernel (csrc/paged_attention.c) and the native decode step read with fixed
strides. Pages are aligned (page p is slots [p * page_size, (p + 1) * page_size); page 0 holds the dummy
slot). A transfer engine registers the one buffer (`KVPool.layout` describes it); a page of a layer is NOT one
contiguous run: it is 2 * kv_heads runs (K and V of each head), each page_size * head_dim elements long, one
head's run (max_total_num_tokens + page_size) * head_dim elements after the previous, which
cache/kv_layout.py's `transfer_runs` computes and coalesces. A page-major layout (one run per page
and layer) would need the kernels' indexing changed.

Sliding-window models (some layer with `ModelConfig.layer_window` > 0; not with --disable-hybrid-swa-memory or
--page-size > 1): the sliding layers' KV lives in a second, smaller pool
(`--swa-full-tokens-ratio` of the full one) whose slots are freed once out of the window (cache/swa_pool.py,
cache/swa_radix_cache.py); the budget counts a token as the full layers' bytes plus the ratio times the
sliding layers'. The decision depends on the model, not on this rank's layers, so every pipeline stage
schedules alike.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from tokenloom.cache.allocator import DECODE_RUN, PagedAllocator, TokenAllocator
from tokenloom.cache.chunk_cache import ChunkCache
from tokenloom.cache.kv_pool import KVPool, kv_storage_dtype
from tokenloom.cache.memory_budget import CPU_KV_SHARE_OF_FREE, kv_pool_bytes
from tokenloom.cache.prefix_cache import PrefixCache
from tokenloom.cache.radix_cache import RadixCache
from tokenloom.cache.req_to_token import ReqToTokenPool
from tokenloom.cache.swa_pool import SWAAllocator, SWAKVPool
from tokenloom.cache.swa_radix_cache import SWAChunkCache, SWARadixCache
from tokenloom.config import ServerArgs
from tokenloom.device import default_mem_fraction_static
from tokenloom.distributed.parallel_state import ParallelContext
from tokenloom.model_config import ModelConfig

logger = logging.getLogger(__name__)

# Extra columns in req_to_token beyond the context length (room for a token sampled at the limit).
REQ_TO_TOKEN_SLACK = 4


def kv_capacity_tokens(args: ServerArgs, kv_bytes_per_token: int, device: torch.device,
                       memory_at_start: int | None, weight_bytes: int | None) -> int:
    """KV slots the pool gets: `--max-total-tokens`, else the memory budget (cache/memory_budget.py) over
    the bytes one token takes on this rank; rounded down to whole pages, at least two pages."""
    if args.max_total_tokens is not None:
        tokens = args.max_total_tokens
    else:
        if memory_at_start is None or weight_bytes is None:
            raise ValueError("sizing the KV pool from the memory budget needs memory_at_start and weight_bytes")
        fraction = args.mem_fraction_static
        if fraction is None:
            fraction = default_mem_fraction_static(device)
        tokens = kv_pool_bytes(memory_at_start, weight_bytes, fraction) // kv_bytes_per_token
        logger.info("Memory: %.2f GiB available at start, weights %.2f GiB, KV budget %.2f GiB (%s)",
                    memory_at_start / 2**30, weight_bytes / 2**30, tokens * kv_bytes_per_token / 2**30,
                    f"--mem-fraction-static {fraction}" if fraction is not None else
                    f"{CPU_KV_SHARE_OF_FREE:.0%} of the memory left after the weights")
    tokens = tokens // args.page_size * args.page_size
    if tokens < 2 * args.page_size:
        raise RuntimeError(f"KV pool would hold only {tokens} tokens; raise --max-total-tokens, "
                           "--mem-fraction-static or memory")
    return tokens


def request_slots_for(args: ServerArgs, tokens: int, context_len: int) -> int:
    """Rows of the request table: `--max-running-requests`, else scaled with the pool (256..4096)."""
    return args.max_running_requests or min(max(tokens * 512 // context_len, 256), 4096)


def swa_memory_applies(args: ServerArgs, layer_windows: tuple[int, ...]) -> bool:
    """Whether a model with these per-layer windows gets the sliding-window pool (PD servers too: their transfers
    carry both pools, cache/pool_layout.py)."""
    if not any(layer_windows) or args.disable_hybrid_swa_memory:
        return False
    if args.page_size != 1:
        logger.info("Sliding-window model with --page-size %d: one full KV pool (the sliding-window pool needs "
                    "page size 1)", args.page_size)
        return False
    return True


class KVMemory:
    """The request table, allocator, KV pool and prefix cache of one rank (see the module docstring)."""

    def __init__(self, req_to_token_pool: ReqToTokenPool, token_allocator: TokenAllocator | PagedAllocator,
                 kv_pool: KVPool, tree_cache: PrefixCache, context_len: int) -> None:
        if not (token_allocator.size == kv_pool.size and token_allocator.page_size == kv_pool.page_size
                and tree_cache.allocator is token_allocator and tree_cache.req_to_token_pool is req_to_token_pool):
            raise ValueError("KVMemory parts disagree: the allocator, pool and cache must share sizes and parts")
        self.req_to_token_pool = req_to_token_pool
        self.token_allocator = token_allocator
        self.kv_pool = kv_pool
        self.tree_cache = tree_cache
        self.context_len = context_len  # the longest sequence a request row is meant for (model context)
        self.device = req_to_token_pool.device

    @property
    def max_total_num_tokens(self) -> int:
        return self.token_allocator.size

    @property
    def request_slots(self) -> int:
        return self.req_to_token_pool.size

    @property
    def page_size(self) -> int:
        return self.token_allocator.page_size

    @classmethod
    def build(cls, *, tokens: int, request_slots: int, context_len: int, page_size: int, num_kv_heads: int,
              head_dim: int, dtype: torch.dtype, device: torch.device, start_layer: int, end_layer: int,
              disable_radix_cache: bool = False, decode_slot_run: int = DECODE_RUN,
              layer_windows: tuple[int, ...] = (), swa_tokens: int | None = None) -> KVMemory:
        """The parts for explicit capacities (`from_server_args` computes them; tests pass small ones).
        `layer_windows[layer]` > 0 with `swa_tokens`: the sliding-window pool (page size 1), its sliding layers
        in a pool of `swa_tokens` slots."""
        req_to_token = ReqToTokenPool(request_slots, context_len + REQ_TO_TOKEN_SLACK, device)
        allocator = (TokenAllocator(tokens, device, decode_slot_run) if page_size == 1
                     else PagedAllocator(tokens, page_size, device))
        if swa_tokens is not None and any(layer_windows):
            if page_size != 1:
                raise ValueError("the sliding-window KV pool needs --page-size 1")
            window = max(layer_windows)
            allocator = SWAAllocator(allocator, swa_tokens)
            kv_pool = SWAKVPool(tokens, swa_tokens, num_kv_heads, head_dim, dtype, device, start_layer, end_layer,
                                [w > 0 for w in layer_windows])
            kv_pool.full_to_swa = allocator.full_to_swa
            cache = (SWAChunkCache if disable_radix_cache else SWARadixCache)(req_to_token, allocator, 1, window)
            cache.sliding_window = window
            return cls(req_to_token, allocator, kv_pool, cache, context_len)
        kv_pool = KVPool(tokens, page_size, num_kv_heads, head_dim, dtype, device, start_layer, end_layer)
        cache_cls = ChunkCache if disable_radix_cache else RadixCache
        return cls(req_to_token, allocator, kv_pool, cache_cls(req_to_token, allocator, page_size), context_len)

    @classmethod
    def from_server_args(cls, args: ServerArgs, model_config: ModelConfig, dtype: torch.dtype, device: torch.device,
                         parallel: ParallelContext, start_layer: int, end_layer: int, *,
                         memory_at_start: int | None = None, weight_bytes: int | None = None,
                         agree: Callable[[list[int]], list[int]] | None = None) -> KVMemory:
        """Size and build the memory of this rank's layers [start_layer, end_layer) and TP shard from the
        flags; `memory_at_start` (bytes available before the weights loaded) and `weight_bytes` are needed
        unless `--max-total-tokens` is set. `agree` maps this rank's [KV tokens, request slots] to the ones
        every rank uses (the MIN over the world, so all ranks schedule within the smallest pool); the pool
        is built at the agreed size. `dtype` is the model's; the pool stores `--kv-cache-dtype` (fp8: one
        byte per element, so the same budget holds twice the tokens of bf16)."""
        dtype = kv_storage_dtype(args.kv_cache_dtype, dtype)
        layers = end_layer - start_layer
        windows = tuple(model_config.layer_window(i) for i in range(model_config.num_hidden_layers))
        hybrid = swa_memory_applies(args, windows)
        per_token = model_config.kv_bytes_per_token(dtype, parallel.tp_size, layers)
        if hybrid:  # a sliding layer's slot counts for the ratio of one
            sliding = sum(1 for w in windows[start_layer:end_layer] if w)
            per_sliding = model_config.kv_bytes_per_token(dtype, parallel.tp_size, sliding)
            per_token = max(1, per_token - per_sliding + int(per_sliding * args.swa_full_tokens_ratio))
        tokens = kv_capacity_tokens(args, per_token, device, memory_at_start, weight_bytes)
        context_len = model_config.context_length
        requests = request_slots_for(args, tokens, context_len)
        if agree is not None:
            tokens, requests = agree([tokens, requests])
        swa_tokens = max(2, int(tokens * args.swa_full_tokens_ratio)) if hybrid else None
        memory = cls.build(tokens=tokens, request_slots=requests, context_len=context_len, page_size=args.page_size,
                           num_kv_heads=max(1, model_config.num_key_value_heads // parallel.tp_size),
                           head_dim=model_config.head_dim, dtype=dtype, device=device, start_layer=start_layer,
                           end_layer=end_layer, disable_radix_cache=args.disable_radix_cache,
                           decode_slot_run=args.decode_slot_run, layer_windows=windows, swa_tokens=swa_tokens)
        if hybrid:
            logger.info("Sliding-window KV pool: full layers %d slots, sliding layers %d slots (window %d)",
                        tokens, swa_tokens, max(windows))
        logger.info("KV pool: %d tokens (%.1f MiB, %s), %d request slots, page size %d", tokens,
                    memory.kv_pool.nbytes() / 2**20, str(dtype).removeprefix("torch."), requests, args.page_size)
        return memory

    def swa_tail(self) -> int | None:
        """A sliding-window pool: the positions at the end of a sequence whose sliding-layer K/V its next query
        reads (what KV arriving for a whole prompt needs slots for); None for a plain pool."""
        return getattr(self.tree_cache, "keep", None) if self.tree_cache.sliding_window else None

    def free_by_pool(self) -> tuple[int, int]:
        """(full-layer slots a reservation may take: free and evictable, sliding-layer slots free); a plain pool's
        second is its first."""
        full = self.token_allocator.full_available_size() if self.swa_tail() is not None \
            else self.token_allocator.available_size()
        full += self.tree_cache.evictable_size()
        swa = self.token_allocator.swa.available_size() if self.swa_tail() is not None else full
        return full, swa

    # --- checks ------------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise AssertionError unless free + evictable + locked == pool size (call with nothing running)."""
        self.tree_cache.check_integrity()

    def check_idle_integrity(self) -> None:
        """`check_integrity`, and every request row free (call when no request is admitted at all)."""
        self.check_integrity()
        free_rows = self.req_to_token_pool.available_size()
        if free_rows != self.request_slots:
            raise AssertionError(f"request-row leak: {free_rows} free of {self.request_slots}")
