"""The new-token budget and the stop rule (`tokenloom.sampling.stopping`), each decided in one place."""

from __future__ import annotations

import pytest

from tokenloom.sampling.sampling_params import SamplingParams
from tokenloom.sampling.stopping import cap_new_tokens, finish_reason, new_token_room

EOS = (2,)


def _params(**kw) -> SamplingParams:
    return SamplingParams.from_dict(kw, 64)


@pytest.mark.parametrize("window", [8, 100])
def test_room_is_sglangs_rule_prompt_plus_new_tokens_below_the_window(window):
    for prompt in range(1, window):
        for new in range(0, window + 2):
            assert (new <= new_token_room(prompt, window)) == (prompt + new < window)


def test_cap_sets_or_lowers_max_and_keeps_min_within():
    unset = _params(max_new_tokens=None)
    cap_new_tokens(unset, 7)
    assert unset.max_new_tokens == 7
    high = _params(max_new_tokens=50, min_new_tokens=30)
    cap_new_tokens(high, 10)
    assert (high.max_new_tokens, high.min_new_tokens) == (10, 10)
    low = _params(max_new_tokens=4, min_new_tokens=2)
    cap_new_tokens(low, 10)
    assert (low.max_new_tokens, low.min_new_tokens) == (4, 2)


def test_no_output_yet_only_prompt_scoring_finishes():
    assert finish_reason(_params(max_new_tokens=0), [], EOS) == {"type": "length", "length": 0}
    assert finish_reason(_params(max_new_tokens=1), [], EOS) is None


def test_length_then_stops_on_the_last_allowed_token():
    params = _params(max_new_tokens=3)
    assert finish_reason(params, [5, 6], EOS) is None
    assert finish_reason(params, [5, 6, 7], EOS) == {"type": "length", "length": 3}
    assert finish_reason(params, [5, 6, 2], EOS) == {"type": "stop", "matched": 2}  # a stop wins over length


def test_eos_stop_ids_min_new_tokens_and_ignore_eos():
    assert finish_reason(_params(), [5, 2], EOS) == {"type": "stop", "matched": 2}
    assert finish_reason(_params(min_new_tokens=3), [5, 2], EOS) is None
    assert finish_reason(_params(min_new_tokens=2), [5, 2], EOS) == {"type": "stop", "matched": 2}
    assert finish_reason(_params(ignore_eos=True), [5, 2], EOS) is None
    assert finish_reason(_params(ignore_eos=True, stop_token_ids=[9]), [5, 9], EOS) == {"type": "stop", "matched": 9}


def test_stop_strings_read_the_decoded_tail():
    params = _params(stop=["end"])
    asked = []

    def tail(n: int) -> str:
        asked.append(n)
        return "the end"

    assert finish_reason(params, [5, 6, 7, 8, 9, 10], EOS, tail) == {"type": "stop", "matched": "end"}
    assert asked == [len("end") + 2]
    assert finish_reason(params, [5], EOS, lambda n: "no") is None
    assert finish_reason(params, [5], EOS) is None  # no decoder given: stop strings are not checked
