"""The overlap scheduler gives exactly the normal scheduler's outputs.

A mixed workload (greedy, seeded sampling, frequency/presence/repetition penalties, min_new_tokens with EOS,
stop strings, logprobs, prompts long enough to be chunked, a KV pool small enough to retract, and an abort in
the middle of generation) runs with `--overlap-schedule off`, `on` and `auto`; greedy and seeded outputs,
finish reasons and logprobs must match the normal loop's, and the pools must be full afterwards.
"""

from __future__ import annotations

import pytest
import torch

from tests.scheduler_harness import Harness, Result
from tokenloom.scheduler import overlap_policy
from tokenloom.tokenizer import load_tokenizer

EOS = 2


@pytest.fixture(scope="module")
def tokenizer(tiny_runtime_model):
    from tokenloom.config import ServerArgs
    from tokenloom.models.loader import resolve_model_source

    return load_tokenizer(resolve_model_source(ServerArgs(model_path=tiny_runtime_model)))


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(3, 49152, (48,), generator=g).tolist()
    prompts = []
    for i in range(10):
        n = int(torch.randint(4, 120, (1,), generator=g))
        ids = torch.randint(3, 49152, (n,), generator=g).tolist()
        prompts.append(shared + ids[:16] if i % 4 == 0 else ids)
    return prompts


def _params(stop: str) -> list[dict]:
    greedy = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
    return [
        greedy,
        dict(greedy, frequency_penalty=0.8, presence_penalty=0.5),
        dict(greedy, repetition_penalty=1.3),
        {"temperature": 0.9, "top_p": 0.9, "sampling_seed": 11, "max_new_tokens": 36, "ignore_eos": True},
        {"temperature": 1.1, "top_k": 20, "sampling_seed": 12, "max_new_tokens": 30, "frequency_penalty": 0.4,
         "ignore_eos": True},
        {"temperature": 0, "max_new_tokens": 35, "min_new_tokens": 12},
        dict(greedy, max_new_tokens=50, stop=[stop]),
        dict(greedy, max_new_tokens=1),
        dict(greedy, max_new_tokens=25),
        {"temperature": 0.7, "sampling_seed": 5, "max_new_tokens": 33, "min_new_tokens": 20},
    ]


def _stop_string(folder: str, tokenizer) -> str:
    """A stop string cut from the middle of request 6's free-running greedy text (so it does stop)."""
    h = Harness(folder, tokenizer=tokenizer, eos=(EOS,))
    h.submit("probe", _prompts()[6], {"temperature": 0, "max_new_tokens": 50, "ignore_eos": True})
    text = tokenizer.decode(h.run()["probe"].output_ids)
    return text[len(text) // 2: len(text) // 2 + 3]


def _run(folder: str, tokenizer, stop: str, abort: bool = True, **server_args) -> tuple[dict[str, Result], Harness]:
    h = Harness(folder, tokenizer=tokenizer, eos=(EOS,), **server_args)
    for i, (ids, params) in enumerate(zip(_prompts(), _params(stop), strict=True)):
        h.submit(f"r{i}", ids, params, return_logprob=i in (0, 3), top_logprobs_num=3 if i == 0 else 0)
    if abort:
        h.submit("victim", list(range(100, 140)), {"temperature": 0, "max_new_tokens": 500, "ignore_eos": True},
                 stream=True)
        h.run(until=lambda hh: len(hh.results.get("victim", Result()).output_ids) >= 4)
        h.abort("victim")
    results = h.run()
    h.assert_pools_full()
    if abort:
        assert results["victim"].finish_reason["type"] == "abort"
    return results, h


def _comparable(results: dict[str, Result]) -> dict[str, tuple]:
    out = {}
    for rid, res in results.items():
        if rid == "victim":
            continue
        logprobs = res.meta.get("output_token_logprobs")
        out[rid] = (res.output_ids, res.finish_reason, None if logprobs is None else [round(x, 4) for x, _ in logprobs])
    return out


@pytest.fixture(scope="module")
def folder(tiny_runtime_model):
    return tiny_runtime_model


@pytest.fixture(scope="module")
def stop(folder, tokenizer):
    return _stop_string(folder, tokenizer)


@pytest.fixture
def fast_auto_probe(monkeypatch):
    """Short probe windows so `auto` switches modes several times within the workload."""
    monkeypatch.setattr(overlap_policy, "PROBE_STEPS", 3)
    monkeypatch.setattr(overlap_policy, "SETTLE_STEPS", 1)
    monkeypatch.setattr(overlap_policy, "HOLD_STEPS", 6)


CONFIGS = {
    "chunked": dict(chunked_prefill_size=32),
    "retract": dict(chunked_prefill_size=32, max_total_tokens=400, schedule_conservativeness=0.05),
    "paged": dict(page_size=16, chunked_prefill_size=32),
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_overlap_on_and_auto_match_normal(folder, tokenizer, stop, config, fast_auto_probe):
    server_args = CONFIGS[config]
    normal, _ = _run(folder, tokenizer, stop, overlap_schedule="off", **server_args)
    assert normal["r6"].finish_reason == {"type": "stop", "matched": stop}
    assert normal["r5"].finish_reason is not None
    for mode in ("on", "auto"):
        results, h = _run(folder, tokenizer, stop, overlap_schedule=mode, **server_args)
        assert _comparable(results) == _comparable(normal), mode
        info = h.scheduler.internal_state(h.loop.info())
        assert info["overlap_schedule"] == mode
        if config == "retract":
            assert max(r.meta["total_retractions"] for r in results.values()) > 0, mode
    if config == "retract":
        assert max(r.meta["total_retractions"] for r in normal.values()) > 0


def test_auto_switches_between_modes_and_reports_decision(folder, tokenizer, stop, fast_auto_probe):
    results, h = _run(folder, tokenizer, stop, abort=False, overlap_schedule="auto", enable_step_profile=True)
    info = h.scheduler.internal_state(h.loop.info())
    assert info["overlap_decisions"] >= 1
    decision = info["overlap_decision"]
    assert decision["chosen"] in ("overlap", "normal")
    assert decision["overlap_ms_per_token"] > 0 and decision["normal_ms_per_token"] > 0
    profile = info["step_profile"]["decode"]
    assert 0 < profile["overlapped_steps"] < profile["steps"]  # both modes ran
    assert profile["forward"]["mean_ms"] > 0 and profile["process"]["mean_ms"] > 0


def test_disable_overlap_schedule_flag_means_off(folder):
    h = Harness(folder, overlap_schedule="on", disable_overlap_schedule=True)
    assert h.scheduler.internal_state(h.loop.info())["overlap_schedule"] == "off"


class _RebuiltEachStep:
    """A lane's sampling state built afresh from the requests' token lists at every step
    (`SamplingBatchInfo.from_requests`): nothing carried from one step to the next."""

    def __init__(self, vocab_size: int, eos_token_ids: tuple[int, ...], device: torch.device) -> None:
        self.vocab_size, self.eos_token_ids, self.device = vocab_size, eos_token_ids, device

    def info_for(self, reqs, is_decode: bool, return_logprob: bool = False, top_logprobs_num: int = 0):
        from tokenloom.sampling.sampling_batch import SamplingBatchInfo

        return SamplingBatchInfo.from_requests(
            [r.sampling_params for r in reqs], [r.origin_input_ids for r in reqs], [r.output_ids for r in reqs],
            self.vocab_size, self.eos_token_ids, self.device, return_logprob, top_logprobs_num,
            pending_outputs=[r.pending_tokens > 0 for r in reqs])


@pytest.mark.parametrize("mode", ["off", "on"])
def test_penalties_and_bias_match_a_per_step_rebuild(folder, mode):
    """The scheduler carries penalty state and logit bias across decode steps (`SamplingRows`); the reference
    rebuilds them from the token lists at every step, each request alone. Greedy outputs must agree, with
    requests joining mid-way (max running 2 of 4) so the state is rebuilt and carried in turns."""
    from tests.scheduler_harness import generate_in_process
    from tokenloom.executor.worker import ModelWorker

    class RebuildingWorker(ModelWorker):
        def new_lane_state(self) -> _RebuiltEachStep:
            return _RebuiltEachStep(self.runner.vocab_size, self.eos_token_ids, self.device)

    base = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    params = [dict(base, frequency_penalty=1.5, presence_penalty=0.8), dict(base, repetition_penalty=1.8),
              dict(base, logit_bias={"17": 6.0}, frequency_penalty=0.9), dict(base, presence_penalty=1.2)]
    prompts = _prompts()[:4]
    h = Harness(folder, eos=(EOS,), overlap_schedule=mode, max_running_requests=2)
    for i, (ids, p) in enumerate(zip(prompts, params, strict=True)):
        h.submit(f"p{i}", ids, p)
    results = h.run()
    for i, (ids, p) in enumerate(zip(prompts, params, strict=True)):
        [want] = generate_in_process(h.runner, [ids], [p], worker=RebuildingWorker(h.runner, (EOS,)))
        assert results[f"p{i}"].output_ids == want, i
