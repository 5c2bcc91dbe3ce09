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


@pytest.mark.parametrize("receiving", ["thread", "loop"])
def test_the_server_process_detokenizes_and_a_failing_batch_fails_only_its_requests(tokenizer, receiving):
    """Without --detokenizer-process the TokenizerManager turns token outputs into text where it receives them
    (its receiver thread, or the HTTP server's loop that took the socket over); a batch whose detokenization
    raises ends its requests with a DetokenizeError (HTTP 500), aborts those still running, and the next batch
    is served. On the loop the outputs are in the queues at once; from the thread they arrive through the loop."""
    import asyncio
    from types import SimpleNamespace

    from tokenloom.frontend.tokenizer_manager import DetokenizeError, ReqState, TokenizerManager
    from tokenloom.protocol import AbortRequest

    manager = TokenizerManager.__new__(TokenizerManager)  # the receive side only: no runtime behind it
    manager.detokenizer, manager.rid_to_state, manager.dead_error = DetokenizerManager(tokenizer), {}, None
    manager.last_output_time = 0.0
    sent = []
    manager._send = sent.append
    loop = asyncio.new_event_loop()
    manager.reader = SimpleNamespace(loop=loop if receiving == "loop" else None)
    try:
        states = {rid: ReqState(rid, loop, asyncio.Queue()) for rid in ("good", "bad")}
        manager.rid_to_state.update(states)
        ids = tokenizer("Hello there", add_special_tokens=False).input_ids
        broken = _step("bad", [1, 2])
        broken.new_token_ids = [None]  # `handle` extends the request's ids with it: TypeError

        async def dispatch_all() -> int:
            manager._dispatch(_step("good", ids))
            manager._dispatch(broken)
            manager._dispatch(_step("good", [], finish_length(len(ids))))
            return states["good"].queue.qsize()

        queued_at_once = loop.run_until_complete(dispatch_all())
        assert queued_at_once == (2 if receiving == "loop" else 0)
        loop.run_until_complete(asyncio.sleep(0))  # the queued call_soon_threadsafe callbacks run
        good = [states["good"].queue.get_nowait() for _ in range(2)]
        assert [g["text"] for g in good] == ["Hello there", "Hello there"]
        assert good[1]["meta_info"]["finish_reason"]["type"] == "length"
        err = states["bad"].queue.get_nowait()
        assert isinstance(err, DetokenizeError) and "detokenizing the output failed" in str(err)
        assert [type(m) for m in sent] == [AbortRequest] and sent[0].rid == "bad"
        assert not manager.rid_to_state and "bad" not in manager.detokenizer.states
    finally:
        loop.close()


def test_the_text_decoder_equals_the_tokenizers_decode(tokenizer):
    """SmolLM2's fast tokenizer does no clean-up, so the detokenizer decodes with the Rust backend directly:
    the same text as `tokenizer.decode` for ordinary, multi-byte, partial and special-token ids, either skip."""
    from tokenloom.frontend.detokenizer import text_decoder

    assert tokenizer.clean_up_tokenization_spaces is False
    decode = text_decoder(tokenizer)
    ids = tokenizer("Hi there ☕ 日本 , . !", add_special_tokens=False).input_ids
    special = [tokenizer.eos_token_id, *ids[:3], tokenizer.eos_token_id]
    for case in (ids, ids[:-1], ids[1:2], special, []):
        for skip in (True, False):
            assert decode(case, skip) == tokenizer.decode(case, skip_special_tokens=skip), (case, skip)

    class Plain:  # no Rust backend, or clean-up wanted: the tokenizer's own decode
        clean_up_tokenization_spaces = True
        _tokenizer = None

        def decode(self, ids, skip_special_tokens):
            return f"{ids}/{skip_special_tokens}"

    assert text_decoder(Plain())([1, 2], False) == "[1, 2]/False"


def test_a_native_stream_whose_detokenization_fails_ends_with_the_error():
    """The output stream of a request failed by a `DetokenizeError` ends with an error event and [DONE]."""
    import asyncio
    import json

    from tokenloom.entrypoints.serving_generate import GenerateServing
    from tokenloom.entrypoints.serving_utils import SSE_DONE
    from tokenloom.frontend.tokenizer_manager import DetokenizeError

    async def items():
        yield 0, {"text": "Hi", "output_ids": [1], "meta_info": {"finish_reason": None}}
        raise DetokenizeError("detokenizing the output failed: boom")

    async def collect() -> list[str]:
        return [chunk async for chunk in GenerateServing(None)._stream(items(), [], False, False)]

    chunks = asyncio.run(collect())
    assert json.loads(chunks[0].removeprefix("data: "))["text"] == "Hi"
    error = json.loads(chunks[1].removeprefix("data: "))
    assert error == {"error": {"message": "detokenizing the output failed: boom"}}
    assert chunks[2] == SSE_DONE
