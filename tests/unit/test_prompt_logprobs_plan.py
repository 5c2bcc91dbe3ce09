"""Prompt logprobs without a model: which logits rows an extend step computes (`plan_logits`), how they are read
back (`read_logits`, against a log_softmax written out here), and the caller-side shapes (`LogprobAccumulator`)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from tokenloom.executor.prompt_logprobs import plan_logits, read_logits, token_ids_logprobs
from tokenloom.frontend.logprob_accumulator import LogprobAccumulator

CPU = torch.device("cpu")


def req(prompt: list[int], k: int = -1, top: int = 0, token_ids: list[int] | None = None, done: bool = False):
    return SimpleNamespace(wants_input_logprobs=k >= 0 and not done, logprob_start_len=k, origin_input_ids=prompt,
                           top_logprobs_num=top, token_ids_logprob=token_ids)


def test_no_plan_when_nobody_asks():
    assert plan_logits([req([1, 2, 3]), req([4, 5], k=0, done=True)], [0, 0], [3, 2], CPU) is None


def test_mixed_batch_adds_rows_only_for_the_asking_request():
    # a: 4 new tokens, no logprobs; b: prompt of 6, k=2, computed whole; c: 3 new tokens, no logprobs
    plan = plan_logits([req([1] * 4), req(list(range(10, 16)), k=2), req([7] * 3)], [0, 0, 0], [4, 6, 3], CPU)
    # tokens: a at 0..3, b at 4..9, c at 10..12. b scores positions 2..4 (tokens 3..5), then its last row 9
    assert plan.rows.tolist() == [3, 6, 7, 8, 9, 12]
    assert plan.sample_index.tolist() == [0, 4, 5]
    assert plan.scored_index.tolist() == [1, 2, 3]
    assert plan.targets.tolist() == [13, 14, 15]
    assert [(s.batch_index, s.start, s.count) for s in plan.spans] == [(1, 2, 3)]


def test_chunks_cover_each_position_once():
    prompt = list(range(100, 120))  # 20 tokens, k=3: positions 3..18 score tokens 4..19
    r = req(prompt, k=3)
    covered = []
    for s, e in [(0, 2), (2, 8), (8, 16), (16, 20)]:
        plan = plan_logits([r], [s], [e], CPU)
        starts = [sp.start for sp in plan.spans]
        counts = [sp.count for sp in plan.spans]
        covered += [p for st, c in zip(starts, counts, strict=True) for p in range(st, st + c)]
        last = e - s - 1
        assert plan.rows[plan.sample_index[0]].item() == last  # sampling always reads the chunk's last token
        if e < 20 and plan.spans:  # a non-final chunk's last row is scored too: one row serves both
            assert plan.scored_index[-1].item() == plan.sample_index[0].item()
    assert covered == list(range(3, 19))


def test_cached_prefix_and_start_at_the_last_token():
    prompt = list(range(30))
    plan = plan_logits([req(prompt, k=12)], [12], [30], CPU)  # cache capped at k: positions 12..28
    assert (plan.spans[0].start, plan.spans[0].count) == (12, 17)
    assert plan_logits([req(prompt, k=29)], [0], [30], CPU).spans == []  # only the null entry: nothing to score


def test_read_logits_against_log_softmax():
    g = torch.Generator().manual_seed(0)
    vocab = 11
    a, b = req([1, 2, 3]), req([4, 5, 6, 7, 8], k=1, top=3, token_ids=[0, 10, 5])
    plan = plan_logits([a, b], [0, 0], [3, 5], CPU)
    logits = torch.randn(plan.rows.numel(), vocab, generator=g)
    sample, chunks = read_logits(plan, logits)
    assert torch.equal(sample, logits[[0, 4]])
    assert chunks[0] is None
    chunk = chunks[1]
    ref = logits[1:4].double()
    ref = ref - ref.exp().sum(-1, keepdim=True).log()  # log_softmax by hand
    targets = [6, 7, 8]  # positions 1..3 score tokens 2..4 of b
    assert chunk.start == 1
    assert torch.allclose(torch.tensor(chunk.values, dtype=torch.float64), ref[range(3), targets], atol=1e-6)
    for pos, row in zip(chunk.top, ref, strict=True):
        ids = row.argsort(descending=True)[:3].tolist()
        assert [t for _, t in pos] == ids
        assert torch.allclose(torch.tensor([v for v, _ in pos], dtype=torch.float64), row[ids], atol=1e-6)
    assert torch.allclose(torch.tensor(chunk.token_ids, dtype=torch.float64), ref[:, [0, 10, 5]], atol=1e-6)
    out = token_ids_logprobs(sample, [None, [0, 10, 5]])
    last = sample[1].double() - sample[1].double().exp().sum().log()
    assert out[0] is None and torch.allclose(torch.tensor(out[1], dtype=torch.float64), last[[0, 10, 5]], atol=1e-6)


def test_accumulator_shapes_and_persistence():
    acc = LogprobAccumulator(input_logprobs=True, top_logprobs=True, token_ids_logprob=[3, 9])
    first = {"output_token_logprobs": [(-0.5, 7)], "output_top_logprobs": [[(-0.5, 7), (-1.0, 3)]],
             "output_token_ids_logprobs": [[-2.0, -3.0]],
             "input_token_logprobs": [(None, 1), (-1.5, 2)], "input_top_logprobs": [None, [(-0.1, 4)]],
             "input_token_ids_logprobs": [None, [-float("inf"), -4.0]]}
    acc.apply(first)
    assert first["input_token_logprobs"] == [[None, 1, None], [-1.5, 2, None]]
    assert first["input_top_logprobs"] == [None, [[-0.1, 4, None]]]
    assert first["input_token_ids_logprobs"] == [None, [[-9999.0, 3, None], [-4.0, 9, None]]]
    assert first["output_token_ids_logprobs"] == [[[-2.0, 3, None], [-3.0, 9, None]]]
    second = {"output_token_logprobs": [(-0.25, 8)], "output_top_logprobs": [[(-0.25, 8)]],
              "output_token_ids_logprobs": [[-1.0, -1.0]]}
    acc.apply(second)  # later messages carry no prompt logprobs; the kept ones are repeated
    assert second["input_token_logprobs"] == first["input_token_logprobs"]
    assert second["output_token_logprobs"] == [[-0.5, 7, None], [-0.25, 8, None]]
    assert len(second["output_token_ids_logprobs"]) == 2
    before = {"output_token_logprobs": []}
    LogprobAccumulator(input_logprobs=True).apply(before)  # asked, not arrived yet: present and empty
    assert before == {"output_token_logprobs": [], "input_token_logprobs": []}
    plain = {"output_token_logprobs": [(-1.0, 2)]}
    LogprobAccumulator().apply(plain)
    assert set(plain) == {"output_token_logprobs"}
