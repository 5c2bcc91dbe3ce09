"""`ForwardBatch.build_decode` (the scheduler's steady-state decode path) against `ForwardBatch.build`."""

from __future__ import annotations

import pytest
import torch

from tokenloom.executor.inference import inference
from tokenloom.forward_batch import ForwardBatch, ForwardMode

FIELDS = ("input_ids", "positions", "req_pool_indices", "seq_lens", "out_cache_loc", "extend_prefix_lens",
          "extend_seq_lens", "extend_start_loc", "token_req_index", "prompt_lens")


@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_build_decode_gives_the_fields_build_gives(batch_size):
    gen = torch.Generator().manual_seed(batch_size)
    seq = torch.randint(1, 500, (batch_size,), generator=gen)
    rows = torch.randperm(64, generator=gen)[:batch_size]
    slots = torch.randint(1, 4000, (batch_size,), generator=gen)
    prompts = torch.randint(1, 300, (batch_size,), generator=gen)
    ids = torch.zeros(batch_size, dtype=torch.int64)
    want = ForwardBatch.build(ForwardMode.DECODE, ids, rows, seq - 1, seq, slots, prompt_lens=prompts)
    got = ForwardBatch.build_decode(ids, rows, seq - 1, seq, slots, int(seq.max()), prompts)
    assert got.forward_mode is ForwardMode.DECODE
    for name in FIELDS:
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert (got.max_seq_len, got.max_extend_len, got.return_all_logits) == (want.max_seq_len, 1, False)
    again = ForwardBatch.build_decode(ids, rows, seq - 1, seq, slots, int(seq.max()), prompts)
    assert again.extend_seq_lens is got.extend_seq_lens  # the per-size constants are made once


def test_build_decode_refuses_a_token_count_other_than_the_batch_size():
    seq = torch.tensor([4, 5])
    with pytest.raises(ValueError, match="one token per request"):
        ForwardBatch.build_decode(torch.zeros(3, dtype=torch.int64), torch.tensor([0, 1]), seq - 1, seq,
                                  torch.tensor([7, 8]), 5, torch.tensor([2, 2]))


def test_inference_decorator_enters_inference_mode_only_when_outside_it():
    @inference
    def make() -> torch.Tensor:
        return torch.ones(2)

    assert not torch.is_inference_mode_enabled()
    assert make().is_inference()
    assert not torch.is_inference_mode_enabled()  # left again after the call
    with torch.inference_mode():
        assert make().is_inference()
    assert make.__name__ == "make"
