"""`--kv-cache-dtype fp8_e4m3 | fp8_e5m2` end to end in one process.

- Accuracy against the model-dtype KV cache (`auto`), teacher-forced (tests/kv_accuracy.py: both runners fed
  the same tokens, the reference's greedy continuation), on a tiny random Llama (float32) and on the default
  SmolLM2 (bf16, quantized GGUF): greedy tokens mostly equal and the greedy token's logprob within a bound.
  Bounds are set from measured values (in the asserts' comments) with about 2x headroom.
- The prefix read back from the pool is fp8 too: a radix-cache hit and chunked prefill give the unchunked,
  uncached run's tokens.
- Disaggregation (tests/pd_harness.py, real schedulers and model): a prefill/decode pair with fp8 on both
  sides gives the unified fp8 server's tokens; a pair whose KV dtypes differ is refused at bootstrap.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.kv_accuracy import teacher_forced
from tests.pd_harness import PDPair
from tests.scheduler_harness import Harness
from tokenloom.config import ServerArgs
from tokenloom.executor.model_runner import ModelRunner

FP8 = ["fp8_e4m3", "fp8_e5m2"]
GREEDY = {"temperature": 0, "ignore_eos": True}


def _prompts(vocab: int, lengths: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]


# measured (tiny llama, 4 prompts of 40-400 tokens, 25 steps each): e4m3 100/100 equal, max |dlogprob| 0.0029;
# e5m2 96/100, 0.0062 (a random model's flat distributions flip on small changes)
TINY_BOUNDS = {"fp8_e4m3": (0.9, 0.006), "fp8_e5m2": (0.9, 0.012)}


@pytest.mark.parametrize("kv", FP8)
def test_tiny_model_fp8_against_auto(tiny_model_dir, kv):
    folder, _ = tiny_model_dir("llama")
    base = dict(model_path=folder, dtype="float32", max_total_tokens=4096, max_running_requests=8)
    reference = ModelRunner(ServerArgs(**base))
    fp8 = ModelRunner(ServerArgs(**base, kv_cache_dtype=kv))
    assert fp8.kv_pool.dtype == {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[kv]
    result = teacher_forced(reference, fp8, _prompts(256, (40, 200, 400, 120)), 24)
    min_agreement, max_diff = TINY_BOUNDS[kv]
    assert result.agreement >= min_agreement, result
    assert 0 < result.max_logprob_diff <= max_diff, result  # > 0: the fp8 pool was really used


# measured (SmolLM2 bf16, random-token prompts of 40-700 tokens, 4 x 25 steps): e4m3 94/100 equal, greedy
# token's |dlogprob| max 0.35 / mean 0.066; e5m2 90/100, 0.67 / 0.14. The test runs 2 prompts x 13 steps.
# (agreement, max, mean)
SMOLLM2_BOUNDS = {"fp8_e4m3": (0.8, 0.8, 0.15), "fp8_e5m2": (0.7, 1.4, 0.3)}


@pytest.mark.parametrize("kv", FP8)
def test_smollm2_fp8_against_auto(kv):
    base = dict(dtype="bfloat16", max_total_tokens=2048, max_running_requests=4)
    reference = ModelRunner(ServerArgs(**base))
    fp8 = ModelRunner(ServerArgs(**base, kv_cache_dtype=kv))
    result = teacher_forced(reference, fp8, _prompts(reference.vocab_size, (40, 300)), 12)
    min_agreement, max_diff, mean_diff = SMOLLM2_BOUNDS[kv]
    assert result.agreement >= min_agreement, result
    assert 0 < result.max_logprob_diff <= max_diff and result.mean_logprob_diff <= mean_diff, result


def _generate(h: Harness, prompts: list[list[int]], new: int, tag: str) -> dict[str, Any]:
    for i, ids in enumerate(prompts):
        h.submit(f"{tag}{i}", ids, dict(GREEDY, max_new_tokens=new))
    results = h.run()
    return {i: results[f"{tag}{i}"] for i in range(len(prompts))}


@pytest.mark.parametrize("kv", FP8)
def test_radix_hits_and_chunked_prefill_read_the_fp8_prefix(tiny_model_dir, kv):
    folder, _ = tiny_model_dir("llama")
    prompts = _prompts(256, (90, 150), seed=3)
    plain = _generate(Harness(folder, kv_cache_dtype=kv, disable_radix_cache=True), prompts, 12, "p")
    h = Harness(folder, kv_cache_dtype=kv, chunked_prefill_size=32)
    chunked = _generate(h, prompts, 12, "c")
    again = _generate(h, [p + [7, 8] for p in prompts], 12, "r")  # the prompts' KV comes from the radix cache
    assert all(r.meta["cached_tokens"] >= 90 for r in again.values())
    with_suffix = _generate(Harness(folder, kv_cache_dtype=kv, disable_radix_cache=True),
                            [p + [7, 8] for p in prompts], 12, "s")
    for i in range(len(prompts)):
        assert chunked[i].output_ids == plain[i].output_ids
        assert again[i].output_ids == with_suffix[i].output_ids


def _pd_harness(folder: str, kv: str, prefill_kv: str | None = None):
    def make(**server_args: Any) -> tuple[Harness, None]:
        mode_kv = prefill_kv if prefill_kv and server_args.get("disaggregation_mode") == "prefill" else kv
        return Harness(folder, kv_cache_dtype=mode_kv, **server_args), None
    return make


@pytest.mark.parametrize("kv", ["auto", *FP8])
def test_pd_pair_with_fp8_on_both_sides_matches_the_unified_fp8_server(tiny_runtime_model, kv):
    """One request at a time on both: decode batches of other compositions split the attention work
    differently, and a float32 rounding difference can move a K/V value across an fp8 rounding boundary, which
    a random model's flat distributions then turn into another token."""
    folder = tiny_runtime_model
    prompts = _prompts(1000, (20, 75, 130), seed=5)
    h = Harness(folder, kv_cache_dtype=kv, chunked_prefill_size=32, disable_radix_cache=True)
    unified = [_generate(h, [ids], 10, f"u{i}_")[0] for i, ids in enumerate(prompts)]
    pair = PDPair(_pd_harness(folder, kv), prefill_args={"chunked_prefill_size": 32})
    results = {}
    try:
        assert pair.prefill_h.memory.kv_pool.buffer.element_size() == (4 if kv == "auto" else 1)
        for i, ids in enumerate(prompts):
            pair.submit(f"u{i}", ids, dict(GREEDY, max_new_tokens=10))
            results.update(pair.run([f"u{i}"], timeout_s=120))
        assert pair.decode.side.received == len(prompts)
    finally:
        pair.close()
    for i in range(len(prompts)):
        assert results[f"u{i}"].output_ids == unified[i].output_ids, i


@pytest.mark.parametrize("prefill_kv, decode_kv", [("fp8_e4m3", "fp8_e5m2"), ("auto", "fp8_e4m3")])
def test_pd_pair_with_different_kv_dtypes_is_refused(tiny_model_dir, prefill_kv, decode_kv):
    folder, _ = tiny_model_dir("llama")
    pair = PDPair(_pd_harness(folder, decode_kv, prefill_kv=prefill_kv))
    try:
        pair.submit("x", _prompts(256, (12,))[0], dict(GREEDY, max_new_tokens=4))
        results = pair.run(["x"], timeout_s=60)
    finally:
        pair.close()
    message = results["x"].finish_reason["message"]
    assert "KV cache dtype mismatch" in message and "float8" in message, message
    assert results["x"].output_ids == []
