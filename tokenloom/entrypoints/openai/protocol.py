"""Pydantic schemas of the OpenAI-compatible API: request bodies (with SGLang's extra sampling fields)
and response objects for /v1/completions, /v1/chat/completions and /v1/models.

Requests follow `request_fields`: the fields used are declared and type-checked here (and range-checked by
the serving classes and `SamplingParams`); the other fields SGLang's and vLLM's request schemas declare are
classified as ignored hints or as unsupported features (a non-default value is a 400 naming the field);
unknown fields are ignored (OpenAI clients send optional fields freely).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field, PrivateAttr

from tokenloom.entrypoints.request_fields import (
    COMMON_UNSUPPORTED,
    NO_EMBEDS,
    NO_LOGIT_PROCESSORS,
    NO_MULTIMODAL,
    LenientRequest,
)


def _now() -> int:
    return int(time.time())


class StreamOptions(BaseModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class SamplingExtras(LenientRequest):
    """Fields shared by both request kinds: OpenAI's sampling knobs plus SGLang's and vLLM's extras."""

    model: str | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    sampling_seed: int | None = None  # SGLang's name for seed (its router forwards it)
    logit_bias: dict[str, float] | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    best_of: int | None = None  # only best_of == n (no server-side ranking of extra candidates)
    response_format: dict[str, Any] | None = None  # text, json_object, json_schema, structural_tag
    # SGLang extras
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int = 0
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None
    stop_regex: str | list[str] | None = None
    structural_tag: str | None = None
    # vLLM's guided decoding fields (aliases of the above; serving_base.grammar_params)
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    custom_params: dict[str, Any] | None = None
    rid: str | list[str] | None = None
    # prefill/decode disaggregation (SGLang's router adds them; a unified server ignores them)
    bootstrap_host: Any = None
    bootstrap_port: Any = None
    bootstrap_room: Any = None
    # vLLM extras
    include_stop_str_in_output: bool = False  # = no_stop_trim

    # Hints with no effect on one tokenloom server (routing, priorities, tracing, PD, speculative corpora,
    # reasoning controls of reasoning models, guided-decoding options without a guide).
    IGNORED: ClassVar[frozenset[str]] = frozenset({
        "user", "priority", "service_tier", "store", "metadata", "session_id", "request_id", "routing_id",
        "disagg_prefill_dp_rank", "kv_transfer_params",
        "ngram_corpus_id", "custom_labels", "routed_experts_start_len", "guided_decoding_backend",
        "guided_whitespace_pattern", "prompt_cache_key", "safety_identifier"})
    UNSUPPORTED: ClassVar[dict[str, tuple[Any, str]]] = {
        **COMMON_UNSUPPORTED,
        "logits_processors": (None, NO_LOGIT_PROCESSORS),
        "return_cached_tokens_details": (False, "cached-token details are not reported (usage only)"),
        "return_token_ids": (False, "token ids are not returned on the OpenAI routes (use /generate)"),
        "images_config": (None, NO_MULTIMODAL),
        "mm_processor_kwargs": (None, NO_MULTIMODAL),
        "use_beam_search": (False, "it has no beam search"),
        "length_penalty": (1.0, "it has no beam search"),
        "allowed_token_ids": (None, "sampling cannot be restricted to a token list (use logit_bias)"),
        "bad_words": (None, "it has no bad-word filtering"),
        "prompt_logprobs": (None, "prompt logprobs are not returned on the OpenAI routes (use /generate)"),
        "return_tokens_as_token_ids": (False, "logprob tokens are always token strings"),
        "truncate_prompt_tokens": (None, "prompts are not truncated (a prompt over the context is a 400)"),
        "structured_outputs": (None, "use response_format or guided_json / guided_regex / guided_choice / "
                                        "guided_grammar"),
        "vllm_xargs": (None, "it has no request extensions"),
    }


class CompletionRequest(SamplingExtras):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    temperature: float | None = None
    top_p: float | None = None
    logprobs: int | None = None
    echo: bool = False

    UNSUPPORTED: ClassVar[dict[str, tuple[Any, str]]] = {
        **SamplingExtras.UNSUPPORTED,
        "suffix": (None, "it has no insertion (fill-in-the-middle) mode"),
        "prompt_embeds": (None, NO_EMBEDS),
        "add_special_tokens": (True, "prompts are always tokenized with the tokenizer's special tokens"),
    }


class ContentPart(BaseModel):
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn's calls, fed back through the template
    tool_call_id: str | None = None  # a tool turn: the call it answers
    reasoning_content: str | None = None  # an earlier answer's reasoning (templates may drop it)


class ChatCompletionRequest(SamplingExtras):
    messages: list[ChatMessage]
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True  # false: at most one call per answer
    separate_reasoning: bool = True  # SGLang: false leaves <think> in the content even with --reasoning-parser
    # Set by the chat serving: how this request's answers are read, and each streamed choice's parser state.
    _output_rules: Any = PrivateAttr(default=None)
    _streams: dict[int, Any] = PrivateAttr(default_factory=dict)
    # chat-template controls (SGLang and vLLM)
    add_generation_prompt: bool | None = None  # default: true unless continue_final_message
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None
    input_ids: list[int] | None = None  # SGLang: the prompt already rendered, used instead of the template

    IGNORED: ClassVar[frozenset[str]] = SamplingExtras.IGNORED | {
        "function_call", "reasoning_effort", "include_reasoning", "stream_reasoning", "verbosity", "prediction",
        "task"}
    UNSUPPORTED: ClassVar[dict[str, tuple[Any, str]]] = {
        **SamplingExtras.UNSUPPORTED,
        "functions": (None, "it has no function calling"),
        "modalities": (["text"], "it answers with text only"),
        "audio": (None, "it answers with text only"),
        "web_search_options": (None, "it has no web search"),
        "chat_template": (None, "the served model's chat template is always used"),
        "echo": (False, "chat echo is not supported"),
        "add_special_tokens": (False, "the chat template's text is tokenized without extra special tokens"),
        "return_prompt_token_ids": (False, "token ids are not returned on the OpenAI routes (use /generate)"),
        "return_meta_info": (False, "SGLang's meta_info is returned only by /generate"),
        "max_dynamic_patch": (None, NO_MULTIMODAL),
        "min_dynamic_patch": (None, NO_MULTIMODAL),
        "use_audio_in_video": (False, NO_MULTIMODAL),
    }


# --- responses ---------------------------------------------------------------------------------------
class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)  # echo: the first prompt token's is null
    top_logprobs: list[dict[str, float] | None] | None = None
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None = None


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] = Field(default_factory=list)


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "tokenloom"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
