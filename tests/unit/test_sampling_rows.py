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
        self.pending_tokens = 0  # generated tokens not in output_ids yet (0 or 1 here)
        self.pending_token = -1  # the token behind pending_tokens, known to the "forward side" only
        self.name = f"q{i}"


def _reference(reqs: list[FakeReq]) -> SamplingBatchInfo:
    return SamplingBatchInfo.from_requests(
        [r.sampling_params for r in reqs], [r.origin_input_ids for r in reqs], [r.output_ids for r in reqs],
        VOCAB, EOS, torch.device("cpu"), pending_outputs=[r.pending_tokens > 0 for r in reqs])


def _assert_same(got: SamplingBatchInfo, want: SamplingBatchInfo) -> None:
    for name in ("temperatures", "top_ks", "top_ps", "min_ps", "is_greedy", "seeds", "has_seed", "output_lens",
                 "frequency_penalties", "presence_penalties", "repetition_penalties", "output_counts", "seen_mask",
                 "logit_bias", "max_new_tokens", "min_new_tokens", "eos_active", "needs_text_check"):
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


def _forward_side(info: SamplingBatchInfo, reqs: list[FakeReq]) -> None:
    """What `ModelWorker.execute` does before sampling: count pending tokens unless the state was carried."""
    pending = [i for i, r in enumerate(reqs) if r.pending_tokens > 0]
    if pending and info.output_counts is not None and not info.penalties_carried:
        info.add_pending_tokens(torch.tensor(pending), torch.tensor([reqs[i].pending_token for i in pending]))


def _reference_after_pending(reqs: list[FakeReq]) -> SamplingBatchInfo:
    want = _reference(reqs)
    _forward_side(want, reqs)
    return want


def _sample(info: SamplingBatchInfo, reqs: list[FakeReq], rng: random.Random, is_decode: bool) -> list[int]:
    """The step's tokens; a decode step counts them into the penalty state, as `ModelWorker.execute` does."""
    tokens = [rng.randrange(VOCAB) for _ in reqs]
    if is_decode and info.output_counts is not None:
        info.add_pending_tokens(torch.arange(len(reqs)), torch.tensor(tokens))
    return tokens


@pytest.mark.parametrize("seed", range(8))
def test_incremental_rows_match_rebuild(seed):
    rng = random.Random(seed)
    rows = SamplingRows(VOCAB, EOS, torch.device("cpu"))
    pool = [FakeReq(rng, i) for i in range(40)]
    batch: list[FakeReq] = []
    fast_steps = carried_steps = 0
    for _ in range(150):
        action = rng.random()
        if action < 0.15 and len(batch) < 20:  # requests join (after an extend step)
            joining = [pool.pop() for _ in range(rng.randint(1, 3)) if pool]
            if joining:
                info = rows.info_for(joining, is_decode=False)
                _forward_side(info, joining)
                _assert_same(info, _reference_after_pending(joining))
                for r, tok in zip(joining, _sample(info, joining, rng, is_decode=False), strict=True):
                    r.output_ids.append(tok)
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
        carried_steps += info.penalties_carried
        _forward_side(info, batch)
        _assert_same(info, _reference_after_pending(batch))
        tokens = _sample(info, batch, rng, is_decode=True)
        for r, tok in zip(batch, tokens, strict=True):  # the step's token: pending until the next step if overlapped
            if r.pending_tokens:
                r.output_ids.append(r.pending_token)
                r.pending_tokens = 0
            if overlapped:
                r.pending_tokens, r.pending_token = 1, tok
            else:
                r.output_ids.append(tok)
    assert fast_steps > 10  # the steady state took the no-rebuild path
    assert carried_steps > 3  # ... and carried the penalty state


def test_unchanged_decode_batch_does_not_rebuild():
    rng = random.Random(0)
    reqs = [FakeReq(rng, i) for i in range(5)]
    reqs[0].sampling_params.frequency_penalty = 0.5  # so the penalty state exists and is carried
    rows = SamplingRows(VOCAB, EOS, torch.device("cpu"))
    info = rows.info_for(reqs, is_decode=True)
    for step in range(4):
        info.add_pending_tokens(torch.arange(len(reqs)), torch.full((len(reqs),), step + 1))  # the forward side
        for r in reqs:
            r.output_ids.append(step + 1)
        info = rows.info_for(reqs, is_decode=True)
        assert info.penalties_carried
        _assert_same(info, _reference(reqs))
    assert rows.rebuilds == 1
