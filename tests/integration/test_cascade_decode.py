"""Cascade decode in the scheduler: requests that share a cached prompt prefix decode with the shared KV read
once per group (`--attention-backend cpu`), and give the same greedy tokens as with
`--disable-cascade-attention` (every request reading its own KV) and as each request run alone."""

from __future__ import annotations

import pytest
import torch

from tests.scheduler_harness import Harness
from tokenloom.kernels import paged_attention

pytestmark = pytest.mark.skipif(not paged_attention.available(torch.float32, 4, 64),
                                reason="native kernels unavailable (no C compiler)")


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(3, 49152, (96,), generator=g).tolist()
    return [shared + torch.randint(3, 49152, (int(n),), generator=g).tolist() for n in (5, 9, 1, 30, 12, 7, 3)]


def _run(folder: str, prompts: list[list[int]], **server_args) -> list[list[int]]:
    h = Harness(folder, eos=(2,), attention_backend="cpu", **server_args)
    # the first request warms the radix cache, the others then match its prefix and decode together
    h.submit("r0", prompts[0], {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True})
    h.run()
    for i, ids in enumerate(prompts[1:], start=1):
        h.submit(f"r{i}", ids, {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True})
    results = h.run()
    return [results[f"r{i}"].output_ids for i in range(1, len(prompts))]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cascade_matches_separate_reads(tiny_runtime_model, monkeypatch, dtype):
    prompts = _prompts()
    planned = []
    real_plan = paged_attention.plan_shared_prefixes

    def spy(*args, **kwargs):
        plan = real_plan(*args, **kwargs)
        planned.append(0 if plan is None else plan.groups)
        return plan

    monkeypatch.setattr(paged_attention, "plan_shared_prefixes", spy)
    cascade = _run(tiny_runtime_model, prompts, dtype=dtype)
    assert max(planned) >= 1  # the decode steps did group the requests sharing the prefix
    planned.clear()
    separate = _run(tiny_runtime_model, prompts, dtype=dtype, disable_cascade_attention=True)
    assert not planned
    assert cascade == separate
    alone = [_run(tiny_runtime_model, [p, p], dtype=dtype)[0] for p in prompts[1:3]]
    assert alone == cascade[:2]
