"""Tensor parallelism end to end through `tokenloom.Engine`: two scheduler ranks (launcher, rendezvous,
MIN-reduced pools, the entry rank's broadcast inbox) must serve exactly what one rank serves.

Reference: the same Engine at --tp-size 1 with the same scheduling flags (so batches are composed alike),
fp32 tiny random Llamas with SmolLM2's tokenizer: one with 1 KV head (< tp: replicated KV heads) and one with
2 (split). Each configuration runs one workload per Engine — greedy with logprobs, seeded sampling at
temperature 0.8, shared prefixes twice (radix hits), an abort mid-flight — then checks that the pools are
back to full and that every rank's pools and queues equal rank 0's (`tp_ranks_agree`, an all_equal over the
TP group; each rank also checks its own pool integrity whenever it goes idle, and would die on a leak).
Last, killing rank 1 must fail the pending request with an error naming that rank, and end every process.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.engine_checks import abort_mid_flight, assert_killed_rank_fails_everything, wait_idle_pools_full
from tests.model_factory import make_tiny_with_smollm2_tokenizer
from tokenloom import Engine
from tokenloom.layers import cpu_gemm

PREFIX = "A shared preamble about the weather in the mountains, repeated for the cache: "
PROMPTS = [PREFIX + s for s in ("sunny", "rainy days", "snow and wind")] + ["1, 2, 3, 4, 5,", "Once upon a time"]
GREEDY = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
# A random model's next-token distribution is nearly flat over 49152 tokens, where the inverse-CDF draw is
# sensitive to the last bits of the logits (sharded sums add in another order); top_k keeps a few candidates,
# so fp32 rounding cannot move a draw across a boundary.
SEEDED = [{"temperature": 0.8, "top_k": 16, "max_new_tokens": 16, "ignore_eos": True, "sampling_seed": 11 + i}
          for i in range(len(PROMPTS))]
COMMON = dict(dtype="float32", log_level="warning")


@pytest.fixture(scope="module")
def tiny_kv1(tmp_path_factory) -> str:
    """1 KV head: at tp 2 each rank keeps a replica of it."""
    return make_tiny_with_smollm2_tokenizer(str(tmp_path_factory.mktemp("tiny_kv1")), num_key_value_heads=1)


def _workload(eng: Engine, abort: bool, max_new_tokens: int = 16) -> dict:
    out: dict = {}
    greedy = eng.generate(PROMPTS, dict(GREEDY, max_new_tokens=max_new_tokens), return_logprob=True)
    out["greedy"] = [o["output_ids"] for o in greedy]
    out["logprobs"] = [[lp[0] for lp in o["meta_info"]["output_token_logprobs"]] for o in greedy]
    out["seeded"] = [o["output_ids"] for o in eng.generate(PROMPTS, SEEDED)]
    again = eng.generate(PROMPTS, GREEDY)  # every prompt's prefix is cached now
    out["again"] = [o["output_ids"] for o in again]
    assert all(o["meta_info"]["cached_tokens"] > 0 for o in again)
    if abort:
        out["with_abort"] = asyncio.run(abort_mid_flight(eng, PROMPTS, [dict(p, max_new_tokens=8) for p in SEEDED]))
    return out


def _assert_pools_full(eng: Engine, tp_size: int) -> None:
    info = wait_idle_pools_full(eng)
    # Request rows: each rank checks free rows == its table size whenever it goes idle (and dies on a leak).
    assert all(p.is_alive() for p in eng.tokenizer_manager.processes.values())
    if tp_size > 1:
        assert info["tp_ranks_agree"] is True


def _run(model: str, tp_size: int, abort: bool, max_new_tokens: int = 16, **flags) -> dict:
    with Engine(model, tp_size=tp_size, **COMMON, **flags) as eng:
        out = _workload(eng, abort, max_new_tokens)
        _assert_pools_full(eng, tp_size)
        out["retracted"] = eng.get_server_info()["num_retracted_reqs"]
        assert eng.flush_cache()["success"]
    return out


def _assert_same(tp2: dict, tp1: dict) -> None:
    for key in sorted(tp1.keys() & tp2.keys()):
        if key == "logprobs":
            for a, b in zip(tp2[key], tp1[key], strict=True):
                assert a == pytest.approx(b, abs=1e-4)
        else:
            assert tp2[key] == tp1[key], key


def test_replicated_kv_heads_small_pool_chunked_overlap_on(tiny_kv1):
    """kv_heads 1 < tp; chunks of 16 tokens, 2 request slots, a pool small enough to force retraction; the
    collectives on gloo (--disable-custom-all-reduce; the other tests use the shared-memory all-reduce)."""
    flags = dict(max_total_tokens=96, max_running_requests=2, chunked_prefill_size=16, overlap_schedule="on",
                 schedule_conservativeness=0.3, max_new_tokens=40)
    tp1 = _run(tiny_kv1, 1, False, **flags)
    tp2 = _run(tiny_kv1, 2, False, disable_custom_all_reduce=True, **flags)  # every collective on gloo
    _assert_same(tp2, tp1)
    assert tp1["retracted"] > 0  # the small pool did force retraction (the same ones at tp 2: equal counts)


@pytest.fixture(scope="module")
def split_kv_reference(tiny_runtime_model) -> dict:
    return _run(tiny_runtime_model, 1, True, max_total_tokens=8192, overlap_schedule="off")


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_split_kv_heads(tiny_runtime_model, split_kv_reference, overlap):
    """kv_heads 2 == tp: each rank holds one KV head; the normal loop, and the overlap loop (the forward
    thread's shared-memory all-reduces run while the scheduling thread broadcasts on gloo)."""
    tp2 = _run(tiny_runtime_model, 2, True, max_total_tokens=8192, overlap_schedule=overlap)
    _assert_same(tp2, split_kv_reference)


def test_adaptive_overlap_then_killed_rank(tiny_runtime_model, split_kv_reference):
    """`--overlap-schedule auto` (rank 0's decisions broadcast) serves the same; then rank 1 is killed: the
    pending request fails naming that rank, new requests are refused, and every process ends."""
    eng = Engine(tiny_runtime_model, tp_size=2, max_total_tokens=8192, overlap_schedule="auto", **COMMON)
    try:
        _assert_same(_workload(eng, True), split_kv_reference)
        _assert_pools_full(eng, 2)
        assert_killed_rank_fails_everything(eng, "scheduler1", r"scheduler rank 1 \(tp 1, pp 0\) died \(exit code -9\)")
    finally:
        eng.shutdown()


def _bf16_run(model: str, tp_size: int, **flags) -> dict:
    """The default dtype (bf16): one request at a time (1-row decode steps), greedy with logprobs."""
    out: dict = {"tokens": [], "logprobs": []}
    with Engine(model, tp_size=tp_size, log_level="warning", max_total_tokens=4096, **flags) as eng:
        out["native_max_batch"] = eng.tokenizer_manager.scheduler_info["native_decode_max_batch"]
        for prompt in PROMPTS[:3]:
            o = eng.generate(prompt, GREEDY, return_logprob=True)
            out["tokens"].append(o["output_ids"])
            out["logprobs"].append([lp[0] for lp in o["meta_info"]["output_token_logprobs"]])
        _assert_pools_full(eng, tp_size)
    return out


@pytest.mark.skipif(cpu_gemm._small_gemm() is None, reason="the native decode step needs AVX512-BF16 and a C compiler")
def test_native_decode_step_at_tp2_equals_the_modular_path(tiny_runtime_model):
    """bf16 at TP=2: the native one-call step (its C loop all-reducing o_proj's and down_proj's outputs through
    the shared-memory communicator) gives bit-identical logprobs to the modular path at one row, and both
    stay within bf16 rounding of TP=1."""
    native = _bf16_run(tiny_runtime_model, 2)
    modular = _bf16_run(tiny_runtime_model, 2, disable_native_decode=True)
    assert native["native_max_batch"] >= 1 and modular["native_max_batch"] == 0
    assert native["tokens"] == modular["tokens"]
    assert native["logprobs"] == modular["logprobs"]
    tp1 = _bf16_run(tiny_runtime_model, 1)
    assert tp1["native_max_batch"] >= 1
    for a, b in zip(native["logprobs"], tp1["logprobs"], strict=True):
        n = min(len(a), len(b))
        assert a[:n] == pytest.approx(b[:n], abs=0.05)


def test_smollm2_at_tp3_equals_tp1(smollm2_file):
    """The real model, split three ways (9 heads and 3 KV heads do not split by 2; they do by 3): greedy
    tokens equal TP=1's and logprobs agree within fp32 tolerance, across a chunked prefill and radix hits."""
    flags = dict(dtype="float32", log_level="warning", max_total_tokens=2048, chunked_prefill_size=32,
                 num_threads=1)
    prompts = [PREFIX + "sunny", PREFIX + "rainy days", "The capital city of France is"]
    results = []
    for tp_size in (1, 3):
        with Engine(smollm2_file, tp_size=tp_size, **flags) as eng:
            outs = eng.generate(prompts, dict(GREEDY, max_new_tokens=12), return_logprob=True)
            again = eng.generate(prompts, dict(GREEDY, max_new_tokens=12))
            assert all(o["meta_info"]["cached_tokens"] > 0 for o in again)
            results.append(([o["output_ids"] for o in outs], [o["output_ids"] for o in again],
                             [[lp[0] for lp in o["meta_info"]["output_token_logprobs"]] for o in outs]))
            _assert_pools_full(eng, tp_size)
    (tokens1, again1, lp1), (tokens3, again3, lp3) = results
    assert tokens3 == tokens1 and again3 == again1 == tokens1
    for a, b in zip(lp3, lp1, strict=True):
        assert a == pytest.approx(b, abs=1e-4)
