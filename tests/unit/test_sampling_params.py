"""SamplingParams.from_dict: validation errors name the key, normalisation of greedy and top_k."""

from __future__ import annotations

import pytest
import torch

from tokenloom.sampling.sampling_batch import SamplingBatchInfo
from tokenloom.sampling.sampling_params import SamplingParams, SamplingParamsError

VOCAB = 100


@pytest.mark.parametrize("d, key", [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"top_p": -0.5}, "top_p"),
    ({"top_p": float("nan")}, "top_p"),
    ({"min_p": -0.01}, "min_p"),
    ({"min_p": 1.5}, "min_p"),
    ({"top_k": 0}, "top_k"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 2.0}, "top_k"),
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"frequency_penalty": -2.01}, "frequency_penalty"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"presence_penalty": -2.5}, "presence_penalty"),
    ({"repetition_penalty": -0.1}, "repetition_penalty"),
    ({"repetition_penalty": 2.1}, "repetition_penalty"),
    ({"max_new_tokens": -1}, "max_new_tokens"),
    ({"max_new_tokens": 1.5}, "max_new_tokens"),
    ({"max_new_tokens": "10"}, "max_new_tokens"),
    ({"min_new_tokens": 5, "max_new_tokens": 4}, "min_new_tokens"),
    ({"min_new_tokens": -1}, "min_new_tokens"),
    ({"n": 0}, "n"),
    ({"n": 1.0}, "n"),
    ({"bogus": 1}, "bogus"),
    ({"temperature": 1.0, "is_greedy": True}, "is_greedy"),
    ({"logit_bias": {"100": 1.0}}, "logit_bias"),
    ({"logit_bias": {"-1": 1.0}}, "logit_bias"),
    ({"logit_bias": {"abc": 1.0}}, "logit_bias"),
    ({"logit_bias": {"3": "x"}}, "logit_bias"),
    ({"logit_bias": [1, 2]}, "logit_bias"),
    ({"stop": 5}, "stop"),
    ({"stop": ["ok", 3]}, "stop"),
    ({"stop": ""}, "stop"),
    ({"stop": ("a", "b")}, "stop"),
    ({"stop_token_ids": 3}, "stop_token_ids"),
    ({"stop_token_ids": [1, "2"]}, "stop_token_ids"),
    ({"stop_token_ids": [1, True]}, "stop_token_ids"),
    ({"stop_token_ids": [VOCAB]}, "stop_token_ids"),
    ({"stream_interval": 0}, "stream_interval"),
    ({"sampling_seed": 1.5}, "sampling_seed"),
    ({"sampling_seed": True}, "sampling_seed"),
    ({"regex": 5}, "regex"),
    ({"json_schema": {"type": "object"}}, "json_schema"),
    ({"ebnf": ["root ::= 'a'"]}, "ebnf"),
    ({"stop_regex": "x"}, "stop_regex"),
    ({"structural_tag": 1}, "structural_tag"),
    ({"regex": "a+", "json_schema": "{}"}, "only one of json_schema, regex"),
    ({"regex": "a+", "min_new_tokens": 2, "max_new_tokens": 4}, "min_new_tokens cannot be combined with regex"),
])
def test_invalid_values_raise_naming_the_key(d, key):
    with pytest.raises(SamplingParamsError, match=key):
        SamplingParams.from_dict(d, VOCAB)


def test_error_is_a_value_error():
    assert issubclass(SamplingParamsError, ValueError)


def test_unknown_keys_all_named():
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams.from_dict({"zeta": 1, "alpha": 2, "temperature": 0.5})
    assert "alpha" in str(err.value) and "zeta" in str(err.value)


@pytest.mark.parametrize("d", [
    {"top_p": 1.0}, {"top_p": 1e-9}, {"min_p": 0.0}, {"min_p": 1.0}, {"top_k": -1}, {"top_k": 1},
    {"top_k": 10**6}, {"frequency_penalty": -2}, {"frequency_penalty": 2}, {"presence_penalty": 2.0},
    {"repetition_penalty": 2}, {"max_new_tokens": 0}, {"max_new_tokens": None, "min_new_tokens": 50},
    {"min_new_tokens": 4, "max_new_tokens": 4}, {"n": 3}, {"logit_bias": {"0": -5, "99": 2.5}},
    {"stop": "x"}, {"stop": ["a", "bc"]}, {"stop_token_ids": [0, VOCAB - 1]}, {"stream_interval": 2},
    {"sampling_seed": -5}, {"temperature": 0}, {"custom_params": {"a": 1}},
])
def test_valid_values_accepted(d):
    p = SamplingParams.from_dict(d, VOCAB)
    for k, v in d.items():
        if k not in ("temperature", "top_k", "stop"):
            assert getattr(p, k) == v


def test_defaults_and_none():
    p = SamplingParams.from_dict(None)
    q = SamplingParams.from_dict({})
    assert p == q
    assert p.max_new_tokens == 128 and p.temperature == 1.0 and p.top_p == 1.0
    assert p.top_k == -1  # no vocabulary size: stays "all"
    assert not p.is_greedy and not p.uses_penalties
    assert p.stop_strings == []


@pytest.mark.parametrize("t", [0, 0.0, 1e-7])
def test_temperature_zero_is_greedy(t):
    p = SamplingParams.from_dict({"temperature": t, "top_k": 40, "top_p": 0.5}, VOCAB)
    assert p.is_greedy
    assert p.top_k == 1
    assert p.temperature == 1.0  # no division by zero downstream


def test_top_k_one_is_greedy():
    p = SamplingParams.from_dict({"top_k": 1, "temperature": 0.8}, VOCAB)
    assert p.is_greedy and p.top_k == 1 and p.temperature == 0.8


def test_small_positive_temperature_is_not_greedy():
    p = SamplingParams.from_dict({"temperature": 0.01}, VOCAB)
    assert not p.is_greedy and p.top_k == VOCAB


def test_top_k_minus_one_becomes_vocab_size():
    assert SamplingParams.from_dict({"top_k": -1}, VOCAB).top_k == VOCAB
    assert SamplingParams.from_dict({}, 7).top_k == 7
    assert SamplingParams.from_dict({"top_k": 5}, VOCAB).top_k == 5


def test_stop_string_normalised_to_list():
    p = SamplingParams.from_dict({"stop": "END"})
    assert p.stop == ["END"] and p.stop_strings == ["END"]
    p = SamplingParams.from_dict({"stop": ["a", "b"]})
    assert p.stop_strings == ["a", "b"]


@pytest.mark.parametrize("d, expected", [
    ({}, False), ({"frequency_penalty": 0.1}, True), ({"presence_penalty": -0.1}, True),
    ({"repetition_penalty": 1.1}, True), ({"repetition_penalty": 1.0, "frequency_penalty": 0.0}, False),
])
def test_uses_penalties(d, expected):
    assert SamplingParams.from_dict(d).uses_penalties is expected


def test_vocab_checks_skipped_without_vocab_size():
    p = SamplingParams.from_dict({"logit_bias": {"123456": 1.0}, "stop_token_ids": [10**6]})
    assert p.logit_bias == {"123456": 1.0}


def test_batch_info_top_k_clamped_to_vocab():
    ps = [SamplingParams.from_dict(d) for d in ({"top_k": 500}, {}, {"top_k": 3}, {"temperature": 0})]
    info = SamplingBatchInfo.from_requests(ps, [[1]] * 4, [[]] * 4, VOCAB, [0], torch.device("cpu"))
    assert info.top_ks.tolist() == [VOCAB, VOCAB, 3, 1]
    assert info.is_greedy.tolist() == [False, False, False, True]
    assert not info.all_greedy
    assert info.output_counts is None and info.logit_bias is None and info.min_tokens_mask is None


def test_nan_temperature_rejected():
    with pytest.raises(SamplingParamsError, match="temperature"):
        SamplingParams.from_dict({"temperature": float("nan")}, VOCAB)


def test_huge_sampling_seed_rejected_or_usable():
    try:
        p = SamplingParams.from_dict({"sampling_seed": 2**64 + 3}, VOCAB)
    except SamplingParamsError as e:
        assert "sampling_seed" in str(e)
        return
    SamplingBatchInfo.from_requests([p], [[1]], [[]], VOCAB, [0], torch.device("cpu"))
