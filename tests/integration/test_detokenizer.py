"""Incremental detokenization with SmolLM2's tokenizer: streamed text never contains broken UTF-8, is
always a prefix of the final text, holds back a possible stop-string start, and trims matched stops."""

from __future__ import annotations

import pytest

from tokenloom.finish_reason import finish_length, finish_stop
from tokenloom.frontend.detokenizer import DetokenizerManager, _held_back
from tokenloom.protocol import BatchTokenOutput


@pytest.fixture(scope="module")
def tokenizer():
    from tokenloom.config import ServerArgs
    from tokenloom.models.loader import resolve_model_source
    from tokenloom.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model_source(ServerArgs()))


def _step(rid, ids, finished=None, stops=(), no_trim=False):
    return BatchTokenOutput(rids=[rid], new_token_ids=[ids], finished_reasons=[finished], meta=[{}],
                            skip_special_tokens=[True], stop_strings=[list(stops)], no_stop_trim=[no_trim])


def test_multibyte_characters_never_split(tokenizer):
    text = "Café ☕ naïve 日本語のテキスト 🎉🎉 done — ok"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    manager = DetokenizerManager(tokenizer)
    seen = []
    for i, token in enumerate(ids):
        last = i == len(ids) - 1
        out = manager.handle(_step("r", [token], finish_length(len(ids)) if last else None))
        seen.append(out.texts[0])
    assert all("\ufffd" not in s for s in seen)
    for a, b in zip(seen, seen[1:], strict=False):
        assert b.startswith(a)
    assert seen[-1] == tokenizer.decode(ids, skip_special_tokens=True)
    # Some token ends inside a multi-byte character: that step must release nothing new.
    partial = [i for i in range(1, len(ids)) if tokenizer.decode(ids[: i + 1]).endswith("\ufffd")]
    assert partial and all(seen[i] == seen[i - 1] for i in partial)
    assert "r" not in manager.states


def test_stop_string_prefix_is_held_back_then_trimmed(tokenizer):
    ids = tokenizer("Hello world, the END is near", add_special_tokens=False).input_ids
    manager = DetokenizerManager(tokenizer)
    texts = []
    for token in ids[:-1]:
        texts.append(manager.handle(_step("s", [token], stops=["END is"])).texts[0])
    assert all("END" not in t for t in texts)  # " END" could start the stop string: held back
    final = manager.handle(_step("s", [ids[-1]], finish_stop("END is"), stops=["END is"])).texts[0]
    assert final == "Hello world, the "
    kept = DetokenizerManager(tokenizer).handle(_step("k", ids, finish_stop("END is"), stops=["END is"],
                                                      no_trim=True)).texts[0]
    assert kept == "Hello world, the END is near"


def test_held_back_lengths():
    assert _held_back("abc EN", ["END"]) == 2
    assert _held_back("abc E", ["END", "xyz"]) == 1
    assert _held_back("abc", ["END"]) == 0
    assert _held_back("a END b", ["END"]) == 5


def test_stop_token_is_trimmed_from_text(tokenizer):
    ids = tokenizer("one two three", add_special_tokens=False).input_ids
    out = DetokenizerManager(tokenizer).handle(_step("t", ids, finish_stop(ids[-1])))
    assert out.texts[0] == tokenizer.decode(ids[:-1])
    assert out.output_ids[0] == ids
