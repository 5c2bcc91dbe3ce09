"""The sliding-window KV pool under the scheduler: a tiny Mistral (window 8, all layers sliding) and a Qwen2
with a full layer, 16-token prefill chunks; greedy tokens equal transformers' float32 with the pool on and with
--disable-hybrid-swa-memory, the sliding layers' slots in use stay bounded by the window (plus a chunk) while
the full layers hold the whole sequence, aborts leak nothing (the harness checks both pools when idle), the
pool's size follows --swa-full-tokens-ratio, and PD servers get the pool too: a prefill and a decode scheduler
in one process (tests/pd_harness.py) transfer both pools, with the decode side retracting to host memory and
resuming (the servers' pair: tests/e2e/test_family_pd.py)."""

from __future__ import annotations

import time

import pytest
import torch

from tests.integration.test_sliding_window import make_window_model
from tests.pd_harness import PDPair
from tests.scheduler_harness import LoopHarness
from tokenloom.cache.kv_memory import swa_memory_applies
from tokenloom.cache.swa_pool import SWAKVPool
from tokenloom.config import ServerArgs
from tokenloom.executor.model_runner import ModelRunner
from tokenloom.executor.worker import ModelWorker

WINDOW, CHUNK = 8, 16


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for kind in ("mistral", "qwen2"):
        folder = str(tmp_path_factory.mktemp(f"swa_{kind}"))
        out[kind] = (folder, make_window_model(kind, folder, seed=2))
    return out


def _harness(folder: str, **kw) -> LoopHarness:
    args = ServerArgs(model_path=folder, dtype="float32", max_total_tokens=1024, max_running_requests=4,
                      chunked_prefill_size=CHUNK, **kw)
    runner = ModelRunner(args)
    return LoopHarness(args, ModelWorker(runner, ()), runner.memory, runner.vocab_size)


def _greedy(hf: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat((ids, hf(ids).logits[:, -1].argmax(-1, keepdim=True)), dim=1)
    return ids[0, len(prompt):].tolist()


@pytest.mark.parametrize("kind", ["mistral", "qwen2"])
@pytest.mark.parametrize("hybrid", [True, False])
def test_pool_tokens_match_transformers_and_stay_within_the_window(models, kind, hybrid):
    folder, hf = models[kind]
    h = _harness(folder, disable_hybrid_swa_memory=not hybrid)
    alloc = h.memory.token_allocator
    assert isinstance(h.memory.kv_pool, SWAKVPool) == hybrid
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (150, 90)]
    for i, p in enumerate(prompts):
        h.submit(f"r{i}", p, {"temperature": 0, "max_new_tokens": 20, "ignore_eos": True})
    peak = {"swa": 0, "full": 0}

    def sample(hh: LoopHarness) -> bool:
        peak["full"] = max(peak["full"], h.memory.max_total_num_tokens - alloc.full_available_size())
        if hybrid:
            peak["swa"] = max(peak["swa"], alloc.swa_in_use())
        return False

    results = h.run(until=sample)
    for i, p in enumerate(prompts):
        assert results[f"r{i}"].output_ids == _greedy(hf, p, 20)
    assert peak["full"] >= 150 + 90  # the full layers' slots: every position of both requests
    if hybrid:  # per request: a chunk on top of its window, and the tree's window at each cached end
        assert 0 < peak["swa"] <= 2 * (CHUNK + 2 * (WINDOW + 1))
        h.scheduler.flush_cache()
        assert alloc.swa_in_use() == 0


def test_aborts_leak_nothing(models):
    folder, _ = models["mistral"]
    h = _harness(folder)
    gen = torch.Generator().manual_seed(6)
    for i, n in enumerate((120, 60, 40)):
        h.submit(f"r{i}", torch.randint(0, 256, (n,), generator=gen).tolist(),
                 {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True})
    h.run(until=lambda hh: hh.scheduler.chunked_req is not None and hh.scheduler.chunked_req.kv_len >= 48)
    h.abort("r0")  # mid-prefill
    h.run(until=lambda hh: any(len(r.output_ids) >= 5 for r in hh.scheduler.running))
    h.abort("r1")  # mid-decode
    h.run()  # idle: the harness checks the full accounting, the swa map and no swa slot outside the tree
    assert h.results["r2"].finish_reason["type"] == "length"
    assert {h.results[r].finish_reason["type"] for r in ("r0", "r1")} == {"abort"}


def test_pool_sizes_and_pd(models):
    folder, _ = models["qwen2"]
    args = ServerArgs(model_path=folder, dtype="float32", max_total_tokens=1000, swa_full_tokens_ratio=0.25)
    memory = ModelRunner(args).memory
    assert memory.kv_pool.swa_size == 250 and memory.max_total_num_tokens == 1000
    assert memory.kv_pool.swa_pool.nbytes() < memory.kv_pool.full_pool.nbytes()
    windows = (0, WINDOW)
    assert swa_memory_applies(ServerArgs(disaggregation_mode="prefill"), windows)
    assert swa_memory_applies(ServerArgs(disaggregation_mode="decode"), windows)
    assert not swa_memory_applies(ServerArgs(disaggregation_mode="prefill", disable_hybrid_swa_memory=True), windows)
    assert not swa_memory_applies(ServerArgs(page_size=16), windows)


@pytest.mark.parametrize("kind", ["mistral", "qwen2"])
def test_pd_pair_transfers_both_pools(models, kind):
    """Chunks past the window (the prefill side drops its oldest sliding K/V between chunks, after their
    transfer), a follow-up turn hitting the prefill side's radix cache (its cached prefix keeps sliding K/V only
    near its end: the rest is not sent, and not read), and a decode pool so small that requests retract to
    host memory and resume (both pools copied out and back): greedy tokens equal transformers'."""
    folder, hf = models[kind]
    # the decode side's sliding layers get 30 slots: fewer than prompt "a" (its tail is reserved, not all of it)
    pair = PDPair(_pd_side(folder), decode_args={"max_total_tokens": 120, "swa_full_tokens_ratio": 0.25})
    try:
        for h in (pair.prefill_h, pair.decode_h):
            assert isinstance(h.memory.kv_pool, SWAKVPool)
        gen = torch.Generator().manual_seed(7)
        prompts = {rid: torch.randint(0, 256, (n,), generator=gen).tolist() for rid, n in (("a", 45), ("b", 30),
                                                                                          ("c", 25))}
        greedy = {"temperature": 0, "max_new_tokens": 30, "ignore_eos": True}
        # "a" and "b" start decoding together (not one after the other, as a slow transfer or a late request
        # message could make them), so their growth (135 positions) overflows the decode pool and one retracts
        side, prebuild, first = pair.decode.side, pair.decode.side._prebuild, {"a", "b"}

        def prebuild_a_and_b_together() -> None:
            if first and not first <= {state.req.rid for state in side.arrived}:
                return
            first.clear()
            prebuild()
        side._prebuild = prebuild_a_and_b_together
        for rid in ("a", "b"):
            pair.submit(rid, prompts[rid], greedy)
        # "c" only once "a" and "b" were built together: preallocated before "b", it would hold the room "b"
        # needs while the hook holds "a" and "c" back for "b" (a deadlock of the hook's making)
        deadline = time.monotonic() + 120
        while first and time.monotonic() < deadline:
            if not pair.step():
                time.sleep(0.002)
        pair.submit("c", prompts["c"], greedy)
        results = pair.run(timeout_s=300)
        assert pair.decode.side.offloaded > 0  # retracted to host memory (and resumed)
        prompts["d"] = prompts["a"] + results["a"].output_ids[:1] + torch.randint(0, 256, (6,), generator=gen).tolist()
        pair.submit("d", prompts["d"], greedy)
        results = pair.run(timeout_s=300)
        assert pair.prefill_h.results["d"].meta["cached_tokens"] >= 40  # a radix hit on the prefill side
        for rid, ids in prompts.items():
            assert results[rid].output_ids == _greedy(hf, ids, 30), rid
    finally:
        pair.close()


def test_pd_decode_refuses_what_its_sliding_pool_cannot_hold(models):
    """A decode sliding-layer pool smaller than a request's window (plus the decode reservation): a 400 naming
    the pool, on both sides; a request whose window fits is served."""
    folder, hf = models["mistral"]
    pair = PDPair(_pd_side(folder), decode_args={"max_total_tokens": 120, "swa_full_tokens_ratio": 0.05})
    try:
        assert pair.decode_h.memory.kv_pool.swa_size == 6  # the window's 8 + 1 positions do not fit
        gen = torch.Generator().manual_seed(8)
        long, short = (torch.randint(0, 256, (n,), generator=gen).tolist() for n in (20, 3))
        pair.submit("long", long, {"temperature": 0, "max_new_tokens": 30, "ignore_eos": True})
        pair.submit("short", short, {"temperature": 0, "max_new_tokens": 2, "ignore_eos": True})
        results = pair.run(timeout_s=120)
        assert results["long"].finish_reason["status_code"] == 400
        assert "sliding-window KV pool" in results["long"].finish_reason["message"]
        assert pair.prefill_h.results["long"].finish_reason["type"] == "abort"
        assert results["short"].output_ids == _greedy(hf, short, 2)
    finally:
        pair.close()


def _pd_side(folder: str):
    """`PDPair`'s side maker over the real model (pools from the flags, as a server builds them)."""
    def make(**kw):
        args = ServerArgs(**{"model_path": folder, "dtype": "float32", "max_total_tokens": 512,
                             "max_running_requests": 4, "chunked_prefill_size": CHUNK, "overlap_schedule": "off",
                             "num_reserved_decode_tokens": 2, **kw})
        runner = ModelRunner(args)
        return LoopHarness(args, ModelWorker(runner, ()), runner.memory, runner.vocab_size), None
    return make
