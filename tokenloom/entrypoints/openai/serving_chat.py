"""POST /v1/chat/completions: messages → the model's chat template → `chat.completion` objects.

`max_completion_tokens` (or the deprecated `max_tokens`; neither = until the context limit) becomes
max_new_tokens; unset temperature/top_p/top_k/min_p/repetition_penalty take the model's generation config,
then OpenAI's defaults. Streams send, per choice, a role chunk, content deltas and a finish chunk. Text
content parts are joined; other part types are refused (no multimodal input). The prompt is the model's chat
template (with `tools`, `continue_final_message`, `add_generation_prompt`, `chat_template_kwargs` and
`documents` as SGLang and vLLM take them; assistant `tool_calls` and `role: tool` turns are fed back
through it), or SGLang's pre-rendered `input_ids`. `tool_choice` "required" or a named function is enforced
by a grammar in the parser's format (function_call/forced.py), so the answer is always valid calls.
With `--reasoning-parser` / `--tool-call-parser` the answer
is split into `reasoning_content`, `tool_calls` and content, whole or streamed (chat_output.py); an answer
with calls finishes with `finish_reason: "tool_calls"`.
"""

from __future__ import annotations

import json
from typing import Any

from tokenloom.entrypoints.openai.chat_output import ChatOutputRules, ChoiceStream, check_tools
from tokenloom.entrypoints.openai.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessageOut,
    ChatStreamChoice,
    ChatTokenLogprob,
    DeltaMessage,
    TopLogprob,
    UsageInfo,
)
from tokenloom.entrypoints.openai.serving_base import OpenAIServingBase, finish_reason_of
from tokenloom.frontend.tokenizer_manager import TokenizerManager
from tokenloom.function_call.forced import forced_call_tag
from tokenloom.function_call.registry import tool_format
from tokenloom.protocol import TokenizedRequest

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")  # OpenAI's
# Arguments of the tokenizer's template renderer that chat_template_kwargs must not override (they change
# what the renderer returns, or have their own request fields), and the parameter names of the calls that
# pass them on (`TokenizerManager.apply_chat_template`'s: a duplicate keyword argument is a TypeError).
RESERVED_TEMPLATE_ARGS = frozenset({
    "conversation", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
    "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "messages", "self"})


class ChatServing(OpenAIServingBase):
    request_model = ChatCompletionRequest
    id_prefix = "chatcmpl"

    def __init__(self, tokenizer_manager: TokenizerManager, model_name: str,
                 generation_defaults: dict[str, Any]) -> None:
        super().__init__(tokenizer_manager, model_name)
        self.generation_defaults = generation_defaults

    def tokenize(self, req: ChatCompletionRequest) -> list[TokenizedRequest]:
        messages = self._messages(req)
        max_new = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if max_new is not None and max_new <= 0:
            name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
            raise ValueError(f"{name} must be positive, got {max_new}")
        if req.top_logprobs is not None:
            top_max = self.tm.args.max_logprobs  # vLLM's bound (OpenAI's is 20, the flag's default)
            if not 0 <= req.top_logprobs <= top_max:
                raise ValueError(f"top_logprobs must be in [0, {top_max}] (--max-logprobs), got {req.top_logprobs}")
            if req.top_logprobs and not req.logprobs:  # 0 (vLLM's default) asks for nothing
                raise ValueError("top_logprobs requires logprobs to be true")
        choice = check_tools(req.tools, req.tool_choice)
        params = self.sampling_params(req, max_new, self.generation_defaults)
        if choice not in ("none", "auto"):
            params["structural_tag"] = self._forced_calls(req, choice, params)
        req._output_rules = ChatOutputRules(
            self.tm.args.tool_call_parser if choice != "none" else None,
            self.tm.args.reasoning_parser if req.separate_reasoning else None,
            req.tools if choice != "none" else None, 1 if not req.parallel_tool_calls else None)
        prompt, ids = self._prompt(req, messages, req.tools if choice != "none" else None)
        reqs, _ = self.tm.tokenize_batch(None, ids, params,
                                         req.rid, stream=req.stream, return_logprob=req.logprobs,
                                         top_logprobs_num=req.top_logprobs or 0,
                                         bootstrap=(req.bootstrap_host, req.bootstrap_port, req.bootstrap_room))
        for r in reqs:
            r.input_text = prompt
        return reqs

    def _forced_calls(self, req: ChatCompletionRequest, choice: str, params: dict[str, Any]) -> str:
        """The grammar (a structural tag) that makes the answer calls of the offered functions (`required`)
        or of the named one, in --tool-call-parser's format: enforced, not hoped for."""
        parser = self.tm.args.tool_call_parser
        if parser is None:
            raise ValueError(f"tool_choice {req.tool_choice!r} needs the server's --tool-call-parser (the format "
                             "the forced calls are written in)")
        taken = [k for k in ("json_schema", "regex", "ebnf", "structural_tag") if params.get(k) is not None]
        if taken:
            raise ValueError(f"tool_choice {req.tool_choice!r} constrains the answer to tool calls; it cannot be "
                             f"combined with {taken[0]} / response_format")
        tag = forced_call_tag(tool_format(parser, req.tools), req.tools or [], choice, req.parallel_tool_calls)
        return json.dumps(tag, ensure_ascii=False)

    def _prompt(self, req: ChatCompletionRequest, messages: list[dict[str, Any]],
                tools: list[dict[str, Any]] | None = None) -> tuple[str | None, list[int]]:
        """The prompt: SGLang's pre-rendered `input_ids` if given, else the chat template with the request's
        template controls (continue_final_message leaves the last message open instead of adding the
        generation prompt; chat_template_kwargs and documents are variables for the template)."""
        if req.input_ids is not None:
            return None, req.input_ids
        add_generation_prompt = req.add_generation_prompt
        if add_generation_prompt is None:
            add_generation_prompt = not req.continue_final_message
        if add_generation_prompt and req.continue_final_message:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        if req.continue_final_message and messages[-1]["role"] != "assistant":
            raise ValueError("continue_final_message needs the last message to be the assistant's")
        variables = dict(req.chat_template_kwargs or {})
        reserved = sorted(variables.keys() & RESERVED_TEMPLATE_ARGS)
        if reserved:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)}")
        if req.continue_final_message:
            variables["continue_final_message"] = True
        if req.documents is not None:
            variables["documents"] = req.documents
        if tools:
            variables["tools"] = tools
        return self.tm.apply_chat_template(messages, add_generation_prompt, **variables)

    @staticmethod
    def _messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
        if not req.messages:
            raise ValueError("Messages cannot be empty.")
        messages = []
        for i, message in enumerate(req.messages):
            content = message.content
            if message.role not in CHAT_ROLES:
                raise ValueError(f"messages[{i}]: unknown role {message.role!r}; expected one of "
                                 f"{', '.join(CHAT_ROLES)}")
            if content is None and message.role != "assistant":  # an assistant turn may be empty (tool calls)
                raise ValueError(f"messages[{i}]: a {message.role} message needs content")
            if isinstance(content, list):
                for part in content:
                    if part.type != "text" or part.text is None:
                        raise ValueError(f"messages[{i}]: content parts of type {part.type!r} are not supported "
                                         "(text only)")
                content = "\n".join(part.text or "" for part in content)
            entry: dict[str, Any] = {"role": message.role, "content": content or ""}
            if message.name:
                entry["name"] = message.name
            if message.tool_calls:
                if message.role != "assistant":
                    raise ValueError(f"messages[{i}]: only an assistant message carries tool_calls")
                entry["tool_calls"] = [_template_call(i, c) for c in message.tool_calls]
            if message.tool_call_id is not None:
                entry["tool_call_id"] = message.tool_call_id
            messages.append(entry)
        return messages

    def _logprobs(self, lps: list[list[Any]] | None, tops: list[list[list[Any]]] | None) -> ChatLogprobs | None:
        if lps is None:
            return None
        tokens = self.tm.token_texts([t[1] for t in lps])
        content = []
        for k, (entry, token) in enumerate(zip(lps, tokens, strict=True)):
            top = []
            if tops is not None:
                texts = self.tm.token_texts([t[1] for t in tops[k]])
                top = [TopLogprob(token=s, logprob=t[0], bytes=list(s.encode())) for t, s in zip(tops[k], texts,
                                                                                                   strict=True)]
            content.append(ChatTokenLogprob(token=token, logprob=entry[0], bytes=list(token.encode()),
                                            top_logprobs=top))
        return ChatLogprobs(content=content)

    def make_response(self, req: ChatCompletionRequest, outs: list[dict[str, Any]],
                      usage: UsageInfo) -> ChatCompletionResponse:
        choices = []
        for i, out in enumerate(outs):
            meta = out["meta_info"]
            reason, matched = finish_reason_of(meta["finish_reason"])
            content, reasoning, calls = req._output_rules.whole(out["text"])
            if calls and reason == "stop":
                reason = "tool_calls"
            message = ChatMessageOut(content=content, reasoning_content=reasoning, tool_calls=calls or None)
            choices.append(ChatChoice(index=i, message=message, finish_reason=reason, matched_stop=matched,
                                      logprobs=self._logprobs(meta.get("output_token_logprobs"),
                                                              meta.get("output_top_logprobs"))))
        return ChatCompletionResponse(model=self.response_model_name(req), choices=choices, usage=usage)

    def first_chunks(self, req: ChatCompletionRequest, rid: str, index: int,
                     out: dict[str, Any]) -> list[dict[str, Any]]:
        return [self._chunk(req, rid, ChatStreamChoice(index=index, delta=DeltaMessage(role="assistant",
                                                                                       content="")), None)]

    def delta_chunks(self, req: ChatCompletionRequest, rid: str, index: int, delta: str, offset: int,
                     logprobs: list[list[Any]] | None, top: list[list[list[Any]]] | None,
                     finish: dict[str, Any] | None, usage: UsageInfo | None) -> list[dict[str, Any]]:
        chunks = []
        stream = req._streams.get(index)
        if stream is None:
            stream = req._streams[index] = ChoiceStream(req._output_rules)
        pieces = stream.feed(delta, final=finish is not None)
        if logprobs and not pieces:
            pieces = [{"content": ""}]
        for k, piece in enumerate(pieces):
            choice = ChatStreamChoice(index=index, delta=DeltaMessage(**piece),
                                      logprobs=self._logprobs(logprobs, top) if k == 0 else None)
            chunks.append(self._chunk(req, rid, choice, usage if finish is None and k == len(pieces) - 1 else None))
        if finish is not None:
            reason, matched = finish_reason_of(finish)
            if stream.made_calls and reason == "stop":
                reason = "tool_calls"
            choice = ChatStreamChoice(index=index, delta=DeltaMessage(), finish_reason=reason, matched_stop=matched)
            chunks.append(self._chunk(req, rid, choice, usage))
        return chunks

    def usage_chunk(self, req: ChatCompletionRequest, rid: str, usage: UsageInfo) -> dict[str, Any]:
        return ChatCompletionChunk(id=rid, model=self.response_model_name(req), choices=[], usage=usage).model_dump()

    def _chunk(self, req: ChatCompletionRequest, rid: str, choice: ChatStreamChoice,
               usage: UsageInfo | None) -> dict[str, Any]:
        chunk = ChatCompletionChunk(id=rid, model=self.response_model_name(req), choices=[choice], usage=usage)
        data = chunk.model_dump()
        data["choices"][0]["delta"] = choice.delta.model_dump(exclude_none=True)
        return data


def _template_call(message_index: int, call: dict[str, Any]) -> dict[str, Any]:
    """An assistant turn's tool call as chat templates read it: `function.arguments` as a mapping (the HF
    convention templates are written for), parsed from OpenAI's JSON string."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ValueError(f"messages[{message_index}].tool_calls entries need function.name")
    arguments = fn.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            raise ValueError(f"messages[{message_index}]: tool call {fn['name']!r} has arguments that are not "
                             "JSON") from None
    return {"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": arguments}}
