"""Pipeline parallelism end to end through `tokenloom.Engine` (launcher, one process per stage, the
`PipelineLoop` on every stage): greedy and seeded outputs must equal PP=1's.

Reference: the same Engine at --pp-size 1 with the same flags; fp32, a tiny random 4-layer Llama (untied
head, large init, so every token depends on the context and ties are far apart) with SmolLM2's tokenizer.
Stages split it [2, 2] at PP=2 and [1, 1, 2] at PP=3. Each configuration runs one workload — greedy with
output, top and prompt logprobs, penalties, seeded sampling at temperature 0.8, every prompt again (radix
hits), a streamed request aborted mid-flight while others run — then checks every stage's pools are back
to full (`pp_stages`, gathered from every rank) and that the stages agree on what they hold. Each stage
also checks its own pool integrity whenever it goes idle and dies on a leak.
Then: a small pool with chunked prefill and --max-running-requests 2 (retraction inside a lane); PP=2 x TP=2;
the default bf16; and a stage killed mid-request, which must fail the request naming it and end every
process.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.engine_checks import abort_mid_flight, assert_killed_rank_fails_everything, wait_idle_pools_full
from tests.model_factory import make_tiny_with_smollm2_tokenizer
from tokenloom import Engine

PREFIX = "A shared preamble about the weather in the mountains, repeated for the cache: "
PROMPTS = [PREFIX + s for s in ("sunny", "rainy days", "snow and wind")] + ["1, 2, 3, 4, 5,", "Once upon a time"]
GREEDY = {"temperature": 0, "max_new_tokens": 14, "ignore_eos": True}
PENALTIES = {**GREEDY, "frequency_penalty": 0.6, "presence_penalty": 0.3, "repetition_penalty": 1.3}
SEEDED = [{"temperature": 0.8, "top_k": 16, "max_new_tokens": 14, "ignore_eos": True, "sampling_seed": 21 + i}
          for i in range(len(PROMPTS))]
COMMON = dict(dtype="float32", log_level="warning")


@pytest.fixture(scope="module")
def tiny4(tmp_path_factory) -> str:
    return make_tiny_with_smollm2_tokenizer(str(tmp_path_factory.mktemp("tiny_pp4")), num_hidden_layers=4,
                                            tie_word_embeddings=False, initializer_range=0.3)


def _workload(eng: Engine, abort: bool = True, max_new_tokens: int = 14, sampled: bool = True) -> dict:
    out: dict = {}
    greedy = eng.generate(PROMPTS, dict(GREEDY, max_new_tokens=max_new_tokens), return_logprob=True,
                          top_logprobs_num=3, logprob_start_len=0)
    out["greedy"] = [o["output_ids"] for o in greedy]
    out["logprobs"] = [[lp[0] for lp in o["meta_info"]["output_token_logprobs"]] for o in greedy]
    out["top"] = [[[t[1] for t in top] for top in o["meta_info"]["output_top_logprobs"]] for o in greedy]
    out["prompt_logprobs"] = [[lp[0] for lp in o["meta_info"]["input_token_logprobs"][1:]] for o in greedy]
    if sampled:
        out["penalties"] = [o["output_ids"] for o in eng.generate(PROMPTS, PENALTIES)]
        out["seeded"] = [o["output_ids"] for o in eng.generate(PROMPTS, SEEDED)]
    again = eng.generate(PROMPTS, GREEDY)  # every prompt's prefix is cached now
    out["again"] = [o["output_ids"] for o in again]
    if sampled:  # (a pool as small as the retraction test's evicts between the phases)
        assert all(o["meta_info"]["cached_tokens"] > 0 for o in again)
    if abort:
        out["with_abort"] = asyncio.run(abort_mid_flight(eng, PROMPTS, [dict(p, max_new_tokens=8) for p in SEEDED]))
    return out


def _assert_stages_full(eng: Engine, pp_size: int, tp_size: int = 1) -> dict:
    info = wait_idle_pools_full(eng)
    if pp_size > 1:
        stages = info["pp_stages"]
        assert [s["pp_rank"] for s in stages] == [r // tp_size for r in range(pp_size * tp_size)]
        for s in stages:  # every stage's KV back to full, every request row free, nothing queued
            assert s["available_kv_tokens"] + s["evictable_kv_tokens"] == s["max_total_num_tokens"], s
            assert s["num_running_reqs"] == 0 and s["num_waiting_reqs"] == 0, s
        # the stages made the same decisions: same pools, same cache contents, same retractions
        keys = ("max_total_num_tokens", "available_kv_tokens", "evictable_kv_tokens", "free_request_slots",
                "num_retracted_reqs")
        assert len({tuple(s[k] for k in keys) for s in stages}) == 1, stages
        assert all(p.is_alive() for p in eng.tokenizer_manager.processes.values())
    return info


def _run(model: str, pp_size: int, depth: int = 0, tp_size: int = 1, abort: bool = True, max_new_tokens: int = 14,
         sampled: bool = True, **flags) -> dict:
    with Engine(model, pp_size=pp_size, pp_async_batch_depth=depth, tp_size=tp_size, **{**COMMON, **flags}) as eng:
        out = _workload(eng, abort, max_new_tokens, sampled)
        info = _assert_stages_full(eng, pp_size, tp_size)
        out["retracted"] = info["num_retracted_reqs"]
        if pp_size > 1:
            assert info["pp_lanes"] == pp_size + depth
            out["layers"] = sorted({tuple(s["layers"]) for s in info["pp_stages"]})
            out["send_options"] = (info["pp_early_output_send"], info["pp_overlap_sends"])
        assert eng.flush_cache()["success"]
    return out


def _assert_same(pp: dict, ref: dict) -> None:
    for key in sorted(ref.keys() & pp.keys() - {"retracted", "layers", "send_options"}):
        if key in ("logprobs", "prompt_logprobs"):
            for a, b in zip(pp[key], ref[key], strict=True):
                assert a == pytest.approx(b, abs=1e-4), key
        else:
            assert pp[key] == ref[key], key


@pytest.fixture(scope="module")
def reference(tiny4) -> dict:
    return _run(tiny4, 1, max_total_tokens=4096)


@pytest.mark.parametrize("pp_size, depth, sends_off", [(2, 0, ()), (3, 1, ()),
                                                     (2, 2, ("EARLY_OUTPUT_SEND", "OVERLAP_SENDS")),
                                                     (3, 2, ("OVERLAP_SENDS",))])
def test_pipeline_equals_pp1(tiny4, reference, monkeypatch, pp_size, depth, sends_off):
    """`sends_off`: the send optimizations turned off, the early output send and/or overlapped sends (the
    sends posted by the scheduling thread, and waited for at the end of each iteration), as bench/pipeline.py
    runs them."""
    for point in sends_off:
        monkeypatch.setenv(f"TOKENLOOM_PP_{point}", "0")
    out = _run(tiny4, pp_size, depth, max_total_tokens=4096)
    _assert_same(out, reference)
    assert out["send_options"] == ("EARLY_OUTPUT_SEND" not in sends_off, "OVERLAP_SENDS" not in sends_off)
    assert out["layers"] == ([(0, 2), (2, 4)] if pp_size == 2 else [(0, 1), (1, 2), (2, 4)])


def test_small_pool_chunked_two_running_requests(tiny4):
    """Chunks of 16 tokens (a prompt's chunks in several lanes), --max-running-requests 2 (one request per
    micro-batch at PP=2) and a pool small enough to force retraction inside a lane."""
    flags = dict(max_total_tokens=96, max_running_requests=2, chunked_prefill_size=16,
                 schedule_conservativeness=0.3, max_new_tokens=40, sampled=False)
    ref = _run(tiny4, 1, abort=False, **flags)
    pp = _run(tiny4, 2, 1, abort=False, **flags)
    _assert_same(pp, ref)
    assert pp["retracted"] > 0


def test_pipeline_times_tensor_parallel(tiny4, reference):
    """PP=2 x TP=2: four ranks; each TP rank exchanges with its counterpart on the other stage."""
    _assert_same(_run(tiny4, 2, 0, tp_size=2, max_total_tokens=4096), reference)


def _bf16_run(model: str, pp_size: int, **flags) -> dict:
    """The default dtype (bf16), one request at a time (the same 1-row steps at either size)."""
    out: dict = {"tokens": [], "logprobs": []}
    with Engine(model, pp_size=pp_size, log_level="warning", max_total_tokens=4096, **flags) as eng:
        out["weight_quantization"] = eng.tokenizer_manager.scheduler_info.get("weight_quantization")
        for prompt in PROMPTS[:3]:
            o = eng.generate(prompt, GREEDY, return_logprob=True)
            out["tokens"].append(o["output_ids"])
            out["logprobs"].append([lp[0] for lp in o["meta_info"]["output_token_logprobs"]])
        _assert_stages_full(eng, pp_size)
    return out


def test_default_bf16_pipeline_matches_pp1(tiny4):
    pp1, pp2 = _bf16_run(tiny4, 1), _bf16_run(tiny4, 2)
    for a, b, la, lb in zip(pp2["tokens"], pp1["tokens"], pp2["logprobs"], pp1["logprobs"], strict=True):
        assert a[:6] == b[:6]  # bf16 rounding may part them later, never this early on a well-separated model
        assert la[:6] == pytest.approx(lb[:6], abs=0.05)


@pytest.fixture(scope="module")
def tiny4_gguf(tiny4, tmp_path_factory) -> str:
    """tiny4 as a GGUF of the types a Q4_K_M file holds at widths that are not whole super-blocks (Q5_0, Q5_1
    for ffn_down, Q8_0 embedding and head); its tokenizer stays in tiny4's folder (--tokenizer-path)."""
    import transformers

    from tests.gguf_factory import write_gguf

    hf = transformers.LlamaForCausalLM.from_pretrained(tiny4).eval()
    path = str(tmp_path_factory.mktemp("tiny_pp4_gguf") / "tiny4.gguf")
    write_gguf(path, hf, lambda n: "Q8_0" if "embed" in n or "lm_head" in n else "Q5_1" if "down_proj" in n
               else "Q5_0")
    return path


def test_default_bf16_pipeline_with_quantized_weights_matches_pp1(tiny4, tiny4_gguf):
    """The default configuration on a GGUF kept quantized (bf16 activations on the quantized kernels) at PP=2:
    every stage keeps its layers quantized, and the outputs follow PP=1's as in the bf16 test above."""
    pp1 = _bf16_run(tiny4_gguf, 1, tokenizer_path=tiny4)
    pp2 = _bf16_run(tiny4_gguf, 2, tokenizer_path=tiny4)
    assert "Q5_0" in pp1["weight_quantization"] and "Q5_0" in pp2["weight_quantization"]
    for a, b, la, lb in zip(pp2["tokens"], pp1["tokens"], pp2["logprobs"], pp1["logprobs"], strict=True):
        assert a[:6] == b[:6]
        assert la[:6] == pytest.approx(lb[:6], abs=0.05)


def test_killed_stage_fails_the_request_and_ends_every_process(tiny4):
    eng = Engine(tiny4, pp_size=3, max_total_tokens=4096, **COMMON)
    try:
        assert_killed_rank_fails_everything(eng, "scheduler1", r"scheduler rank 1 \(tp 0, pp 1\) died", delay_s=1.0)
    finally:
        eng.shutdown()
