"""Request bodies real SGLang and vLLM clients send, as test data: the shapes were read from their sources
(and, for sglang-router, captured from what its 0.3.2 wheel forwards to a worker) and written here by hand.

- `SGLANG_ROUTER_*`: what sglang-router forwards. It re-serialises /generate bodies through its own
  `GenerateRequest` struct (sgl-model-gateway/src/protocols/generate.rs), adding its defaults (`model: null`,
  `log_metrics`, `background`, `no_logs`, `return_bytes`, `return_entropy`, newer builds
  `return_routed_experts`) and dropping fields it does not know; OpenAI bodies gain SGLang's defaults
  (`no_stop_trim`, `separate_reasoning`, ...), and chat's `max_tokens` becomes `max_completion_tokens`.
- `SGLANG_BENCH_*`: python/sglang/bench_serving.py's request functions (sglang native, sglang-oai, chat).
- `VLLM_BENCH_*`: vllm/benchmarks/lib/endpoint_request_func.py (openai completions and chat).
- `*_DEFAULTS`: every top-level field of SGLang's and vLLM's request schemas at its default value, as a proxy
  that dumps a parsed request would send them (only the length is set, so the tests stay short).
- `*_FIELDS`: the top-level field names of those schemas, for checking that tokenloom classifies each.
- `UNSUPPORTED_CASES` / `IGNORED_CASES`: (route, extra fields, the field a 400 must name / None).
"""

from __future__ import annotations

from typing import Any

PROMPT = "The capital city of France is"
USER = [{"role": "user", "content": PROMPT}]
MAX_NEW = 4
GREEDY = {"temperature": 0.0, "max_new_tokens": MAX_NEW}

# --- sglang-router ---------------------------------------------------------------------------------------
_ROUTER_GENERATE_DEFAULTS = {"model": None, "return_text_in_logprobs": False, "stream": False, "log_metrics": True,
                             "return_hidden_states": False, "background": False, "no_logs": False,
                             "return_bytes": False, "return_entropy": False}
SGLANG_ROUTER_GENERATE: list[dict[str, Any]] = [
    {"text": PROMPT, **_ROUTER_GENERATE_DEFAULTS, "sampling_params": GREEDY},
    {**_ROUTER_GENERATE_DEFAULTS, "input_ids": [[1, 2, 3], [4, 5]], "sampling_params": {"max_new_tokens": MAX_NEW}},
    {**_ROUTER_GENERATE_DEFAULTS, "input_ids": [1, 2, 3], "stream": True, "sampling_params": GREEDY},
    {"text": PROMPT, **_ROUTER_GENERATE_DEFAULTS, "sampling_params": {**GREEDY, "stop": ["x"], "n": 2},
     "return_logprob": True, "logprob_start_len": -1, "top_logprobs_num": 2},
    # sgl-model-gateway main also sends return_routed_experts
    {"text": PROMPT, **_ROUTER_GENERATE_DEFAULTS, "return_routed_experts": False, "sampling_params": GREEDY},
]
SGLANG_ROUTER_COMPLETIONS: list[dict[str, Any]] = [
    {"model": "default", "prompt": PROMPT, "max_tokens": MAX_NEW, "stream": False, "echo": False,
     "no_stop_trim": False, "ignore_eos": False, "skip_special_tokens": True, "return_hidden_states": False},
    {"model": "default", "prompt": [PROMPT, "Hello"], "max_tokens": MAX_NEW, "stream": True,
     "stream_options": {"include_usage": True}, "logprobs": 2, "echo": False, "best_of": 1, "no_stop_trim": False,
     "ignore_eos": False, "skip_special_tokens": True, "return_hidden_states": False},
]
SGLANG_ROUTER_CHAT: list[dict[str, Any]] = [
    {"messages": USER, "model": "default", "logprobs": False, "max_completion_tokens": MAX_NEW, "stream": False,
     "no_stop_trim": False, "ignore_eos": False, "continue_final_message": False, "skip_special_tokens": True,
     "separate_reasoning": True, "stream_reasoning": True, "return_hidden_states": False},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": PROMPT}]}], "model": "default",
     "logprobs": True, "max_completion_tokens": MAX_NEW, "n": 1, "seed": 3, "stream": True, "top_logprobs": 2,
     "no_stop_trim": False, "ignore_eos": False, "continue_final_message": False, "skip_special_tokens": True,
     "separate_reasoning": True, "stream_reasoning": True, "chat_template_kwargs": {"enable_thinking": False},
     "return_hidden_states": False},
]

# --- SGLang bench_serving ---------------------------------------------------------------------------------
SGLANG_BENCH_GENERATE: list[dict[str, Any]] = [
    {"text": PROMPT, "sampling_params": {"temperature": 0.0, "max_new_tokens": MAX_NEW, "ignore_eos": True},
     "stream": stream, "lora_path": None, "return_logprob": False, "return_routed_experts": False,
     "logprob_start_len": -1}
    for stream in (True, False)
] + [  # --tokenize-prompt sends ids
    {"input_ids": [1, 2, 3, 4], "sampling_params": {"temperature": 0.0, "max_new_tokens": MAX_NEW,
                                                   "ignore_eos": True},
     "stream": True, "lora_path": None, "return_logprob": True, "return_routed_experts": False,
     "logprob_start_len": -1},
]
SGLANG_BENCH_COMPLETIONS: list[dict[str, Any]] = [
    {"model": "default", "prompt": PROMPT, "best_of": 1, "max_tokens": MAX_NEW, "stream": stream,
     "temperature": 0.0, "ignore_eos": True}
    for stream in (True, False)
]
SGLANG_BENCH_CHAT: list[dict[str, Any]] = [
    {"model": "default", "messages": USER, "max_completion_tokens": MAX_NEW, "stream": stream, "temperature": 0.0,
     "ignore_eos": True}
    for stream in (True, False)
]

# --- vLLM's benchmark client -------------------------------------------------------------------------------
_VLLM_STREAM = {"stream": True, "stream_options": {"include_usage": True}}
VLLM_BENCH_COMPLETIONS: list[dict[str, Any]] = [
    {"model": "default", "prompt": PROMPT, "repetition_penalty": 1.0, "max_tokens": MAX_NEW, "logprobs": None,
     **_VLLM_STREAM, "ignore_eos": True},
    {"model": "default", "prompt": [1, 2, 3, 4], "repetition_penalty": 1.0, "max_tokens": MAX_NEW, "logprobs": 1,
     **_VLLM_STREAM},
]
VLLM_BENCH_CHAT: list[dict[str, Any]] = [
    {"model": "default", "messages": [{"role": "user", "content": [{"type": "text", "text": PROMPT}]}],
     "max_completion_tokens": MAX_NEW, **_VLLM_STREAM, "ignore_eos": True},
]

# --- every field at its default -------------------------------------------------------------------------
# SGLang GenerateReqInput (python/sglang/srt/managers/io_struct.py), main branch, late 2026
SGLANG_GENERATE_DEFAULTS: dict[str, Any] = {
    "rid": None, "session_id": None, "text": PROMPT, "input_ids": None, "input_embeds": None, "image_data": None,
    "video_data": None, "audio_data": None, "mm_hashes": None, "mm_content_hashes": None, "use_audio_in_video": False,
    "video_config": None, "sampling_params": GREEDY, "return_logprob": None, "logprob_start_len": None,
    "top_logprobs_num": None, "token_ids_logprob": None, "return_sampling_mask": None,
    "return_text_in_logprobs": False, "return_flat_raw_top_logprobs": False,
    "return_flat_raw_top_logprobs_b64": False, "stream": False, "log_metrics": True, "return_hidden_states": False,
    "return_routed_experts": False, "routed_experts_start_len": 0, "return_indexer_topk": False, "modalities": None,
    "session_params": None, "lora_path": None, "lora_id": None, "custom_logit_processor": None,
    "positional_embed_overrides": None, "bootstrap_host": None, "bootstrap_port": None, "bootstrap_room": None,
    "bootstrap_pair_key": None, "decode_tp_size": None, "routed_dp_rank": None, "data_parallel_rank": None,
    "disagg_prefill_dp_rank": None, "kv_router_hint": None, "routing_key": None, "conversation_id": None,
    "http_worker_ipc": None, "background": False, "require_reasoning": False, "max_thinking_tokens": None,
    "priority": None, "extra_key": None, "no_logs": False, "custom_labels": None, "return_bytes": False,
    "return_entropy": False, "return_prompt_token_ids": False, "external_trace_header": None, "received_time": None,
    "need_wait_for_mm_inputs": None, "num_items_assigned": None, "encoder_urls": None, "max_dynamic_patch": None,
    "min_dynamic_patch": None, "image_max_dynamic_patch": None, "video_max_dynamic_patch": None,
    "images_config": None, "multi_item_delimiter_indices": None, "cache_salt": None,
}
SGLANG_GENERATE_FIELDS = frozenset(SGLANG_GENERATE_DEFAULTS)

# SGLang CompletionRequest (python/sglang/srt/entrypoints/openai/protocol.py)
SGLANG_COMPLETION_DEFAULTS: dict[str, Any] = {
    "model": "default", "prompt": PROMPT, "best_of": None, "echo": False, "frequency_penalty": 0.0,
    "logit_bias": None, "logprobs": None, "max_tokens": 16, "n": 1, "presence_penalty": 0.0, "seed": None,
    "stop": None, "stream": False, "stream_options": None, "suffix": None, "temperature": 1.0, "top_p": 1.0,
    "user": None, "return_hidden_states": False, "return_routed_experts": False, "routed_experts_start_len": 0,
    "return_cached_tokens_details": False, "return_token_ids": False, "top_k": -1, "min_p": 0.0, "min_tokens": 0,
    "json_schema": None, "regex": None, "ebnf": None, "repetition_penalty": 1.0, "stop_token_ids": None,
    "stop_regex": None, "no_stop_trim": False, "ignore_eos": False, "skip_special_tokens": True, "lora_path": None,
    "session_id": None, "session_params": None, "response_format": None, "custom_params": None,
    "custom_logit_processor": None, "images_config": None, "bootstrap_host": None, "bootstrap_port": None,
    "bootstrap_room": None, "routed_dp_rank": None, "disagg_prefill_dp_rank": None, "data_parallel_rank": None,
    "rid": None, "extra_key": None, "cache_salt": None, "ngram_corpus_id": None, "priority": None,
    "custom_labels": None,
}
# SGLang ChatCompletionRequest; tool_choice is what its validator sets when no tools are given
SGLANG_CHAT_DEFAULTS: dict[str, Any] = {
    "messages": USER, "model": "default", "frequency_penalty": 0.0, "logit_bias": None, "logprobs": False,
    "top_logprobs": None, "max_tokens": None, "max_completion_tokens": MAX_NEW, "n": 1, "presence_penalty": 0.0,
    "response_format": None, "seed": None, "stop": None, "stream": False, "stream_options": None,
    "temperature": None, "top_p": None, "user": None, "tools": None, "tool_choice": "none",
    "parallel_tool_calls": True, "return_hidden_states": False, "return_routed_experts": False,
    "routed_experts_start_len": 0, "return_cached_tokens_details": False, "return_prompt_token_ids": False,
    "return_token_ids": False, "return_meta_info": False, "reasoning_effort": None, "task": None, "top_k": None,
    "min_p": None, "min_tokens": 0, "regex": None, "ebnf": None, "repetition_penalty": None, "stop_token_ids": None,
    "stop_regex": None, "no_stop_trim": False, "ignore_eos": False, "continue_final_message": False,
    "skip_special_tokens": True, "lora_path": None, "session_id": None, "session_params": None,
    "separate_reasoning": True, "stream_reasoning": True, "chat_template_kwargs": None, "max_dynamic_patch": None,
    "min_dynamic_patch": None, "use_audio_in_video": False, "images_config": None, "custom_logit_processor": None,
    "custom_params": None, "input_ids": None, "rid": None, "extra_key": None, "cache_salt": None,
    "ngram_corpus_id": None, "priority": None, "bootstrap_host": None, "bootstrap_port": None,
    "bootstrap_room": None, "routed_dp_rank": None, "disagg_prefill_dp_rank": None, "data_parallel_rank": None,
}
# vLLM CompletionRequest (vllm/entrypoints/openai/protocol.py); request_id is a random uuid there
VLLM_COMPLETION_DEFAULTS: dict[str, Any] = {
    "model": None, "prompt": PROMPT, "prompt_embeds": None, "best_of": None, "echo": False,
    "frequency_penalty": 0.0, "logit_bias": None, "logprobs": None, "max_tokens": 16, "n": 1,
    "presence_penalty": 0.0, "seed": None, "stop": [], "stream": False, "stream_options": None, "suffix": None,
    "temperature": None, "top_p": None, "user": None, "use_beam_search": False, "top_k": None, "min_p": None,
    "repetition_penalty": None, "length_penalty": 1.0, "stop_token_ids": [], "include_stop_str_in_output": False,
    "ignore_eos": False, "min_tokens": 0, "skip_special_tokens": True, "spaces_between_special_tokens": True,
    "truncate_prompt_tokens": None, "allowed_token_ids": None, "prompt_logprobs": None, "add_special_tokens": True,
    "response_format": None, "guided_json": None, "guided_regex": None, "guided_choice": None,
    "guided_grammar": None, "guided_decoding_backend": None, "guided_whitespace_pattern": None, "priority": 0,
    "request_id": "8c1d3f0e", "logits_processors": None, "return_tokens_as_token_ids": None, "cache_salt": None,
    "kv_transfer_params": None, "vllm_xargs": None,
}
# vLLM ChatCompletionRequest
VLLM_CHAT_DEFAULTS: dict[str, Any] = {
    "messages": USER, "model": None, "frequency_penalty": 0.0, "logit_bias": None, "logprobs": False,
    "top_logprobs": 0, "max_tokens": None, "max_completion_tokens": MAX_NEW, "n": 1, "presence_penalty": 0.0,
    "response_format": None, "seed": None, "stop": [], "stream": False, "stream_options": None,
    "temperature": None, "top_p": None, "tools": None, "tool_choice": "none", "reasoning_effort": None,
    "include_reasoning": True, "parallel_tool_calls": False, "user": None, "best_of": None,
    "use_beam_search": False, "top_k": None, "min_p": None, "repetition_penalty": None, "length_penalty": 1.0,
    "stop_token_ids": [], "include_stop_str_in_output": False, "ignore_eos": False, "min_tokens": 0,
    "skip_special_tokens": True, "spaces_between_special_tokens": True, "truncate_prompt_tokens": None,
    "prompt_logprobs": None, "allowed_token_ids": None, "bad_words": [], "echo": False,
    "add_generation_prompt": True, "continue_final_message": False, "add_special_tokens": False,
    "documents": None, "chat_template": None, "chat_template_kwargs": None, "mm_processor_kwargs": None,
    "guided_json": None, "guided_regex": None, "guided_choice": None, "guided_grammar": None,
    "structural_tag": None, "guided_decoding_backend": None, "guided_whitespace_pattern": None, "priority": 0,
    "request_id": "8c1d3f0e", "logits_processors": None, "return_tokens_as_token_ids": None, "cache_salt": None,
    "kv_transfer_params": None, "vllm_xargs": None,
}
# OpenAI's own optional chat fields that SGLang and vLLM do not declare, as the openai client would send them
OPENAI_CHAT_EXTRAS: dict[str, Any] = {
    "store": False, "metadata": {"team": "x"}, "service_tier": "auto", "modalities": ["text"], "audio": None,
    "prediction": {"type": "content", "content": "Paris"}, "verbosity": "low", "prompt_cache_key": "k",
    "safety_identifier": "u1", "web_search_options": None, "function_call": "none",
}

COMPLETION_FIELDS = frozenset(SGLANG_COMPLETION_DEFAULTS) | frozenset(VLLM_COMPLETION_DEFAULTS)
CHAT_FIELDS = frozenset(SGLANG_CHAT_DEFAULTS) | frozenset(VLLM_CHAT_DEFAULTS) | frozenset(OPENAI_CHAT_EXTRAS)

# (route, body, status-200 payloads) every one must be answered 200
ACCEPTED: list[tuple[str, dict[str, Any]]] = (
    [("/generate", b) for b in SGLANG_ROUTER_GENERATE + SGLANG_BENCH_GENERATE + [SGLANG_GENERATE_DEFAULTS]]
    + [("/v1/completions", b) for b in SGLANG_ROUTER_COMPLETIONS + SGLANG_BENCH_COMPLETIONS + VLLM_BENCH_COMPLETIONS
       + [SGLANG_COMPLETION_DEFAULTS, VLLM_COMPLETION_DEFAULTS]]
    + [("/v1/chat/completions", b) for b in SGLANG_ROUTER_CHAT + SGLANG_BENCH_CHAT + VLLM_BENCH_CHAT
       + [SGLANG_CHAT_DEFAULTS, VLLM_CHAT_DEFAULTS, {**VLLM_CHAT_DEFAULTS, **OPENAI_CHAT_EXTRAS}]]
)

_GEN = {"text": PROMPT, "sampling_params": GREEDY}
_CMPL = {"prompt": PROMPT, "max_tokens": MAX_NEW}
_CHAT = {"messages": USER, "max_tokens": MAX_NEW}
# (route, body, the field the 400 must name)
UNSUPPORTED_CASES: list[tuple[str, dict[str, Any], str]] = [
    ("/generate", {**_GEN, "lora_path": "adapter-1"}, "lora_path"),
    ("/generate", {**_GEN, "lora_path": ["adapter-1"]}, "lora_path"),
    ("/generate", {**_GEN, "lora_id": "a"}, "lora_id"),
    ("/generate", {**_GEN, "image_data": "cat.png"}, "image_data"),
    ("/generate", {**_GEN, "audio_data": ["a.wav"]}, "audio_data"),
    ("/generate", {**_GEN, "modalities": ["image"]}, "modalities"),
    ("/generate", {"input_embeds": [[0.1, 0.2]], "sampling_params": GREEDY}, "input_embeds"),
    ("/generate", {**_GEN, "return_hidden_states": True}, "return_hidden_states"),
    ("/generate", {**_GEN, "return_routed_experts": True}, "return_routed_experts"),
    ("/generate", {**_GEN, "return_entropy": True}, "return_entropy"),
    ("/generate", {**_GEN, "session_params": {"id": "s1"}}, "session_params"),
    ("/generate", {**_GEN, "custom_logit_processor": "{}"}, "custom_logit_processor"),
    ("/generate", {**_GEN, "cache_salt": "tenant-a"}, "cache_salt"),
    ("/generate", {**_GEN, "extra_key": "k"}, "extra_key"),
    ("/generate", {**_GEN, "data_parallel_rank": 1}, "data_parallel_rank"),
    ("/generate", {**_GEN, "routed_dp_rank": 2}, "routed_dp_rank"),
    ("/generate", {**_GEN, "require_reasoning": True}, "require_reasoning"),
    ("/v1/completions", {**_CMPL, "suffix": " world"}, "suffix"),
    ("/v1/completions", {**_CMPL, "use_beam_search": True}, "use_beam_search"),
    ("/v1/completions", {**_CMPL, "lora_path": "adapter-1"}, "lora_path"),
    ("/v1/completions", {**_CMPL, "logits_processors": ["m.P"]}, "logits_processors"),
    ("/v1/completions", {**_CMPL, "prompt_logprobs": 1}, "prompt_logprobs"),
    ("/v1/completions", {**_CMPL, "structured_outputs": {"json": {"type": "object"}}}, "structured_outputs"),
    ("/v1/completions", {**_CMPL, "truncate_prompt_tokens": 3}, "truncate_prompt_tokens"),
    ("/v1/completions", {**_CMPL, "add_special_tokens": False}, "add_special_tokens"),
    ("/v1/completions", {**_CMPL, "length_penalty": 0.5}, "length_penalty"),
    ("/v1/completions", {**_CMPL, "return_hidden_states": True}, "return_hidden_states"),
    ("/v1/completions", {**_CMPL, "best_of": 3}, "best_of"),
    ("/v1/completions", {**_CMPL, "response_format": {"type": "yaml"}}, "response_format"),
    ("/v1/chat/completions", {**_CHAT, "modalities": ["text", "audio"]}, "modalities"),
    ("/v1/chat/completions", {**_CHAT, "chat_template": "{{ messages }}"}, "chat_template"),
    ("/v1/chat/completions", {**_CHAT, "echo": True}, "echo"),
    ("/v1/chat/completions", {**_CHAT, "functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {**_CHAT, "bad_words": ["Paris"]}, "bad_words"),
    ("/v1/chat/completions", {**_CHAT, "add_special_tokens": True}, "add_special_tokens"),
    ("/v1/chat/completions", {**_CHAT, "return_meta_info": True}, "return_meta_info"),
    ("/v1/chat/completions", {**_CHAT, "cache_salt": "tenant-a"}, "cache_salt"),
    ("/v1/chat/completions", {**_CHAT, "chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
]
# (route, body): hints set to non-default values, and unknown fields; all answered 200
IGNORED_CASES: list[tuple[str, dict[str, Any]]] = [
    ("/generate", {**_GEN, "priority": 5, "routing_key": "k", "no_logs": True, "background": True,
                   "return_bytes": True, "log_metrics": False, "bootstrap_room": 12345, "custom_labels": {"a": "b"},
                   "model": "whatever", "session_id": "s1", "conversation_id": "c1", "data_parallel_rank": 0}),
    ("/generate", {**_GEN, "sampling_param": {"max_new_tokens": 99}, "totally_unknown": [1, 2]}),
    ("/v1/completions", {**_CMPL, "priority": 3, "request_id": "r-1", "service_tier": "flex", "store": True,
                         "metadata": {"a": "b"}, "routing_id": "x", "kv_transfer_params": {"a": 1},
                         "totally_unknown": True}),
    ("/v1/chat/completions", {**_CHAT, "reasoning_effort": "low", "parallel_tool_calls": False,
                              "separate_reasoning": False, "include_reasoning": False, "task": "title",
                              "totally_unknown": {"x": 1}}),
]
