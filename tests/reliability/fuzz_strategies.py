"""Hypothesis strategies for hostile and valid request bodies: SGLang's sampling_params (every key tokenloom's
`SamplingParams` accepts) and the bodies of /generate, /v1/completions, /v1/chat/completions, /abort_request and
the query of /v1/loads.

Each value is drawn valid, at a boundary, or invalid (wrong type, NaN/inf, huge or negative numbers, nested junk,
unicode with lone surrogates). Generation lengths stay at a few tokens whenever the length is valid, so each
example costs milliseconds against the tiny model (`SMALL`); `valid_sampling_params` draws only values the server
must accept, for the property that a valid request always generates.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from hypothesis import strategies as st

from tokenloom.sampling.sampling_params import SamplingParams

VOCAB = 49152  # the tiny model's (SmolLM2's) vocabulary
SMALL = st.integers(0, 4)  # generation lengths: every example stays fast
SAMPLING_KEYS = tuple(f.name for f in dataclasses.fields(SamplingParams) if f.init)

# --- junk: anything JSON can carry, and what Python's json also emits (NaN, Infinity) ---------------------
HUGE_INTS = st.sampled_from([2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30, -(10**30), 10**400])
SURROGATES = st.sampled_from(["\ud800", "\udfff", "a\udc80b", "\ud83d"])
unicode_text = st.one_of(st.text(max_size=12), st.text(st.characters(), max_size=6), SURROGATES,
                          st.sampled_from(["", " ", "\x00", "😀" * 3, "\u202e", "<|im_end|>", "</s>"]))
numbers = st.one_of(st.integers(-(2**70), 2**70), HUGE_INTS, st.floats(allow_nan=True, allow_infinity=True),
                    st.sampled_from([float("nan"), float("inf"), -float("inf"), 5e-324, 1.7e308, -0.0]))
leaves = st.one_of(st.none(), st.booleans(), numbers, unicode_text)
junk = st.recursive(leaves, lambda children: st.one_of(st.lists(children, max_size=3),
                                                       st.dictionaries(unicode_text, children, max_size=3)),
                    max_leaves=6)

# JSON values a valid body may carry anywhere (valid Unicode strings, finite numbers)
json_leaves = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False),
                        st.text(max_size=6))
json_values = st.recursive(json_leaves, lambda children: st.one_of(
    st.lists(children, max_size=3), st.dictionaries(st.text(max_size=4), children, max_size=3)), max_leaves=6)


def ranged(low: float, high: float, *boundaries: float) -> st.SearchStrategy[float]:
    """Floats in [low, high], with the interval's ends and the given boundary values drawn often."""
    return st.one_of(st.floats(low, high), st.sampled_from([low, high, *boundaries]))


token_ids = st.integers(0, VOCAB - 1)
stop_strings = st.one_of(st.text(min_size=1, max_size=4), st.lists(st.text(min_size=1, max_size=4), max_size=3))

# Values the server accepts for each key (the length keys are kept small). Boundaries included: the greedy
# threshold of temperature, the smallest positive float, the ends of each range, top_k past the vocabulary.
VALID: dict[str, st.SearchStrategy[Any]] = {
    "max_new_tokens": SMALL,
    "stop": st.one_of(st.none(), stop_strings),
    "stop_token_ids": st.one_of(st.none(), st.lists(token_ids, max_size=4)),
    "temperature": ranged(0.0, 2.0, 1e-6, 0.99e-6, 5e-324, 1e308),
    "top_p": ranged(5e-324, 1.0, 1e-300),
    "top_k": st.one_of(st.just(-1), st.integers(1, VOCAB + 10), st.sampled_from([1, VOCAB, VOCAB + 1, 2**63 - 1])),
    "min_p": ranged(0.0, 1.0),
    "frequency_penalty": ranged(-2.0, 2.0),
    "presence_penalty": ranged(-2.0, 2.0),
    "repetition_penalty": ranged(5e-324, 2.0, 1e-300),
    "min_new_tokens": SMALL,
    "n": st.integers(1, 3),
    "ignore_eos": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "spaces_between_special_tokens": st.booleans(),
    "no_stop_trim": st.booleans(),
    "stream_interval": st.one_of(st.none(), st.integers(1, 5)),
    "logit_bias": st.one_of(st.none(), st.dictionaries(token_ids.map(str), st.one_of(
        ranged(-100.0, 100.0, 1e308, -1e308, 3.5e38, -3.5e38), st.floats(allow_nan=False, allow_infinity=False)),
        max_size=3)),
    "sampling_seed": st.one_of(st.none(), st.integers(), HUGE_INTS),
    "json_schema": st.none(), "regex": st.none(), "ebnf": st.none(), "stop_regex": st.none(),
    "structural_tag": st.none(),
    "custom_params": st.one_of(st.none(), st.dictionaries(st.text(max_size=6), json_values, max_size=3)),
}
assert set(VALID) == set(SAMPLING_KEYS), set(SAMPLING_KEYS) ^ set(VALID)

# Values the server must refuse with a 400 naming the key (besides the junk any key may get).
INVALID: dict[str, st.SearchStrategy[Any]] = {
    "max_new_tokens": st.one_of(st.integers(max_value=-1), st.just(5000), HUGE_INTS),
    "stop": st.one_of(st.just(""), st.lists(st.integers(), min_size=1, max_size=2)),
    "stop_token_ids": st.lists(st.one_of(st.integers(max_value=-1), st.integers(min_value=VOCAB)), min_size=1,
                               max_size=2),
    "temperature": st.one_of(st.floats(max_value=-1e-9), st.sampled_from([float("nan"), float("inf"), 10**400])),
    "top_p": st.one_of(st.floats(max_value=0.0), st.floats(min_value=1.0000001)),
    "top_k": st.one_of(st.just(0), st.integers(max_value=-2), HUGE_INTS),
    "min_p": st.one_of(st.floats(max_value=-1e-9), st.floats(min_value=1.0000001)),
    "frequency_penalty": st.one_of(st.floats(max_value=-2.0000001), st.floats(min_value=2.0000001)),
    "presence_penalty": st.sampled_from([-2.5, 2.5, float("-inf"), 10**400]),
    "repetition_penalty": st.one_of(st.floats(max_value=0.0), st.floats(min_value=2.0000001)),
    "min_new_tokens": st.one_of(st.integers(max_value=-1), st.integers(5, 10**6)),
    "n": st.one_of(st.integers(max_value=0), st.integers(17, 10**6), HUGE_INTS),
    "ignore_eos": st.one_of(st.integers(), st.text(max_size=3)),
    "skip_special_tokens": st.one_of(st.integers(), st.lists(st.booleans(), max_size=2)),
    "spaces_between_special_tokens": st.one_of(st.integers(), st.text(max_size=3)),
    "no_stop_trim": st.one_of(st.integers(), st.dictionaries(st.text(max_size=2), st.booleans(), max_size=1)),
    "stream_interval": st.one_of(st.integers(max_value=0), st.floats()),
    "logit_bias": st.one_of(st.dictionaries(st.sampled_from(["-1", str(VOCAB), "x", "1.5", ""]), numbers, min_size=1,
                                            max_size=2),
                            st.dictionaries(token_ids.map(str), st.sampled_from([float("nan"), float("inf")]),
                                            min_size=1, max_size=1)),
    "sampling_seed": st.one_of(st.floats(), st.text(max_size=3)),
    # grammars: wrong types, and texts that do not parse (a valid grammar is a request to serve, not refuse)
    "json_schema": st.one_of(st.integers(), st.sampled_from(['{"type": "strin"}', "{", "[1]", '{"required": 5}'])),
    "regex": st.one_of(st.integers(), st.sampled_from(["a(", "[a-", "(?<=a)b"])),
    "ebnf": st.one_of(st.integers(), st.sampled_from(['foo ::= "a"', "root ::=", "root ::= bar"])),
    "stop_regex": st.text(min_size=1, max_size=5),
    "structural_tag": st.one_of(st.integers(), st.sampled_from(["{", "[]", '{"type": "structural_tag"}'])),
    "custom_params": st.one_of(st.lists(junk, max_size=2), st.text(max_size=3), st.integers()),
}


@st.composite
def valid_sampling_params(draw: st.DrawFn) -> dict[str, Any]:
    """A sampling_params object the server must accept (max_new_tokens always set and small)."""
    keys = draw(st.lists(st.sampled_from(SAMPLING_KEYS), unique=True, max_size=8))
    params = {key: draw(VALID[key]) for key in keys}
    params["max_new_tokens"] = params.get("max_new_tokens", draw(SMALL))
    if "min_new_tokens" in params:
        params["min_new_tokens"] = min(params["min_new_tokens"], params["max_new_tokens"])
    return params


@st.composite
def any_sampling_params(draw: st.DrawFn) -> dict[str, Any]:
    """A sampling_params object with up to two invalid or junk values among valid ones (a third of them all
    valid, so that odd but valid values reach the scheduler), sometimes with an unknown key."""
    keys = draw(st.lists(st.sampled_from(SAMPLING_KEYS), unique=True, max_size=6))
    bad = draw(st.integers(0, 2))
    params = {key: draw(st.one_of(INVALID[key], junk) if i < bad else VALID[key]) for i, key in enumerate(keys)}
    if draw(st.integers(0, 9)) == 0:
        params[draw(unicode_text)] = draw(junk)  # an unknown (or misspelt, or unicode) key
    return params


GENERATING_ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions")
LENGTH_KEYS = ("max_new_tokens", "max_tokens", "max_completion_tokens")
CONTEXT = 4096  # the fuzzed server's --context-length


def keep_fast(params: dict[str, Any], default_key: str) -> dict[str, Any]:
    """`params` (a sampling_params or OpenAI body, changed in place) with every generation length a valid request
    would spend long on cut to a few tokens: an int between 5 and the context (a longer one is refused at once), and
    an unset or null one (the route's default: 128 tokens, or until the context is full for chat), which becomes
    `default_key` = 4 unless another length key is set."""
    for key in LENGTH_KEYS:
        value = params.get(key)
        length = as_length(value)
        if length is not None and 4 < length < CONTEXT:
            params[key] = length % 5
        elif key in params and value is None:
            del params[key]
    if not any(key in params for key in LENGTH_KEYS):
        params[default_key] = 4
    return params


def fast_body(route: str, body: Any) -> Any:
    """A request body of `route` with `keep_fast` applied where its generation lengths live."""
    if not isinstance(body, dict):
        return body
    if route == "/generate":
        def fast(one: Any) -> Any:
            if one is None:  # null or absent: the defaults (128 tokens)
                one = {}
            return keep_fast(one, "max_new_tokens") if isinstance(one, dict) else one

        params = body.get("sampling_params")
        body["sampling_params"] = [fast(one) for one in params] if isinstance(params, list) else fast(params)
        return body
    return keep_fast(body, "max_completion_tokens" if route == "/v1/chat/completions" else "max_tokens")


def as_length(value: Any) -> int | None:
    """The integer a route's validation may read `value` as (pydantic takes 7.0 and "7" for an int), or None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and re.fullmatch(r"\s*[+-]?[0-9]{1,18}\s*", value):
        return int(value)
    return None


# --- prompts -------------------------------------------------------------------------------------------
valid_text = st.text(min_size=1, max_size=24)
valid_ids = st.lists(token_ids, min_size=1, max_size=12)
valid_prompt = st.one_of(valid_text, valid_ids, st.lists(valid_text, min_size=1, max_size=3),
                         st.lists(valid_ids, min_size=1, max_size=3))
bad_prompt = st.one_of(unicode_text, st.lists(st.one_of(st.integers(), HUGE_INTS, st.booleans(), st.floats()),
                                              max_size=3),
                       st.lists(st.one_of(valid_text, valid_ids, junk), max_size=3), junk)

# A field is (valid values, bad values): a body draws some fields and makes at most two of them bad.
Field = tuple[st.SearchStrategy[Any], st.SearchStrategy[Any]]
UNSET = st.sampled_from([None, False, [], {}, ""])  # what an unsupported or ignored field may be and still pass


def either(valid: st.SearchStrategy[Any], bad: st.SearchStrategy[Any] | None = None) -> Field:
    return valid, junk if bad is None else st.one_of(bad, junk)


FLAG = either(st.booleans())
JUNK_ONLY = (UNSET, junk)


def some_fields(fields: dict[str, Field], draw: st.DrawFn, max_fields: int = 6) -> dict[str, Any]:
    """Some of `fields`, up to two of them drawn bad and the others valid."""
    names = draw(st.lists(st.sampled_from(sorted(fields)), unique=True, max_size=max_fields))
    bad = draw(st.integers(0, 2))
    return {name: draw(fields[name][1] if i < bad else fields[name][0]) for i, name in enumerate(names)}


GENERATE_FIELDS: dict[str, Field] = {
    "rid": either(st.text(min_size=1, max_size=8), st.lists(st.text(max_size=4), max_size=3)),
    "stream": FLAG, "return_logprob": FLAG, "return_text_in_logprobs": FLAG, "return_prompt_token_ids": FLAG,
    "logprob_start_len": either(st.integers(-1, 3), st.integers(-3, 14)),
    "top_logprobs_num": either(st.integers(0, 20), st.sampled_from([-1, 21, 10**6])),
    "token_ids_logprob": either(st.one_of(st.lists(token_ids, max_size=3),
                                          st.lists(st.lists(token_ids, max_size=2), max_size=3))),
    "image_data": JUNK_ONLY, "lora_path": JUNK_ONLY, "input_embeds": JUNK_ONLY,  # unsupported
    "return_hidden_states": JUNK_ONLY,
    "model": (junk, junk), "priority": (junk, junk), "bootstrap_room": (junk, junk),  # ignored hints
}


@st.composite
def generate_bodies(draw: st.DrawFn) -> dict[str, Any]:
    """A /generate body: a prompt (text, ids, a batch, junk or none) with sampling params and other fields."""
    body = some_fields(GENERATE_FIELDS, draw)
    kind = draw(st.sampled_from(["text", "text", "input_ids", "input_ids", "none"]))
    if kind != "none":
        body[kind] = draw(st.one_of(valid_prompt, valid_prompt, bad_prompt))
    choice = draw(st.integers(0, 4))
    if choice < 3:
        body["sampling_params"] = draw(any_sampling_params() if choice else valid_sampling_params())
    else:
        body["sampling_params"] = draw(st.lists(any_sampling_params(), max_size=3) if choice == 3 else junk)
    return fast_body("/generate", body)


# --- OpenAI routes ---------------------------------------------------------------------------------------
OPENAI_SAMPLING: dict[str, Field] = {
    "temperature": either(VALID["temperature"], INVALID["temperature"]),
    "top_p": either(VALID["top_p"], INVALID["top_p"]),
    "n": either(st.integers(1, 3), st.sampled_from([0, -1, 17, 129])), "stop": either(stop_strings), "stream": FLAG,
    "stream_options": either(st.fixed_dictionaries({}, optional={"include_usage": st.booleans(),
                                                                  "continuous_usage_stats": st.booleans()})),
    "seed": either(st.one_of(st.integers(), HUGE_INTS)), "logit_bias": either(VALID["logit_bias"]),
    "presence_penalty": either(VALID["presence_penalty"], INVALID["presence_penalty"]),
    "frequency_penalty": either(VALID["frequency_penalty"], INVALID["frequency_penalty"]),
    "best_of": either(st.just(1), st.integers(0, 3)),
    "response_format": either(st.just({"type": "text"}), st.fixed_dictionaries({"type": unicode_text})),
    "top_k": either(VALID["top_k"], INVALID["top_k"]), "min_p": either(VALID["min_p"], INVALID["min_p"]),
    "min_tokens": either(SMALL), "repetition_penalty": either(VALID["repetition_penalty"]),
    "ignore_eos": FLAG, "stop_token_ids": either(VALID["stop_token_ids"], INVALID["stop_token_ids"]),
    "no_stop_trim": FLAG, "skip_special_tokens": FLAG, "spaces_between_special_tokens": FLAG,
    "include_stop_str_in_output": FLAG, "regex": (st.none(), unicode_text),
    "custom_params": either(VALID["custom_params"]), "model": either(st.text(max_size=6)),
    "rid": either(st.text(min_size=1, max_size=6)),
    "user": (junk, junk), "use_beam_search": JUNK_ONLY, "guided_json": JUNK_ONLY,
}

COMPLETION_FIELDS = {**OPENAI_SAMPLING, "logprobs": either(st.integers(0, 5), st.sampled_from([-1, 21])),
                     "echo": FLAG, "suffix": JUNK_ONLY, "max_tokens": either(SMALL, st.just(-1))}


@st.composite
def completion_bodies(draw: st.DrawFn) -> dict[str, Any]:
    body = some_fields(COMPLETION_FIELDS, draw, max_fields=8)
    if draw(st.integers(0, 9)):
        body["prompt"] = draw(st.one_of(valid_prompt, valid_prompt, bad_prompt))
    return fast_body("/v1/completions", body)


# names the template call itself takes (a duplicate keyword of a call is a TypeError), and a reserved one
TEMPLATE_CALL_NAMES = ["messages", "self", "conversation", "add_generation_prompt", "tokenize"]
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")
text_part = st.fixed_dictionaries({"type": st.just("text"), "text": valid_text})
odd_part = st.one_of(st.fixed_dictionaries({"type": st.one_of(st.sampled_from(["image_url", "input_audio", ""]),
                                                              unicode_text)},
                                           optional={"text": st.one_of(valid_text, junk), "image_url": junk}),
                     junk)
valid_message = st.fixed_dictionaries(
    {"role": st.sampled_from(CHAT_ROLES), "content": st.one_of(valid_text, st.lists(text_part, min_size=1,
                                                                                    max_size=3))},
    optional={"name": st.text(min_size=1, max_size=5)})
odd_message = st.one_of(
    st.fixed_dictionaries({"role": st.one_of(st.sampled_from(CHAT_ROLES), unicode_text, junk)},
                          optional={"content": st.one_of(unicode_text, st.none(),
                                                         st.lists(st.one_of(text_part, odd_part), max_size=3), junk),
                                    "name": st.one_of(st.text(max_size=5), junk), "tool_calls": junk}),
    junk)
messages = st.one_of(st.lists(valid_message, min_size=1, max_size=4),
                     st.lists(st.one_of(valid_message, odd_message), max_size=4), junk)

CHAT_FIELDS = {**OPENAI_SAMPLING, "logprobs": FLAG, "top_logprobs": either(st.integers(0, 20), st.integers(-1, 22)),
               "tools": either(st.just(None), st.lists(st.fixed_dictionaries({"type": st.just("function")}),
                                                       max_size=1)),
               "tool_choice": (st.sampled_from(["none", "auto", None]), junk),
               "add_generation_prompt": FLAG, "continue_final_message": FLAG,
               "chat_template_kwargs": either(st.dictionaries(st.sampled_from(["enable_thinking", "x"]), json_values,
                                                              max_size=2),
                                              st.one_of(st.dictionaries(st.sampled_from(TEMPLATE_CALL_NAMES), junk,
                                                                        min_size=1, max_size=2),
                                                        st.dictionaries(unicode_text, junk, min_size=1, max_size=2))),
               "documents": either(st.lists(st.dictionaries(st.text(max_size=4), st.text(max_size=6), max_size=2),
                                            max_size=2)),
               "input_ids": either(st.lists(token_ids, min_size=1, max_size=6)),
               "echo": JUNK_ONLY, "functions": JUNK_ONLY, "max_tokens": either(SMALL),
               "max_completion_tokens": either(SMALL, st.just(0))}


@st.composite
def chat_bodies(draw: st.DrawFn) -> dict[str, Any]:
    body = some_fields(CHAT_FIELDS, draw, max_fields=8)
    if draw(st.integers(0, 9)):
        body["messages"] = draw(messages)
    return fast_body("/v1/chat/completions", body)


# --- control routes --------------------------------------------------------------------------------------
abort_bodies = st.one_of(
    st.fixed_dictionaries({}, optional={"rid": st.one_of(st.text(max_size=8), junk), "abort_all": st.one_of(
        st.booleans(), junk)}), junk)
query_value = st.one_of(st.text(max_size=10), st.binary(max_size=6), st.integers().map(str),
                        st.sampled_from(["core", "all", "core,memory", "core,,bogus", "json", "prometheus", "0",
                                         "-1", "1e3", "", "9" * 5000]))
loads_queries = st.dictionaries(st.sampled_from(["include", "dp_rank", "format", "other"]), query_value, max_size=3)
