"""Pipeline stages as separate processes: each rank loads only its layers (`pp_partition.stage_layers`) and its
KV pool holds only those layers; hidden states go stage to stage and the sampled token returns along the ring
to stage 0 through `PPChannel` over the world's gloo group. Greedy tokens and every step's logits equal the
unsplit single-process model's (fp32), at PP=2 and PP=3 (SGLang's split: [1, 2] layers of 3)."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from tests.e2e.server_process import free_port
from tests.forward_steps import ForwardSteps
from tests.model_factory import make_tiny_with_smollm2_tokenizer
from tokenloom.config import ServerArgs
from tokenloom.distributed.groups import destroy_distributed, init_distributed
from tokenloom.distributed.pp_channel import PPChannel
from tokenloom.distributed.pp_partition import stage_layers
from tokenloom.executor.model_runner import ModelRunner

PROMPT = list(range(5, 60, 2))
STEPS = 6
LAYERS = 3


def _args(folder: str) -> ServerArgs:
    return ServerArgs(model_path=folder, dtype="float32", max_total_tokens=512, max_running_requests=2,
                      num_threads=1)


def _stage(rank: int, pp: int, port: int, folder: str, results: dict) -> None:
    torch.set_num_threads(1)
    ctx = init_distributed(1, pp, rank, f"127.0.0.1:{port}", "cpu", init_timeout_s=60, op_timeout_s=60)
    try:
        start, end = stage_layers(LAYERS, rank, pp)
        runner = ModelRunner(_args(folder), ctx, start_layer=start, end_layer=end)
        assert len(runner.kv_pool.k_buffers) == end - start
        channel = PPChannel(ctx.world_cpu_group, ctx.pp_next_rank, ctx.pp_prev_rank)
        steps = ForwardSteps(runner)
        seq = steps.start()
        tokens, sampled, logits = PROMPT, [], []
        for _ in range(STEPS):
            proxy = None if ctx.is_first_stage else channel.recv("proxy")
            out = steps.extend([seq], [tokens], pp_proxy=proxy)
            if not ctx.is_last_stage:
                channel.isend("proxy", out)
                token = int(channel.recv("output")["next_token_ids"][0])  # from the last stage, via the ring
                if rank + 1 < pp - 1:  # pass it on to the stages that have not seen it (the last made it)
                    channel.isend("output", {"next_token_ids": torch.tensor([token])})
            else:
                logits.append(out[-1].clone())
                token = int(out[-1].argmax())
                channel.isend("output", {"next_token_ids": torch.tensor([token])})  # to stage 0: the ring
            sampled.append(token)
            tokens = [token]
        channel.wait_send()
        results[rank] = {"tokens": sampled, "logits": torch.stack(logits) if logits else None,
                         "layers": (start, end)}
    finally:
        destroy_distributed()


@pytest.fixture(scope="module")
def three_layer_model(tmp_path_factory) -> str:
    return make_tiny_with_smollm2_tokenizer(str(tmp_path_factory.mktemp("tiny_3layers")), num_hidden_layers=LAYERS)


@pytest.fixture(scope="module")
def reference(three_layer_model) -> tuple[list[int], torch.Tensor]:
    steps = ForwardSteps(ModelRunner(_args(three_layer_model)))
    seq = steps.start()
    tokens, sampled, logits = PROMPT, [], []
    for _ in range(STEPS):
        out = steps.extend([seq], [tokens])
        logits.append(out[-1].clone())
        sampled.append(int(out[-1].argmax()))
        tokens = [sampled[-1]]
    return sampled, torch.stack(logits)


@pytest.mark.parametrize("pp", [2, 3])
def test_stages_in_processes_equal_the_unsplit_model(three_layer_model, reference, pp):
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        port = free_port()
        procs = [ctx.Process(target=_stage, args=(r, pp, port, three_layer_model, results)) for r in range(pp)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=120)
        assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
        results = dict(results)
    ref_tokens, ref_logits = reference
    assert [results[r]["layers"] for r in range(pp)] == ([(0, 1), (1, 3)] if pp == 2 else [(0, 1), (1, 2), (2, 3)])
    for r in range(pp):
        assert results[r]["tokens"] == ref_tokens
    assert (results[pp - 1]["logits"] - ref_logits).abs().max().item() < 2e-5
