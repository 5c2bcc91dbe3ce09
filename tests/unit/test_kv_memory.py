"""`KVMemory`: sizing from the flags, the memory budget, the TP shard and the layer range (numbers worked out
by hand here), the prefix-cache choice, and the integrity checks. No model."""

from __future__ import annotations

import pytest
import torch

from tokenloom.cache.chunk_cache import ChunkCache
from tokenloom.cache.kv_memory import REQ_TO_TOKEN_SLACK, KVMemory
from tokenloom.cache.memory_budget import MemoryBudgetError
from tokenloom.cache.radix_cache import RadixCache
from tokenloom.config import ServerArgs
from tokenloom.distributed.parallel_state import SINGLE_PROCESS, ParallelContext
from tokenloom.model_config import ModelConfig

CPU = torch.device("cpu")
MIB = 2**20
# 4 layers, 4 kv heads of dim 8: K+V of one token in float32 = 4 layers * 2 * 4 * 8 * 4 bytes = 1024 bytes.
CONFIG = ModelConfig(architecture="LlamaForCausalLM", vocab_size=100, hidden_size=64, intermediate_size=128,
                     num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=8,
                     rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=1024,
                     tie_word_embeddings=False, attention_bias=False)


def build(parallel: ParallelContext = SINGLE_PROCESS, layers: tuple[int, int] = (0, 4), memory: int = 64 * MIB,
          weights: int = 4 * MIB, **flags) -> KVMemory:
    return KVMemory.from_server_args(ServerArgs(**flags), CONFIG, torch.float32, CPU, parallel, *layers,
                                     memory_at_start=memory, weight_bytes=weights)


def test_max_total_tokens_sets_the_capacity_and_the_request_table():
    memory = build(max_total_tokens=1000, max_running_requests=7)
    assert memory.max_total_num_tokens == 1000 and memory.token_allocator.available_size() == 1000
    assert memory.request_slots == 7 and memory.page_size == 1 and memory.context_len == 1024
    assert memory.req_to_token_pool.req_to_token.shape == (7, 1024 + REQ_TO_TOKEN_SLACK)
    assert len(memory.kv_pool.k_buffers) == 4
    assert memory.kv_pool.k_buffers[0].shape == (4, 1001, 8)  # + the dummy slot
    assert isinstance(memory.tree_cache, RadixCache) and memory.tree_cache.allocator is memory.token_allocator


def test_request_slots_scale_with_the_pool_between_256_and_4096():
    assert build(max_total_tokens=1000).request_slots == 500  # 1000 * 512 // 1024
    assert build(max_total_tokens=100).request_slots == 256
    assert build(max_total_tokens=10_000).request_slots == 4096


def test_memory_budget_cpu_default_and_mem_fraction_static():
    assert build().max_total_num_tokens == 60 * MIB // 4 // 1024  # a quarter of what the weights left
    assert build(mem_fraction_static=0.5).max_total_num_tokens == 28 * MIB // 1024  # 0.5 * 64 MiB - 4 MiB
    with pytest.raises(MemoryBudgetError, match="the weights alone take"):
        build(mem_fraction_static=0.05)
    with pytest.raises(ValueError, match="needs memory_at_start and weight_bytes"):
        KVMemory.from_server_args(ServerArgs(), CONFIG, torch.float32, CPU, SINGLE_PROCESS, 0, 4)


def test_pages_round_the_capacity_down_and_too_small_a_pool_is_an_error():
    memory = build(page_size=16, weights=4 * MIB + 1000)
    assert memory.max_total_num_tokens == (60 * MIB - 1000) // 4 // 1024 // 16 * 16
    assert memory.page_size == 16 and memory.kv_pool.k_buffers[0].shape[1] == memory.max_total_num_tokens + 16
    with pytest.raises(RuntimeError, match="KV pool would hold only"):
        build(memory=4 * MIB + 4096, page_size=16)


def test_tp_shard_and_layer_range_shrink_the_per_token_bytes():
    tp2 = build(ParallelContext(tp_size=2, tp_rank=1))
    assert tp2.kv_pool.num_kv_heads == 2 and tp2.max_total_num_tokens == 60 * MIB // 4 // 512
    stage = build(layers=(1, 3))
    assert (stage.kv_pool.start_layer, stage.kv_pool.end_layer, len(stage.kv_pool.v_buffers)) == (1, 3, 2)
    assert stage.max_total_num_tokens == 60 * MIB // 4 // 512


def test_disable_radix_cache_gives_the_chunk_cache():
    assert isinstance(build(max_total_tokens=64, disable_radix_cache=True).tree_cache, ChunkCache)


def test_integrity_checks_catch_held_slots_and_rows():
    memory = build(max_total_tokens=64, max_running_requests=4)
    memory.check_idle_integrity()
    slots = memory.token_allocator.alloc(5)
    with pytest.raises(AssertionError, match="KV leak"):
        memory.check_integrity()
    memory.token_allocator.free(slots)
    rows = memory.req_to_token_pool.alloc(1)
    memory.check_integrity()
    with pytest.raises(AssertionError, match="request-row leak"):
        memory.check_idle_integrity()
    memory.req_to_token_pool.free(rows)
    memory.check_idle_integrity()


def test_parts_that_disagree_are_refused():
    a, b = build(max_total_tokens=64), build(max_total_tokens=128)
    with pytest.raises(ValueError, match="disagree"):
        KVMemory(a.req_to_token_pool, a.token_allocator, b.kv_pool, a.tree_cache, 1024)
    with pytest.raises(ValueError, match="disagree"):
        KVMemory(a.req_to_token_pool, a.token_allocator, a.kv_pool, b.tree_cache, 1024)


@pytest.mark.parametrize("value, dtype", [("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)])
def test_fp8_kv_cache_dtype_is_the_pools_dtype_and_holds_four_times_the_float32_tokens(value, dtype):
    """One byte per element: the same budget holds 4x the float32 tokens (2x bf16's)."""
    memory = build(kv_cache_dtype=value)
    assert memory.kv_pool.dtype == dtype and memory.kv_pool.buffer.dtype == dtype
    assert memory.kv_pool.buffer.element_size() == 1
    assert memory.max_total_num_tokens == 60 * MIB // 4 // 256
    assert build(kv_cache_dtype="auto").kv_pool.dtype == torch.float32


def test_fp8_pool_writes_saturating_casts_and_reads_them_back():
    """set_kv stores round-to-nearest-even casts with scale 1.0; out-of-range values saturate (never inf/NaN)."""
    for value, dtype, limit in (("fp8_e4m3", torch.float8_e4m3fn, 448.0), ("fp8_e5m2", torch.float8_e5m2, 57344.0)):
        pool = build(kv_cache_dtype=value, max_total_tokens=16).kv_pool
        k = torch.randn(3, 4, 8) * 10
        k[0, 0, :4] = torch.tensor([1e6, -1e6, float("inf"), 300.0])
        v = torch.randn(3, 4, 8)
        slots = torch.tensor([5, 2, 9])
        pool.set_kv(1, slots, k, v)
        k_buf, v_buf = pool.get_kv(1)
        got_k = k_buf.index_select(1, slots).transpose(0, 1).float()
        want_k = k.to(dtype).float()
        want_k[0, 0, :3] = torch.tensor([limit, -limit, limit])
        assert torch.isfinite(got_k).all()
        assert torch.equal(got_k, want_k)
        assert torch.equal(v_buf.index_select(1, slots).transpose(0, 1).float(), v.to(dtype).float())
        assert (k_buf[:, 0].float() == 0).all()  # untouched slots stay zero


def test_fp8_pool_per_tp_rank_and_pipeline_stage():
    """Each TP rank and PP stage builds its own fp8 pool: its heads / layers at one byte per element."""
    tp2 = build(ParallelContext(tp_size=2, tp_rank=1), kv_cache_dtype="fp8_e4m3")
    assert tp2.kv_pool.dtype == torch.float8_e4m3fn and tp2.kv_pool.k_buffers[0].shape[0] == 2
    assert tp2.max_total_num_tokens == 60 * MIB // 4 // 128  # 4 layers * 2 * 2 heads * 8 dims * 1 byte
    stage = build(layers=(2, 4), kv_cache_dtype="fp8_e5m2")
    assert stage.kv_pool.dtype == torch.float8_e5m2 and len(stage.kv_pool.k_buffers) == 2
    assert stage.kv_pool.layout(0).itemsize == 1 and stage.kv_pool.layout(0).dtype == "float8_e5m2"


@pytest.mark.parametrize("value", ["auto", "fp8_e4m3", "fp8_e5m2"])
def test_read_and_write_slots_round_trip(value):
    """What a PD decode server's retraction to host memory copies out and back (disaggregation/decode.py)."""
    pool = build(kv_cache_dtype=value, max_total_tokens=32).kv_pool
    for layer in range(4):
        pool.set_kv(layer, torch.arange(1, 9), torch.randn(8, 4, 8), torch.randn(8, 4, 8))
    saved = pool.read_slots(torch.tensor([2, 3, 7]))
    assert saved.shape == (4, 2, 4, 3, 8) and saved.dtype == pool.dtype
    pool.write_slots(torch.tensor([20, 21, 22]), saved)
    assert torch.equal(pool.buffer[:, :, :, 20:23].float(), pool.buffer[:, :, :, [2, 3, 7]].float())
    with pytest.raises(ValueError, match="cannot be written"):
        pool.write_slots(torch.tensor([20]), saved[:, :, :, :1].float().to(torch.float16))
