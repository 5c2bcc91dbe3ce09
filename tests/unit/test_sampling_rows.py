"""`SamplingRows` (incremental sampling tensors) equals the per-step rebuild `SamplingBatchInfo.from_requests`
after random sequences of steps: requests joining, leaving, reordering, decoding with and without pending
(overlap) tokens, and extend steps in between."""

from __future__ import annotations

import random

import pytest
import torch

from tokenloom.sampling.sampling_batch import SamplingBatchInfo
from tokenloom.sampling.sampling_params import SamplingParams
from tokenloom.sampling.sampling_rows import SamplingRows

VOCAB = 64
EOS = (2, 3)


class FakeReq:
    def __init__(self, rng: random.Random, i: int) -> None:
        params = {"temperature": rng.choice([0, 0.7, 1.2]), "top_k": rng.choice([-1, 5]),
                  "top_p": rng.choice([1.0, 0.8]), "min_p": rng.choice([0.0, 0.1]),
                  "max_new_tokens": 100, "min_new_tokens": rng.choice([0, 0, 3, 6]),
                  "ignore_eos": rng.random() < 0.2}
        if rng.random() < 0.3:
            params["sampling_seed"] = rng.randrange(1 << 40)
        if rng.random() < 0.2:
            params["frequency_penalty"] = 0.5
        if rng.random() < 0.1:
            params["logit_bias"] = {"5": 2.0}
        if rng.random() < 0.2:
            params["stop_token_ids"] = [7]
        self.sampling_params = SamplingParams.from_dict(params, VOCAB)
        self.origin_input_ids = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 6))]
        self.output_ids: list[int] = []
        self.future_slot: int | None = None
        self.name = f"q{i}"


def _reference(reqs: list[FakeReq]) -> SamplingBatchInfo:
    return SamplingBatchInfo.from_requests(
        [r.sampling_params for r in reqs], [r.origin_input_ids for r in reqs], [r.output_ids for r in reqs],
        VOCAB, EOS, torch.device("cpu"), pending_outputs=[r.future_slot is not None for r in reqs])


def _assert_same(got: SamplingBatchInfo, want: SamplingBatchInfo) -> None:
    for name in ("temperatures", "top_ks", "top_ps", "min_ps", "is_greedy", "seeds", "has_seed", "output_lens",
                 "frequency_penalties", "output_counts", "seen_mask", "logit_bias"):
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert torch.equal(a, b), name
    assert got.all_greedy == want.all_greedy

    def pairs(info: SamplingBatchInfo) -> set[tuple[int, int]]:
        if info.min_tokens_mask is None:
            return set()
        rows, tokens = info.min_tokens_mask
        return set(zip(rows.tolist(), tokens.tolist(), strict=True))

    assert pairs(got) == pairs(want)


@pytest.mark.parametrize("seed", range(6))
def test_incremental_rows_match_rebuild(seed):
    rng = random.Random(seed)
    rows = SamplingRows(VOCAB, EOS, torch.device("cpu"))
    pool = [FakeReq(rng, i) for i in range(40)]
    batch: list[FakeReq] = []
    fast_steps = 0
    for _ in range(120):
        action = rng.random()
        if action < 0.15 and len(batch) < 20:  # requests join (after an extend step)
            joining = [pool.pop() for _ in range(rng.randint(1, 3)) if pool]
            if joining:
                _assert_same(rows.info_for(joining, is_decode=False), _reference(joining))
                for r in joining:
                    r.output_ids.append(rng.randrange(VOCAB))
                batch += joining
            continue
        if action < 0.25 and batch:  # some finish or are retracted
            for r in rng.sample(batch, rng.randint(1, min(3, len(batch)))):
                batch.remove(r)
        elif action < 0.3 and len(batch) > 1:
            rng.shuffle(batch)
        if not batch:
            continue
        overlapped = rng.random() < 0.5
        before = rows.rebuilds
        info = rows.info_for(batch, is_decode=True)
        fast_steps += rows.rebuilds == before
        _assert_same(info, _reference(batch))
        for r in batch:  # the step's token: pending until the next step when overlapped
            if r.future_slot is not None:
                r.output_ids.append(rng.randrange(VOCAB))
                r.future_slot = None
            if overlapped:
                r.future_slot = 1
            else:
                r.output_ids.append(rng.randrange(VOCAB))
    assert fast_steps > 10  # the steady state took the no-rebuild path


def test_unchanged_decode_batch_does_not_rebuild():
    rng = random.Random(0)
    reqs = [FakeReq(rng, i) for i in range(5)]
    rows = SamplingRows(VOCAB, EOS, torch.device("cpu"))
    rows.info_for(reqs, is_decode=True)
    for _ in range(4):
        for r in reqs:
            r.output_ids.append(1)
        _assert_same(rows.info_for(reqs, is_decode=True), _reference(reqs))
    assert rows.rebuilds == 1
