"""`SamplingBatchInfo.finish_candidates` (the batch's stop conditions as tensor ops) against `Req.check_finished`
run on every request: no request that finishes may be missed, and without stop strings / stop ids the
candidates are exactly the requests that finish."""

from __future__ import annotations

import random

import pytest
import torch

from tokenloom.sampling.sampling_batch import SamplingBatchInfo
from tokenloom.sampling.sampling_params import SamplingParams
from tokenloom.sampling.sampling_rows import SamplingRows
from tokenloom.scheduler.req import Req

VOCAB = 32
EOS = (2, 3)


def random_req(rng: random.Random, i: int, with_text_stops: bool) -> Req:
    max_new = rng.randint(1, 8)
    params = {"max_new_tokens": max_new, "min_new_tokens": rng.choice([0, 0, rng.randint(0, max_new)]),
              "ignore_eos": rng.random() < 0.3}
    if with_text_stops and rng.random() < 0.3:
        params["stop_token_ids"] = [rng.randrange(VOCAB)]
    if with_text_stops and rng.random() < 0.2:
        params["stop"] = ["x"]
    req = Req(f"r{i}", [1, 5, 7], SamplingParams.from_dict(params, VOCAB), eos_token_ids=EOS)
    req.output_ids = [rng.choice([4, 9, 11]) for _ in range(rng.randint(0, max_new - 1))]
    return req


@pytest.mark.parametrize("with_text_stops", [False, True])
@pytest.mark.parametrize("seed", range(25))
def test_candidates_cover_every_finish(seed, with_text_stops):
    rng = random.Random(seed)
    reqs = [random_req(rng, i, with_text_stops) for i in range(rng.randint(1, 40))]
    # Tokens drawn mostly from the EOS ids and the stop id range, so every condition fires somewhere.
    tokens = [rng.choice([2, 3, rng.randrange(VOCAB)]) for _ in reqs]
    infos = [SamplingRows(VOCAB, EOS, torch.device("cpu")).info_for(reqs, is_decode=True),
             SamplingBatchInfo.from_requests([r.sampling_params for r in reqs], [r.origin_input_ids for r in reqs],
                                             [r.output_ids for r in reqs], VOCAB, EOS, torch.device("cpu"))]
    candidate_sets = [set(info.finish_candidates(torch.tensor(tokens), torch.tensor(EOS))) for info in infos]
    assert candidate_sets[0] == candidate_sets[1]
    finished = set()
    for i, (req, tok) in enumerate(zip(reqs, tokens, strict=True)):
        req.output_ids.append(tok)
        req.check_finished(lambda n, r=req: "x" * n)  # a text that always holds the stop string "x"
        if req.finished:
            finished.add(i)
    assert finished <= candidate_sets[0]
    if not with_text_stops:
        assert finished == candidate_sets[0]
    assert finished  # the random cases do exercise finishing


def test_no_rows_when_nothing_can_finish():
    params = SamplingParams.from_dict({"max_new_tokens": 10}, VOCAB)
    reqs = [Req("a", [1], params, eos_token_ids=EOS), Req("b", [1], params, eos_token_ids=EOS)]
    info = SamplingRows(VOCAB, EOS, torch.device("cpu")).info_for(reqs, is_decode=True)
    assert info.finish_candidates(torch.tensor([4, 5]), torch.tensor(EOS)) == []
    assert info.finish_candidates(torch.tensor([4, 3]), torch.tensor(EOS)) == [1]
