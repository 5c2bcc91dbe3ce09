"""One `KVMemory` per rank, handed to both the model runner and the scheduler (as the rank process does):
both see the same request table, allocator and pool; a runner given a memory uses it, and refuses one
shaped for other layers, heads or dtype. Tiny random model, in-process."""

from __future__ import annotations

import pytest
import torch

from tests.scheduler_harness import Harness, generate_in_process
from tokenloom.cache.kv_memory import KVMemory
from tokenloom.config import ServerArgs
from tokenloom.executor.model_runner import LoadedModel, ModelRunner

GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def folder(tiny_model_dir):
    return tiny_model_dir("llama")[0]


def _args(folder: str, **kw) -> ServerArgs:
    return ServerArgs(model_path=folder, **{"dtype": "float32", "max_total_tokens": 256, "max_running_requests": 4,
                                            **kw})


def test_runner_and_scheduler_share_one_memory(folder):
    h = Harness(folder)
    memory = h.scheduler.kv_memory
    assert h.runner.memory is memory
    assert h.runner.attn_backend.req_to_token_pool is memory.req_to_token_pool
    assert h.runner.attn_backend.kv_pool is memory.kv_pool
    assert h.scheduler.allocator is memory.token_allocator and h.scheduler.tree_cache is memory.tree_cache
    h.submit("a", list(range(1, 20)), dict(GREEDY, max_new_tokens=3))
    h.run(until=lambda hh: memory.token_allocator.available_size() < memory.max_total_num_tokens)
    assert memory.req_to_token_pool.available_size() == memory.request_slots - 1  # the scheduler took a row
    assert h.run()["a"].output_ids and memory.tree_cache.evictable_size() > 0  # its KV went to the cache
    h.assert_pools_full()


def test_runner_uses_the_memory_it_is_given(folder):
    args = _args(folder)
    loaded = LoadedModel.load(args)
    cfg = loaded.source.config
    memory = KVMemory.build(tokens=96, request_slots=2, context_len=cfg.context_length, page_size=1,
                            num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, dtype=torch.float32,
                            device=torch.device("cpu"), start_layer=0, end_layer=cfg.num_hidden_layers)
    runner = ModelRunner(args, loaded=loaded, memory=memory)
    assert runner.memory is memory and runner.max_total_num_tokens == 96 and runner.kv_pool is memory.kv_pool
    params = dict(GREEDY, max_new_tokens=4)
    given = generate_in_process(runner, [[1, 2, 3, 4, 5]], [params], [0])
    own = generate_in_process(ModelRunner(args, loaded=loaded), [[1, 2, 3, 4, 5]], [params], [0])
    assert given == own and len(given[0]) == 4
    memory.check_idle_integrity()


@pytest.mark.parametrize("change", [dict(end_layer=1), dict(num_kv_heads=1), dict(dtype=torch.bfloat16),
                                    dict(context_len=64)])
def test_runner_refuses_a_memory_shaped_for_another_model(folder, change):
    args = _args(folder)
    loaded = LoadedModel.load(args)
    cfg = loaded.source.config
    shape = dict(tokens=64, request_slots=2, context_len=cfg.context_length, page_size=1,
                 num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, dtype=torch.float32,
                 device=torch.device("cpu"), start_layer=0, end_layer=cfg.num_hidden_layers)
    with pytest.raises(ValueError, match="KVMemory"):
        ModelRunner(args, loaded=loaded, memory=KVMemory.build(**{**shape, **change}))
