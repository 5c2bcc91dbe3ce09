"""In-batch prefix caching at admission: requests that arrive together sharing a prefix nobody has cached
compute it once (the first one prefills it, the others wait a step and hit the cache), with either policy
and with or without the overlap scheduler; their outputs equal those with the radix cache off."""

from __future__ import annotations

import pytest
import torch

from tests.scheduler_harness import Harness

SHARED = 64


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    groups = [torch.randint(3, 49152, (SHARED,), generator=g).tolist() for _ in range(2)]
    # two groups of three, interleaved as they arrive, plus one unrelated prompt
    prompts = [groups[i % 2] + torch.randint(3, 49152, (5 + i,), generator=g).tolist() for i in range(6)]
    return prompts + [torch.randint(3, 49152, (40,), generator=g).tolist()]


def _run(folder: str, **server_args) -> dict:
    h = Harness(folder, eos=(2,), **server_args)
    for i, ids in enumerate(_prompts()):
        h.submit(f"r{i}", ids, {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True})
    results = h.run()
    h.assert_pools_full()
    return results


@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
@pytest.mark.parametrize("overlap", ["off", "on"])
def test_shared_prefix_computed_once(tiny_runtime_model, policy, overlap):
    results = _run(tiny_runtime_model, schedule_policy=policy, overlap_schedule=overlap)
    cached = [results[f"r{i}"].meta["cached_tokens"] for i in range(7)]
    # the first of each group computes the prefix; the other two of each group find all of it cached
    assert cached[0] == 0 and cached[1] == 0 and cached[6] == 0, cached
    assert all(c >= SHARED for c in cached[2:6]), cached
    reference = _run(tiny_runtime_model, disable_radix_cache=True)
    assert all(reference[f"r{i}"].meta["cached_tokens"] == 0 for i in range(7))
    for i in range(7):
        assert results[f"r{i}"].output_ids == reference[f"r{i}"].output_ids, i
