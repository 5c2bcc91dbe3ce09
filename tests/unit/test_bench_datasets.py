"""bench_serving datasets: length draws (seeds, range ratio), the local vocabulary corpus, random / random-ids /
sharegpt / generated-shared-prefix rows, and their errors. Uses SmolLM2's tokenizer (no weights)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from tokenloom.bench.datasets import (
    DatasetError,
    VocabCorpus,
    build_dataset,
    compute_random_lens,
    load_sharegpt,
    sample_generated_shared_prefix,
    sample_random,
    sample_random_ids,
    sample_sharegpt,
)


@pytest.fixture(scope="module")
def tok():
    from tokenloom.config import ServerArgs
    from tokenloom.models.loader import resolve_model_source
    from tokenloom.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model_source(ServerArgs()))


def rng(seed: int = 1) -> np.random.Generator:
    return np.random.default_rng(seed)


def count(tok, text: str) -> int:
    return len(tok.encode(text, add_special_tokens=False))


@pytest.mark.parametrize("ratio,low", [(1.0, 100), (0.5, 50), (0.0, 1), (0.255, 25)])
def test_random_lens_range(ratio, low):
    lens = compute_random_lens(100, ratio, 2000, rng())
    assert lens.min() >= low and lens.max() <= 100
    if ratio < 1:  # both ends are reachable
        assert lens.min() == low and lens.max() == 100
    else:
        assert set(lens.tolist()) == {100}


def test_random_lens_seeded():
    assert (compute_random_lens(512, 0.0, 50, rng(7)) == compute_random_lens(512, 0.0, 50, rng(7))).all()
    assert (compute_random_lens(512, 0.0, 50, rng(7)) != compute_random_lens(512, 0.0, 50, rng(8))).any()


@pytest.mark.parametrize("length,ratio", [(0, 1.0), (10, -0.1), (10, 1.5)])
def test_random_lens_bad(length, ratio):
    with pytest.raises(DatasetError):
        compute_random_lens(length, ratio, 3, rng())


def test_vocab_corpus_words_roundtrip(tok):
    corpus = VocabCorpus(tok)
    assert len(corpus.words) > 1000
    ids = corpus.sample_ids(300, rng())
    assert len(ids) == 300
    assert tok.encode(tok.decode(ids), add_special_tokens=False) == ids


def test_random_text_lengths_and_seed(tok):
    rows = sample_random(tok, 12, 200, 64, 0.5, rng(3))
    assert len(rows) == 12
    for row in rows:
        assert isinstance(row.prompt, str)
        assert 100 <= row.prompt_len <= 200 and 32 <= row.output_len <= 64
        assert count(tok, row.prompt) == row.prompt_len  # the local corpus re-tokenizes exactly
    again = sample_random(tok, 12, 200, 64, 0.5, rng(3))
    assert [r.prompt for r in again] == [r.prompt for r in rows]
    other = sample_random(tok, 12, 200, 64, 0.5, rng(4))
    assert [r.prompt for r in other] != [r.prompt for r in rows]


def test_random_fixed_lengths(tok):
    rows = sample_random(tok, 5, 64, 16, 1.0, rng())
    assert {(r.prompt_len, r.output_len) for r in rows} == {(64, 16)}


def test_random_tokenize_prompt_and_chat_template(tok):
    rows = sample_random(tok, 3, 40, 8, 1.0, rng(), tokenize_prompt=True)
    assert all(isinstance(r.prompt, list) and len(r.prompt) == 40 == r.prompt_len for r in rows)
    chat = sample_random(tok, 3, 40, 8, 1.0, rng(), apply_chat_template=True)
    for row in chat:
        assert row.prompt.startswith("<|im_start|>") and row.prompt_len == count(tok, row.prompt) > 40


def write_sharegpt(path, convs) -> str:
    path.write_text(json.dumps([{"id": str(i), "conversations": c} for i, c in enumerate(convs)]))
    return str(path)


def turns(human: str, gpt: str) -> list[dict[str, str]]:
    return [{"from": "human", "value": human}, {"from": "gpt", "value": gpt}]


def test_random_from_sharegpt_file_truncates_and_repeats(tok, tmp_path):
    path = write_sharegpt(tmp_path / "s.json", [turns("hello world", "hi there"),
                                                turns("a much longer question " * 20, "ok fine")])
    rows = sample_random(tok, 4, 30, 8, 1.0, rng(), dataset_path=path)
    assert all(r.prompt_len == 30 for r in rows)
    texts = {r.prompt for r in rows}
    assert any("hello worldhello world" in t for t in texts)  # short prompts repeat to length


def test_random_ids(tok):
    rows = sample_random_ids(tok, 6, 50, 10, 1.0, rng(5), tokenize_prompt=True)
    vocab = tok.vocab_size
    for row in rows:
        assert row.prompt_len == 50 == len(row.prompt) and row.output_len == 10
        start = row.prompt[0]
        assert row.prompt == [(start + j) % vocab for j in range(50)]
    offsets = [r.prompt[0] for r in rows]
    assert len(set(offsets)) == 6
    assert [r.prompt for r in sample_random_ids(tok, 6, 50, 10, 1.0, rng(5), tokenize_prompt=True)] == \
           [r.prompt for r in rows]
    text_rows = sample_random_ids(tok, 2, 50, 10, 0.0, rng(5))
    assert all(isinstance(r.prompt, str) and 1 <= r.prompt_len <= 50 for r in text_rows)


def test_sharegpt_filters_and_lengths(tok, tmp_path):
    convs = [turns("What is the capital of France?", "The capital of France is Paris."),
             turns("x", "A one-token prompt is dropped."),
             turns("Tell me a story about a dragon.", "Once upon a time there was a dragon."),
             [{"from": "human", "value": "only one turn"}]]
    path = write_sharegpt(tmp_path / "s.json", convs)
    rows = sample_sharegpt(tok, 2, path, rng())
    assert sorted(r.prompt for r in rows) == ["Tell me a story about a dragon.", "What is the capital of France?"]
    for row in rows:
        assert row.prompt_len == count(tok, row.prompt) and row.output_len >= 2
    fixed = sample_sharegpt(tok, 2, path, rng(), fixed_output_len=7)
    assert {r.output_len for r in fixed} == {7}
    with pytest.raises(DatasetError, match="only 2 usable"):
        sample_sharegpt(tok, 3, path, rng())
    with pytest.raises(DatasetError, match="only 0 usable"):
        sample_sharegpt(tok, 1, path, rng(), context_len=5)


def test_sharegpt_bad_files(tmp_path):
    with pytest.raises(DatasetError, match="not found"):
        load_sharegpt(str(tmp_path / "missing.json"))
    with pytest.raises(DatasetError, match="required"):
        load_sharegpt("")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(DatasetError, match="JSON"):
        load_sharegpt(str(bad))
    bad.write_text(json.dumps({"conversations": []}))
    with pytest.raises(DatasetError, match="list"):
        load_sharegpt(str(bad))
    bad.write_text(json.dumps([{"conversations": [{"from": "human", "value": "hi"}]}]))
    with pytest.raises(DatasetError, match="two turns"):
        load_sharegpt(str(bad))


def test_generated_shared_prefix(tok):
    rows = sample_generated_shared_prefix(tok, 3, 4, 60, 12, 9, 1.0, rng(), ordered=True)
    assert len(rows) == 12 and {r.output_len for r in rows} == {9}
    for g in range(3):
        group = rows[4 * g: 4 * g + 4]
        prefixes = {r.prompt.split("\n\n")[0] for r in group}
        assert len(prefixes) == 1
        assert count(tok, prefixes.pop()) == 60
        assert all(r.prompt_len == count(tok, r.prompt) for r in group)
    assert len({r.prompt.split("\n\n")[0] for r in rows}) == 3
    shuffled = sample_generated_shared_prefix(tok, 3, 4, 60, 12, 9, 1.0, rng(), ordered=False)
    assert sorted(r.prompt for r in shuffled) == sorted(r.prompt for r in rows)
    assert [r.prompt for r in shuffled] != [r.prompt for r in rows]
    fast = sample_generated_shared_prefix(tok, 2, 2, 60, 12, 9, 1.0, rng(), fast_prepare=True)
    assert {r.prompt_len for r in fast} == {72}
    ranged = sample_generated_shared_prefix(tok, 4, 8, 60, 12, 9, 0.5, rng())
    assert all(1 <= r.output_len <= 9 for r in ranged) and len({r.output_len for r in ranged}) > 1


def test_build_dataset_dispatch(tok):
    args = SimpleNamespace(seed=2, dataset_name="random-ids", num_prompts=3, random_input_len=20,
                           random_output_len=5, random_range_ratio=1.0, dataset_path="", apply_chat_template=False,
                           tokenize_prompt=False)
    rows = build_dataset(args, tok)
    assert len(rows) == 3 and all(r.prompt_len == 20 for r in rows)
    args.dataset_name = "nope"
    with pytest.raises(DatasetError, match="unknown dataset"):
        build_dataset(args, tok)
