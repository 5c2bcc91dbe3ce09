"""`TokenTable` against a dict reference: writes and gathers by arbitrary, repeated and non-contiguous rows,
rows reused by other requests, and the overwrite a later step makes."""

from __future__ import annotations

import random

import torch

from tokenloom.executor.token_table import TokenTable


def test_gather_returns_the_newest_token_written_per_row():
    rng = random.Random(0)
    table, reference = TokenTable(64, torch.device("cpu")), {}
    for _ in range(500):
        rows = rng.sample(range(64), rng.randint(1, 16))  # distinct rows in one step, in any order
        tokens = [rng.randrange(50_000) for _ in rows]
        table.write(torch.tensor(rows), torch.tensor(tokens))
        reference.update(zip(rows, tokens, strict=True))
        asked = [rng.choice(list(reference)) for _ in range(rng.randint(1, 24))]  # repeats allowed
        assert table.gather(torch.tensor(asked)).tolist() == [reference[r] for r in asked]


def test_int32_tokens_are_stored_as_int64_and_a_reused_row_reads_its_new_request():
    table = TokenTable(4, torch.device("cpu"))
    table.write(torch.tensor([2]), torch.tensor([49_151], dtype=torch.int32))
    assert table.gather(torch.tensor([2])).dtype == torch.int64
    table.write(torch.tensor([2, 0]), torch.tensor([7, 9]))  # the row's next request: its prefill's token
    assert table.gather(torch.tensor([0, 2])).tolist() == [9, 7]
