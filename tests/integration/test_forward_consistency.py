"""The same sequence gives the same logits however it is fed: prefilled at once, in chunks on top of a
cached prefix, token by token in decode, alone or batched with other sequences, page size 1 or 16."""

from __future__ import annotations

import pytest
import torch

from tests.forward_steps import ForwardSteps
from tokenloom.config import ServerArgs
from tokenloom.executor.model_runner import ModelRunner
from tokenloom.layers.attention import torch_native

TOL = 2e-5


@pytest.fixture(scope="module", params=[(1, "torch_native"), (16, "torch_native"), (1, "cpu"), (16, "cpu")],
                ids=["page1-torch", "page16-torch", "page1-cpu", "page16-cpu"])
def steps(request, tiny_model_dir):
    folder, _ = tiny_model_dir("llama")
    page, backend = request.param
    runner = ModelRunner(ServerArgs(model_path=folder, dtype="float32", page_size=page, attention_backend=backend,
                                    max_total_tokens=4096, max_running_requests=16))
    assert type(runner.attn_backend).__name__ == {"cpu": "CpuPagedBackend", "torch_native": "TorchNativeBackend"}[
        backend]
    yield ForwardSteps(runner)
    assert runner.token_allocator.available_size() == runner.max_total_num_tokens
    assert runner.req_to_token_pool.available_size() == runner.req_to_token_pool.size


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _at_once(steps: ForwardSteps, tokens: list[int]) -> torch.Tensor:
    seq = steps.start()
    try:
        return steps.extend([seq], [tokens], return_all_logits=True)
    finally:
        steps.release(seq)


def test_chunked_prefill_on_cached_prefix_matches(steps):
    tokens = _tokens(70, 0)
    reference = _at_once(steps, tokens)
    seq = steps.start()
    parts = [steps.extend([seq], [tokens[a:b]], return_all_logits=True)
             for a, b in [(0, 13), (13, 29), (29, 30), (30, 70)]]
    steps.release(seq)
    assert (torch.cat(parts) - reference).abs().max().item() < TOL


def test_token_by_token_decode_matches(steps):
    tokens = _tokens(40, 1)
    reference = _at_once(steps, tokens)
    seq = steps.start()
    rows = [steps.extend([seq], [tokens[:1]])]
    rows += [steps.extend([seq], [[t]]) for t in tokens[1:]]  # decode mode: one token on a cached prefix
    steps.release(seq)
    assert (torch.cat(rows) - reference).abs().max().item() < TOL


def test_batched_with_other_lengths_matches(steps):
    lengths = [33, 7, 64, 18]
    seqs_tokens = [_tokens(n, 10 + i) for i, n in enumerate(lengths)]
    references = [_at_once(steps, t) for t in seqs_tokens]
    seqs = [steps.start() for _ in lengths]
    # Prefill different-length prefixes together, then decode all four together to the end.
    prefix = [n // 2 for n in lengths]
    first = steps.extend(seqs, [t[:p] for t, p in zip(seqs_tokens, prefix, strict=True)],
                         return_all_logits=True)
    got = [list(torch.split(first, prefix))[i] for i in range(len(lengths))]
    got = [[g] for g in got]
    for step in range(max(lengths)):
        live = [i for i, n in enumerate(lengths) if prefix[i] + step < n]
        if not live:
            break
        out = steps.extend([seqs[i] for i in live], [[seqs_tokens[i][prefix[i] + step]] for i in live])
        for row, i in enumerate(live):
            got[i].append(out[row:row + 1])
    for seq in seqs:
        steps.release(seq)
    for ref, parts in zip(references, got, strict=True):
        assert (torch.cat(parts) - ref).abs().max().item() < TOL


def test_mixed_extend_batch_of_prefill_and_continuation(steps):
    """One extend batch holding a fresh prompt and a chunk continuing a cached sequence."""
    a, b = _tokens(50, 20), _tokens(23, 21)
    ref_a, ref_b = _at_once(steps, a), _at_once(steps, b)
    sa, sb = steps.start(), steps.start()
    first_a = steps.extend([sa], [a[:31]], return_all_logits=True)
    mixed = steps.extend([sa, sb], [a[31:], b], return_all_logits=True)
    steps.release(sa)
    steps.release(sb)
    got_a = torch.cat((first_a, mixed[: 50 - 31]))
    assert (got_a - ref_a).abs().max().item() < TOL
    assert (mixed[50 - 31:] - ref_b).abs().max().item() < TOL


def test_page_sizes_agree(tiny_model_dir):
    folder, _ = tiny_model_dir("llama")
    tokens = _tokens(45, 3)
    results = []
    for page in (1, 16):
        runner = ModelRunner(ServerArgs(model_path=folder, dtype="float32", page_size=page,
                                        max_total_tokens=1024, max_running_requests=4))
        d = ForwardSteps(runner)
        seq = d.start()
        out = [d.extend([seq], [tokens[:20]], return_all_logits=True)]
        out += [d.extend([seq], [[t]]) for t in tokens[20:]]
        d.release(seq)
        results.append(torch.cat(out))
    assert (results[0] - results[1]).abs().max().item() < TOL


@pytest.mark.parametrize("limit", [0.0, float("inf")], ids=["per-request", "padded"])
def test_extend_layouts_match(steps, monkeypatch, limit):
    """Both extend layouts of the torch attention path (one SDPA call per request, or all requests padded
    into one call) give the same logits as each sequence alone."""
    monkeypatch.setattr(torch_native, "PADDING_WASTE_LIMIT", limit)
    test_batched_with_other_lengths_matches(steps)
    test_mixed_extend_batch_of_prefill_and_continuation(steps)
    test_chunked_prefill_on_cached_prefix_matches(steps)
