"""Prompt logprobs (`logprob_start_len` >= 0, `token_ids_logprob`) through the real scheduler, against an
independent reference: transformers' forward of the same tiny checkpoint in float32, log_softmax at each
position. They must not depend on how the prompt was computed: whole or in chunks, paged, with the overlap
scheduler, after a radix-cache hit, or after the request was retracted and recomputed."""

from __future__ import annotations

import pytest
import torch

from tests.scheduler_harness import Harness, Result

TOL = 1e-4  # float32 forward vs float32 forward, different kernels and summation orders
TOP = 3
IDS = [0, 17, 200]  # token_ids_logprob


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in (37, 52, 9, 24)]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return tiny_model_dir("llama")


def reference_logprobs(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] float32 log_softmax of transformers' logits; row p scores token p+1."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def check_prompt(meta: dict, model, prompt: list[int], k: int, top: int = TOP, token_ids: list[int] | None = IDS):
    ref = reference_logprobs(model, prompt)
    entries = meta["input_token_logprobs"]
    assert [t for _, t in entries] == prompt[k:]
    assert entries[0][0] is None  # position k: the logits before it are not computed (SGLang)
    positions = range(k, len(prompt) - 1)  # logits at p score token p+1
    got = torch.tensor([v for v, _ in entries[1:]])
    want = ref[list(positions), prompt[k + 1:]] if positions else torch.empty(0)
    assert torch.allclose(got, want, atol=TOL), (got - want).abs().max()
    if top:
        tops = meta["input_top_logprobs"]
        assert len(tops) == len(entries) and tops[0] is None
        for pos, p in zip(tops[1:], positions, strict=True):
            values, ids = ref[p].topk(top)
            assert [t for _, t in pos] == ids.tolist()
            assert torch.allclose(torch.tensor([v for v, _ in pos]), values, atol=TOL)
    if token_ids is not None:
        by_id = meta["input_token_ids_logprobs"]
        assert len(by_id) == len(entries) and by_id[0] is None
        got = torch.tensor(by_id[1:]).reshape(-1, len(token_ids))
        assert torch.allclose(got, ref[list(positions)][:, token_ids], atol=TOL)


def check_output(res: Result, model, prompt: list[int], token_ids: list[int] | None = IDS):
    """Output logprobs and token_ids logprobs of a greedy continuation, against the reference on prompt+output."""
    ref = reference_logprobs(model, prompt + res.output_ids)
    rows = list(range(len(prompt) - 1, len(prompt) - 1 + len(res.output_ids)))
    got = torch.tensor([v for v, _ in res.meta["output_token_logprobs"]])
    assert torch.allclose(got, ref[rows, res.output_ids], atol=TOL)
    if token_ids is not None:
        got = torch.tensor(res.meta["output_token_ids_logprobs"])
        assert torch.allclose(got, ref[rows][:, token_ids], atol=TOL)


def submit(h: Harness, rid: str, prompt: list[int], k: int, max_new: int = 4, **kw) -> None:
    params = {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}
    h.submit(rid, prompt, params, return_logprob=True, logprob_start_len=k, top_logprobs_num=TOP,
             token_ids_logprob=IDS, **kw)


CONFIGS = {
    "whole": {},
    "chunked_8": dict(chunked_prefill_size=8),
    "chunked_16_paged_4": dict(chunked_prefill_size=16, page_size=4),
    "overlap_chunked_8": dict(chunked_prefill_size=8, overlap_schedule="on"),
    "no_radix_chunked_8": dict(chunked_prefill_size=8, disable_radix_cache=True),
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_prompt_logprobs_match_transformers(tiny, config):
    folder, model = tiny
    h = Harness(folder, **CONFIGS[config])
    prompts = _prompts()
    starts = {"p0": (prompts[0], 0), "p1": (prompts[1], 20), "p2": (prompts[2], 8), "p3": (prompts[3], 5)}
    for rid, (prompt, k) in starts.items():
        submit(h, rid, prompt, k)
    for i, prompt in enumerate(prompts):  # the same prompts without logprobs share the batches
        h.submit(f"plain{i}", prompt, {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True})
    results = h.run()
    h.assert_pools_full()
    for rid, (prompt, k) in starts.items():
        check_prompt(results[rid].meta, model, prompt, k)
        check_output(results[rid], model, prompt)
    for i in range(len(prompts)):
        assert "input_token_logprobs" not in results[f"plain{i}"].meta
    assert results["p0"].output_ids == results["plain0"].output_ids


@pytest.mark.parametrize("page_size", [1, 4])
def test_radix_cache_hit_keeps_positions_from_start_len(tiny, page_size):
    folder, model = tiny
    h = Harness(folder, page_size=page_size)
    prompt = _prompts()[1]  # 52 tokens
    submit(h, "first", prompt, 0)
    first = h.run()["first"]
    check_prompt(first.meta, model, prompt, 0)
    submit(h, "again", prompt, 0)  # fully cached, but position 0 on must be recomputed
    again = h.run()["again"]
    assert again.meta["cached_tokens"] == 0
    assert again.meta["input_token_logprobs"] == first.meta["input_token_logprobs"]
    shared = prompt[:30] + [5, 6, 7, 8, 9, 10, 11, 12]
    submit(h, "inside", shared, 21)  # start inside the cached part: the match stops at it
    inside = h.run()["inside"]
    assert inside.meta["cached_tokens"] == 21 // page_size * page_size
    check_prompt(inside.meta, model, shared, 21)
    h.submit("plain", shared, {"temperature": 0, "max_new_tokens": 1})  # no logprobs: the whole prompt hits
    assert h.run()["plain"].meta["cached_tokens"] == (len(shared) - 1) // page_size * page_size
    h.assert_pools_full()


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_retraction_neither_duplicates_nor_drops(tiny, overlap):
    folder, model = tiny
    h = Harness(folder, max_total_tokens=240, chunked_prefill_size=16, schedule_conservativeness=0.05,
                overlap_schedule=overlap)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (30, 22, 41, 17, 35)]
    for i, prompt in enumerate(prompts):
        submit(h, f"r{i}", prompt, i * 3, max_new=40)
    results = h.run()
    h.assert_pools_full()
    assert any(r.meta["total_retractions"] > 0 for r in results.values()), "the pool should force retraction"
    for i, prompt in enumerate(prompts):
        res = results[f"r{i}"]
        assert len(res.output_ids) == 40
        check_prompt(res.meta, model, prompt, i * 3)
        check_output(res, model, prompt)


def test_scoring_without_generating(tiny):
    folder, model = tiny
    h = Harness(folder, chunked_prefill_size=8)
    prompt = _prompts()[0]
    submit(h, "score", prompt, 0, max_new=0)
    res = h.run()["score"]
    assert res.output_ids == [] and res.finish_reason == {"type": "length", "length": 0}
    assert res.meta["completion_tokens"] == 0 and res.meta["output_token_logprobs"] == []
    check_prompt(res.meta, model, prompt, 0)
    h.assert_pools_full()


def test_scheduler_refuses_a_start_past_the_prompt(tiny):
    """The tokenizer manager refuses it first; a request reaching the scheduler directly is aborted, not a crash."""
    folder, _ = tiny
    h = Harness(folder)
    submit(h, "bad", [5, 6, 7], 3)
    submit(h, "good", [5, 6, 7], 2, max_new=1)
    results = h.run()
    assert results["bad"].finish_reason["type"] == "abort" and results["bad"].finish_reason["status_code"] == 400
    assert "logprob_start_len (3)" in results["bad"].finish_reason["message"]
    assert results["good"].meta["input_token_logprobs"] == [(None, 7)]
