"""Every kind of bad input gets a 4xx whose message names the problem, in the route's error shape, and the
server keeps serving (a good request succeeds right after each one)."""

from __future__ import annotations

import pytest

from tests.e2e.server_process import http

LONG_TEXT = "word " * 9000  # > the 8192-token context the tiny server runs with
OK_PARAMS = {"max_new_tokens": 2, "temperature": 0}


def sp(**params):
    return {"text": "Hello", "sampling_params": params}


# (case id, body, expected message fragment); every one is a 400 from /generate
GENERATE_CASES = [
    ("missing_prompt", {"sampling_params": OK_PARAMS}, "Either text, input_ids or input_embeds"),
    ("empty_text", {"text": ""}, "text cannot be empty"),
    ("empty_input_ids", {"input_ids": []}, "input_ids cannot be empty"),
    ("empty_batch", {"text": []}, "prompt list is empty"),
    ("text_not_string", {"text": 5}, "text must be a string"),
    ("ids_not_ints", {"input_ids": [1, "two"]}, "input_ids must be a list of integers"),
    ("id_over_vocab", {"input_ids": [1, 49152]}, "token id 49152 outside the vocabulary"),
    ("negative_id", {"input_ids": [-1, 5]}, "token id -1 outside the vocabulary"),
    ("prompt_over_context", {"text": LONG_TEXT}, "longer than the model's context length (8192 tokens)"),
    ("prompt_plus_new_over_context", sp(max_new_tokens=8191), "exceeds the model's maximum context length"),
    ("temperature_negative", sp(temperature=-0.1), "temperature must be non-negative"),
    ("temperature_not_number", sp(temperature="hot"), "temperature must be a finite number"),
    ("top_p_zero", sp(top_p=0), "top_p must be in (0, 1]"),
    ("top_p_above_one", sp(top_p=1.5), "top_p must be in (0, 1]"),
    ("min_p_negative", sp(min_p=-0.1), "min_p must be in [0, 1]"),
    ("min_p_above_one", sp(min_p=1.1), "min_p must be in [0, 1]"),
    ("top_k_zero", sp(top_k=0), "top_k must be -1"),
    ("top_k_below_minus_one", sp(top_k=-2), "top_k must be -1"),
    ("frequency_penalty", sp(frequency_penalty=2.5), "frequency_penalty must be in [-2, 2]"),
    ("presence_penalty", sp(presence_penalty=-2.5), "presence_penalty must be in [-2, 2]"),
    ("repetition_penalty_zero", sp(repetition_penalty=0), "repetition_penalty must be in (0, 2]"),
    ("repetition_penalty_high", sp(repetition_penalty=2.5), "repetition_penalty must be in (0, 2]"),
    ("max_new_tokens_negative", sp(max_new_tokens=-1), "max_new_tokens must be at least 0"),
    ("min_new_tokens_negative", sp(min_new_tokens=-1), "min_new_tokens must be in [0, max_new_tokens]"),
    ("min_over_max_new_tokens", sp(min_new_tokens=5, max_new_tokens=2), "min_new_tokens must be in"),
    ("n_zero", sp(n=0), "n must be a positive integer"),
    ("stream_interval_zero", sp(stream_interval=0), "stream_interval must be a positive integer"),
    ("logit_bias_outside_vocab", sp(logit_bias={"999999": 1.0}), "logit_bias token id 999999 is outside"),
    ("stop_token_ids_outside_vocab", sp(stop_token_ids=[10**6]), "stop_token_ids must be token ids"),
    ("stop_not_strings", sp(stop=[1, 2]), "stop must be a string or a list of strings"),
    ("sampling_seed_not_int", sp(sampling_seed="x"), "sampling_seed must be an integer"),
    ("constrained_decoding_bad_regex", sp(regex="a("), "invalid regex"),
    ("unknown_sampling_key", sp(tempreature=0.5), "unknown sampling parameter(s): tempreature"),
    ("sampling_params_not_object", {"text": "Hi", "sampling_params": "greedy"}, "sampling_params must be an object"),
    ("n_mismatch_in_batch", {"text": ["a", "b"], "sampling_params": [{"n": 1}, {"n": 2}]},
     "All requests in a batch must use the same n"),
    ("params_count_mismatch", {"text": ["a", "b"], "sampling_params": [{}]}, "Got 1 sampling_params for 2 prompts"),
    ("duplicate_rids", {"text": ["a", "b"], "rid": ["x", "x"]}, "Duplicate request id"),
    ("rid_count_mismatch", {"text": ["a", "b"], "rid": ["x"]}, "one id per prompt"),
    ("top_logprobs_negative", {"text": "Hi", "return_logprob": True, "top_logprobs_num": -1}, "top_logprobs_num"),
    ("logprob_start_len_negative", {"text": "Hi", "return_logprob": True, "logprob_start_len": -2},
     "logprob_start_len must be -1 (output logprobs only) or a prompt position >= 0, got -2"),
    ("logprob_start_len_past_prompt", {"text": "Hello", "return_logprob": True, "logprob_start_len": 50},
     "logprob_start_len (50) must be smaller than the number of input tokens (1)"),
    ("token_ids_logprob_outside_vocab", {"text": "Hi", "return_logprob": True, "token_ids_logprob": [5, 49152]},
     "token_ids_logprob contains token id 49152 outside the vocabulary"),
    ("token_ids_logprob_not_ids", {"text": "Hi", "return_logprob": True, "token_ids_logprob": ["a"]},
     "token_ids_logprob must be a list of token ids"),
    ("token_ids_logprob_count_mismatch", {"text": ["a", "b"], "return_logprob": True, "token_ids_logprob": [[1]]},
     "token_ids_logprob has 1 lists for 2 prompts"),
    ("unsupported_feature", {"text": "Hi", "image_data": "x.png"}, "image_data is not supported"),
    ("n_over_cap", sp(n=10000), "n must be at most 128, got 10000"),
    ("top_logprobs_over_cap", {"text": "Hi", "return_logprob": True, "top_logprobs_num": 21},
     "top_logprobs_num must be an integer in [0, 20] (--max-logprobs), got 21"),
    ("token_ids_logprob_over_cap", {"text": "Hi", "return_logprob": True, "token_ids_logprob": list(range(257))},
     "token_ids_logprob may list at most 256 token ids, got 257"),
    ("input_ids_over_context", {"input_ids": [1] * 9000}, "longer than the model's context length (8192 tokens)"),
    # refused on its length alone: more characters than 8192 tokens of the longest vocabulary entry could hold
    ("text_far_over_context", {"text": "x" * 5_000_000}, "(5000000 characters) is longer than the model's context"),
    # found by tests/reliability/test_fuzz.py: each was a 5xx, or killed a runtime process
    ("flag_not_bool", sp(skip_special_tokens=[1]), "skip_special_tokens must be a boolean, got [1]"),  # detokenizer
    ("custom_params_not_object", sp(custom_params=[1]), "custom_params must be an object, got list"),
    ("temperature_int_beyond_float", sp(temperature=10**400), "temperature must be a finite number"),  # OverflowError
]

# (case id, route, raw body, content type, expected message fragment); body-level errors, SGLang's shape
BODY_CASES = [
    ("generate_malformed_json", "/generate", b'{"text": "hi",', "application/json", "Malformed JSON body"),
    ("generate_empty_body", "/generate", b"", "application/json", "request body is empty"),
    ("generate_not_object", "/generate", b"[1, 2]", "application/json", "must be a JSON object"),
    # an unknown top-level field is ignored, as SGLang does (tests/e2e/test_client_payloads.py)
    ("generate_bad_flag_type", "/generate", b'{"text": "hi", "return_prompt_token_ids": "maybe"}',
     "application/json", "return_prompt_token_ids: Input should be a valid boolean"),
    ("generate_bad_field_type", "/generate", b'{"text": "hi", "stream": "maybe"}', "application/json",
     "stream: Input should be a valid boolean"),
    ("completions_wrong_content_type", "/v1/completions", b'{"prompt": "hi"}', "text/plain",
     "Unsupported Media Type: Only 'application/json' is allowed"),
    ("chat_form_content_type", "/v1/chat/completions", b'{"messages": []}', "application/x-www-form-urlencoded",
     "Unsupported Media Type"),
    ("chat_malformed_json", "/v1/chat/completions", b'{"messages": [', "application/json", "Malformed JSON body"),
    ("completions_missing_prompt", "/v1/completions", b'{"model": "m"}', "application/json",
     "prompt: Field required"),
    ("chat_missing_messages", "/v1/chat/completions", b'{"model": "m"}', "application/json",
     "messages: Field required"),
    ("chat_bad_type", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "n": "two"}',
     "application/json", "n: Input should be a valid integer"),
    # deeper than the JSON parser's recursion limit (it used to be a plain-text 500), and deeper than the cap
    ("generate_nested_10000_deep", "/generate", b'{"text": ' + b"[" * 10000 + b"]" * 10000 + b"}",
     "application/json", "nested more than 64 levels deep"),
    ("chat_nested_100_deep", "/v1/chat/completions", b'{"messages": ' + b"[" * 100 + b"]" * 100 + b"}",
     "application/json", "nested more than 64 levels deep"),
    # found by tests/reliability/test_fuzz.py (each a 500): lone surrogates reached the tokenizer or the UTF-8
    # encoder of the answer; an integer of more digits than Python converts raised a ValueError
    ("generate_lone_surrogate_text", "/generate", b'{"text": "\\ud800"}', "application/json",
     "text: a lone UTF-16 surrogate (\\ud800) is not valid Unicode text."),
    ("generate_lone_surrogate_key", "/generate", b'{"text": "Hi", "sampling_params": {"\\udfff": 1}}',
     "application/json", "a key in sampling_params: a lone UTF-16 surrogate (\\udfff)"),
    ("completions_encoded_surrogate_model", "/v1/completions", b'{"prompt": "Hi", "model": "\xed\xa0\x80"}',
     "application/json", "model: a lone UTF-16 surrogate (\\ud800)"),
    ("generate_number_of_5000_digits", "/generate", b'{"text": "Hi", "rid": ' + b"7" * 5000 + b"}",
     "application/json", "Malformed JSON body: Exceeds the limit (4300 digits)"),
]

USER = [{"role": "user", "content": "Hi"}]
# (case id, route, body, expected message fragment); 400 in the OpenAI error shape
OPENAI_CASES = [
    ("empty_prompt", "/v1/completions", {"prompt": ""}, "Prompt cannot be empty"),
    ("empty_prompt_list", "/v1/completions", {"prompt": []}, "Prompt cannot be empty"),
    ("max_tokens_zero", "/v1/completions", {"prompt": "Hi", "max_tokens": 0}, "max_tokens must be positive"),
    ("prompt_over_context", "/v1/completions", {"prompt": LONG_TEXT}, "longer than the model's context length"),
    ("max_tokens_over_context", "/v1/completions", {"prompt": "Hi", "max_tokens": 9000},
     "exceeds the model's maximum context length"),
    ("token_prompt_outside_vocab", "/v1/completions", {"prompt": [1, 10**7]}, "outside the vocabulary"),
    ("completion_temperature", "/v1/completions", {"prompt": "Hi", "temperature": -1},
     "temperature must be non-negative"),
    ("completion_top_p", "/v1/completions", {"prompt": "Hi", "top_p": 1.5}, "top_p must be in (0, 1]"),
    ("completion_n_zero", "/v1/completions", {"prompt": "Hi", "n": 0}, "n must be a positive integer"),
    ("max_tokens_negative_with_echo", "/v1/completions", {"prompt": "Hi", "max_tokens": -1, "echo": True},
     "max_tokens must be positive (0 only with echo), got -1"),
    ("empty_messages", "/v1/chat/completions", {"messages": []}, "Messages cannot be empty."),
    ("chat_max_completion_tokens_zero", "/v1/chat/completions", {"messages": USER, "max_completion_tokens": 0},
     "max_completion_tokens must be positive"),
    ("chat_presence_penalty", "/v1/chat/completions", {"messages": USER, "presence_penalty": 5},
     "presence_penalty must be in [-2, 2]"),
    ("chat_top_logprobs_without_logprobs", "/v1/chat/completions", {"messages": USER, "top_logprobs": 2},
     "top_logprobs requires logprobs"),
    ("chat_top_logprobs_too_many", "/v1/chat/completions", {"messages": USER, "logprobs": True, "top_logprobs": 50},
     "top_logprobs must be in [0, 20]"),
    ("chat_image_part", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "content parts of type 'image_url' are not supported"),
    ("chat_tool_without_name", "/v1/chat/completions", {"messages": USER, "tools": [{"type": "function"}]},
     "tools[0] must be"),
    ("chat_tool_choice_unknown_function", "/v1/chat/completions",
     {"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "tool_choice names function 'g', which is not in `tools` (f)"),
    ("chat_tool_call_arguments_not_json", "/v1/chat/completions",
     {"messages": [{"role": "assistant", "content": None, "tool_calls": [
         {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{bad"}}]}]},
     "messages[0]: tool call 'f' has arguments that are not JSON"),
    ("chat_unknown_response_format", "/v1/chat/completions", {"messages": USER, "response_format": {"type": "yaml"}},
     "response_format type must be one of text, json_object, json_schema, structural_tag"),
    ("chat_unknown_sampling_extra", "/v1/chat/completions", {"messages": USER, "logit_bias": {"-5": 1}},
     "logit_bias token id -5 is outside"),
    ("chat_unknown_role", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "Hi"}]},
     "messages[0]: unknown role 'wizard'"),
    ("chat_user_without_content", "/v1/chat/completions", {"messages": [{"role": "user"}]},
     "messages[0]: a user message needs content"),
    ("chat_user_null_content", "/v1/chat/completions",
     {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": None}]},
     "messages[1]: a user message needs content"),
    ("chat_n_over_cap", "/v1/chat/completions", {"messages": USER, "n": 129}, "n must be at most 128, got 129"),
    ("completion_logprobs_over_cap", "/v1/completions", {"prompt": "Hi", "logprobs": 21},
     "logprobs must be an integer in [0, 20] (--max-logprobs), got 21"),
    # found by tests/reliability/test_fuzz.py: a TypeError (500) for a duplicate keyword of the template call
    ("chat_template_kwargs_messages", "/v1/chat/completions",
     {"messages": USER, "chat_template_kwargs": {"messages": 1}}, "chat_template_kwargs may not set messages"),
]


@pytest.fixture(scope="module")
def url(tiny_server):
    return tiny_server.url


@pytest.fixture
def still_serving(url):
    yield
    status, out = http("POST", url + "/generate", {"text": "Still there?", "sampling_params": OK_PARAMS})
    assert status == 200 and out["meta_info"]["completion_tokens"] == 2, out


@pytest.mark.parametrize("body, fragment", [c[1:] for c in GENERATE_CASES], ids=[c[0] for c in GENERATE_CASES])
def test_generate_rejects(url, still_serving, body, fragment):
    status, out = http("POST", url + "/generate", body)
    assert status == 400, out
    assert set(out) == {"error"} and fragment in out["error"]["message"], out


@pytest.mark.parametrize("route, raw, content_type, fragment", [c[1:] for c in BODY_CASES],
                         ids=[c[0] for c in BODY_CASES])
def test_bad_bodies_rejected(url, still_serving, route, raw, content_type, fragment):
    status, out = http("POST", url + route, raw=raw, headers={"Content-Type": content_type})
    assert status == 400, out
    assert out["object"] == "error" and out["code"] == 400 and out["type"] == "Bad Request", out
    assert fragment in out["message"], out


@pytest.mark.parametrize("route, body, fragment", [c[1:] for c in OPENAI_CASES], ids=[c[0] for c in OPENAI_CASES])
def test_openai_rejects(url, still_serving, route, body, fragment):
    status, out = http("POST", url + route, body)
    assert status == 400, out
    assert out["object"] == "error" and out["type"] == "BadRequestError" and out["code"] == 400, out
    assert fragment in out["message"], out


def test_stream_request_with_bad_input_is_a_plain_400(url, still_serving):
    status, out = http("POST", url + "/generate", {"text": "Hi", "stream": True, "sampling_params": {"top_k": 0}})
    assert status == 400 and "top_k" in out["error"]["message"]
    status, out = http("POST", url + "/v1/chat/completions", {"messages": [], "stream": True})
    assert status == 400 and "Messages cannot be empty" in out["message"]


def test_unknown_route_and_method(url, still_serving):
    assert http("GET", url + "/no_such_route")[0] == 404
    assert http("GET", url + "/generate")[0] == 405
