"""wire.py: every message comes back equal after encode/decode; the per-token outputs travel as tagged tuples
of their fields (any value pickle carries, NumPy scalars included), every other message is pickled as it is."""

from __future__ import annotations

import pickle

import numpy as np

from tokenloom.protocol import AbortRequest, BatchStrOutput, BatchTokenOutput, FlushCacheRequest
from tokenloom.wire import decode, encode


def token_output(**changes) -> BatchTokenOutput:
    fields = dict(rids=["a", "b"], new_token_ids=[[1, 2], []],
                  finished_reasons=[None, {"type": "stop", "matched": 2}],
                  meta=[{"id": "a", "prompt_tokens": 3, "completion_tokens": 2, "cached_tokens": 0,
                         "output_token_logprobs": [(-0.5, 1), (-1.25, 2)]},
                        {"id": "b", "prompt_tokens": 4, "input_token_logprobs": [(None, 7), (-2.0, 8)]}],
                  skip_special_tokens=[True, False], stop_strings=[[], ["\n\n"]], no_stop_trim=[False, True])
    fields.update(changes)
    return BatchTokenOutput(**fields)


def test_token_outputs_travel_tagged_and_come_back_equal():
    msg = token_output()
    data = encode(msg)
    assert data[:1] == b"T"
    back = decode(data)
    assert type(back) is BatchTokenOutput and back == msg
    assert back.meta[1]["input_token_logprobs"][0] == (None, 7)  # tuples stay tuples


def test_str_outputs_travel_tagged():
    msg = BatchStrOutput(rids=["a"], texts=["héllo ✓"], output_ids=[[5, 6]], finished_reasons=[None],
                         meta=[{"id": "a", "completion_tokens": 2}])
    data = encode(msg)
    assert data[:1] == b"S"
    assert decode(data) == msg


def test_any_picklable_value_comes_back_as_itself():
    msg = token_output(meta=[{"id": "a", "score": np.float32(0.5)}, {"id": "b"}])
    data = encode(msg)
    assert data[:1] == b"T"
    back = decode(data)
    assert back == msg and isinstance(back.meta[0]["score"], np.float32)


def test_other_messages_are_pickled():
    for msg in (AbortRequest("r", "gone"), FlushCacheRequest(), {"status": "ready"}):
        data = encode(msg)
        assert data == pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        assert decode(data) == msg
