"""Layers written for parallelism: a model split into layer ranges (pipeline stages) and a model sharded
over two tensor-parallel processes (gloo) give the logits of the unsplit, single-process model."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.forward_steps import ForwardSteps
from tokenloom.config import ServerArgs
from tokenloom.distributed.parallel_state import ParallelContext
from tokenloom.executor.model_runner import ModelRunner
from tokenloom.forward_batch import ForwardBatch, ForwardMode

PROMPT = list(range(5, 60, 2))


def _args(folder: str) -> ServerArgs:
    return ServerArgs(model_path=folder, dtype="float32", max_total_tokens=512, max_running_requests=2)


def _reference(folder: str) -> torch.Tensor:
    steps = ForwardSteps(ModelRunner(_args(folder)))
    seq = steps.start()
    return steps.extend([seq], [PROMPT], return_all_logits=True)


def _extend_batch(runner: ModelRunner) -> ForwardBatch:
    row = runner.req_to_token_pool.alloc(1)
    slots = runner.token_allocator.alloc(len(PROMPT))
    n = torch.tensor([len(PROMPT)])
    return ForwardBatch.build(ForwardMode.EXTEND, torch.tensor(PROMPT), torch.tensor(row), torch.tensor([0]), n,
                              slots, return_all_logits=True)


def test_pipeline_stages_match_full_model(tiny_model_dir):
    folder, _ = tiny_model_dir("llama")
    stage0 = ModelRunner(_args(folder), start_layer=0, end_layer=1)
    stage1 = ModelRunner(_args(folder), start_layer=1, end_layer=2)
    assert not hasattr(stage0.model, "norm") and stage1.model.embed_tokens is None
    assert len(stage0.kv_pool.k_buffers) == 1 and len(stage1.kv_pool.k_buffers) == 1
    proxy = stage0.forward(_extend_batch(stage0))
    assert set(proxy) == {"hidden_states", "residual"}
    batch = _extend_batch(stage1)
    batch.pp_proxy = proxy
    logits = stage1.forward(batch)
    assert (logits - _reference(folder)).abs().max().item() < 2e-5


def _tp_worker(rank: int, port: int, folder: str, out: dict) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        torch.set_num_threads(1)
        ctx = ParallelContext(tp_rank=rank, tp_size=2, tp_group=dist.group.WORLD)
        runner = ModelRunner(_args(folder), parallel=ctx)
        steps = ForwardSteps(runner)
        seq = steps.start()
        logits = steps.extend([seq], [PROMPT], return_all_logits=True)
        out[rank] = logits.clone()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("variant", ["llama", "qwen2"])
def test_tensor_parallel_two_ranks_match_tp1(tiny_model_dir, variant):
    folder, _ = tiny_model_dir(variant)
    reference = _reference(folder)
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        out = manager.dict()
        port = _free_port()
        procs = [ctx.Process(target=_tp_worker, args=(r, port, folder, out)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=120)
        assert all(p.exitcode == 0 for p in procs)
        results = dict(out)
    for rank in range(2):
        assert (results[rank] - reference).abs().max().item() < 2e-5
