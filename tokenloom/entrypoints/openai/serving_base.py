"""What /v1/completions and /v1/chat/completions share: body parsing, OpenAI request → sampling params,
running the requests (non-streaming with disconnect detection, or streaming with per-choice deltas),
usage, finish reasons, and errors in the OpenAI shape.

A subclass says how a request becomes `TokenizedRequest`s (`tokenize`) and how outputs become a response
(`make_response`) or stream chunks (`first_chunks`, `delta_chunks`). Outputs are ordered prompt-major: choice
index = prompt index * n + copy, and usage counts each prompt's tokens once however large n is. Before
tokenizing, a body's unsupported fields (`request_fields`) and `check_common`'s partial ones are checked.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import AsyncIterator, Iterable
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tokenloom.entrypoints.openai.protocol import SamplingExtras, UsageInfo
from tokenloom.entrypoints.serving_utils import (
    SSE_DONE,
    ClientDisconnected,
    abort_error,
    body_error,
    cancel_on_disconnect,
    format_validation_errors,
    gather_or_cancel,
    openai_error,
    openai_error_body,
    read_json_body,
    require_object,
    sse,
    start_stream,
)
from tokenloom.frontend.tokenizer_manager import DetokenizeError, EngineDeadError, TokenizerManager
from tokenloom.grammar.spec import JSON_OBJECT_SCHEMA
from tokenloom.protocol import TokenizedRequest


class OpenAIServingBase:
    request_model: type[SamplingExtras] = SamplingExtras
    id_prefix = "cmpl"

    def __init__(self, tokenizer_manager: TokenizerManager, model_name: str) -> None:
        self.tm = tokenizer_manager
        self.model_name = model_name

    # --- subclass hooks ------------------------------------------------------------------------------
    def tokenize(self, req: Any) -> list[TokenizedRequest]:
        raise NotImplementedError

    def make_response(self, req: Any, outs: list[dict[str, Any]], usage: UsageInfo) -> BaseModel:
        raise NotImplementedError

    def first_chunks(self, req: Any, rid: str, index: int, out: dict[str, Any]) -> list[dict[str, Any]]:
        return []

    def delta_chunks(self, req: Any, rid: str, index: int, delta: str, offset: int,
                     logprobs: list[list[Any]] | None, top: list[list[list[Any]]] | None,
                     finish: dict[str, Any] | None, usage: UsageInfo | None) -> list[dict[str, Any]]:
        """Chunks for new text `delta` of choice `index` (`offset`: characters streamed before it)."""
        raise NotImplementedError

    def usage_chunk(self, req: Any, rid: str, usage: UsageInfo) -> dict[str, Any]:
        raise NotImplementedError

    # --- request handling ----------------------------------------------------------------------------
    async def handle(self, request: Request) -> Response:
        body = require_object(await read_json_body(request, require_json_type=True))
        try:
            req = self.request_model.model_validate(body)
        except ValidationError as e:
            return body_error(format_validation_errors(e.errors()))
        try:
            req.check_supported()
            check_common(req)
            reqs = await self.tm.off_loop(self.tokenize, req)
        except ValueError as e:
            return openai_error(str(e))
        if req.stream:
            return await start_stream(request, self.tm, reqs, openai_error, lambda items: self._stream(req, items))
        try:
            outs = await cancel_on_disconnect(request, gather_or_cancel([self._last(r) for r in reqs]))
        except ClientDisconnected:
            return Response(status_code=499)
        except EngineDeadError as e:  # the runtime died under the request: unavailable, not a bad request
            return openai_error(str(e), 503)
        for out in outs:
            error = abort_error(out)
            if error is not None:
                return openai_error(error[1], error[0])
        outs = [end_at_stop(req, out) for out in outs]
        return JSONResponse(self.make_response(req, outs, usage_of(enumerate(outs), req.n)).model_dump())

    async def _last(self, req: TokenizedRequest) -> dict[str, Any]:
        out: dict[str, Any] = {}
        async for out in self.tm.generate_request(req):  # noqa: B007 - only the final output matters
            pass
        return out

    async def _stream(self, req: Any, items: AsyncIterator[tuple[int, dict[str, Any]]]) -> AsyncIterator[str]:
        rid = f"{self.id_prefix}-{uuid.uuid4().hex}"
        options = req.stream_options
        include_usage = bool(options and options.include_usage)
        continuous = bool(options and options.continuous_usage_stats)
        text_len: dict[int, int] = {}
        logprob_len: dict[int, int] = {}
        last: dict[int, dict[str, Any]] = {}
        try:
            async for i, out in items:
                error = abort_error(out)
                if error is not None:
                    yield sse({"error": openai_error_body(error[1], error[0])})
                    break
                out = end_at_stop(req, out)
                meta = out["meta_info"]
                if i not in text_len:
                    text_len[i], logprob_len[i] = 0, 0
                    for chunk in self.first_chunks(req, rid, i, out):
                        yield sse(chunk)
                last[i] = out
                offset = text_len[i]
                delta = out["text"][offset:]
                text_len[i] = max(offset, len(out["text"]))
                lps = meta.get("output_token_logprobs")
                new_lps = tops = None
                if lps is not None:
                    new_lps = lps[logprob_len[i]:]
                    if "output_top_logprobs" in meta:
                        tops = meta["output_top_logprobs"][logprob_len[i]:]
                    logprob_len[i] = len(lps)
                finish = meta["finish_reason"]
                if not delta and not new_lps and finish is None:
                    continue
                usage = usage_of(last.items(), req.n) if continuous else None
                for chunk in self.delta_chunks(req, rid, i, delta, offset, new_lps, tops, finish, usage):
                    yield sse(chunk)
            else:
                if include_usage:
                    yield sse(self.usage_chunk(req, rid, usage_of(last.items(), req.n)))
        except (ValueError, EngineDeadError, DetokenizeError) as e:
            status = 503 if isinstance(e, EngineDeadError) else 500 if isinstance(e, DetokenizeError) else 400
            yield sse({"error": openai_error_body(str(e), status)})
        yield SSE_DONE

    # --- shared translation --------------------------------------------------------------------------
    def sampling_params(self, req: SamplingExtras, max_new_tokens: int | None,
                        defaults: dict[str, Any] | None = None) -> dict[str, Any]:
        """OpenAI/SGLang request fields → a sampling-params dict; unset knobs take `defaults` (the model's
        generation config for chat), then SGLang's defaults."""
        defaults = defaults or {}
        knobs = {k: getattr(req, k) for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")}
        params: dict[str, Any] = {
            **{k: (v if v is not None else defaults.get(k)) for k, v in knobs.items()},
            "max_new_tokens": max_new_tokens, "min_new_tokens": req.min_tokens,
            "frequency_penalty": req.frequency_penalty, "presence_penalty": req.presence_penalty,
            "stop": req.stop, "stop_token_ids": req.stop_token_ids, "ignore_eos": req.ignore_eos,
            "no_stop_trim": req.no_stop_trim or req.include_stop_str_in_output,
            "skip_special_tokens": req.skip_special_tokens,
            "spaces_between_special_tokens": req.spaces_between_special_tokens, "n": req.n,
            "logit_bias": req.logit_bias, "sampling_seed": req.seed if req.seed is not None else req.sampling_seed,
            "stop_regex": req.stop_regex, "custom_params": req.custom_params, **grammar_params(req),
        }
        return {k: v for k, v in params.items() if v is not None or k == "max_new_tokens"}

    def response_model_name(self, req: SamplingExtras) -> str:
        return req.model or self.model_name


def check_common(req: SamplingExtras) -> None:
    """The value checks of fields both routes declare but support only in part."""
    if req.best_of is not None and req.best_of != req.n:
        raise ValueError(f"best_of must equal n ({req.n}) in tokenloom (no server-side ranking of extra "
                         f"candidates), got {req.best_of}")
    grammar_params(req)


def _regex_literal(text: str) -> str:
    """`text` as a regex matching exactly it (only the regex metacharacters escaped: xgrammar warns about
    escapes of other characters, such as re.escape's escaped spaces)."""
    return re.sub(r"([\\.^$|?*+()\[\]{}/-])", r"\\\1", text)


RESPONSE_FORMATS = ("text", "json_object", "json_schema", "structural_tag")


def grammar_params(req: SamplingExtras) -> dict[str, str]:
    """The grammar a request asks for, as one SGLang sampling key (json_schema, regex, ebnf, structural_tag),
    from SGLang's own keys, OpenAI's `response_format` or vLLM's `guided_*` aliases; at most one source.
    `guided_choice` is a regex alternation of the escaped choices; json_schema's `strict` is always honoured."""
    found: list[tuple[str, str, str]] = []  # (source field, sampling key, grammar text)
    for name in ("json_schema", "regex", "ebnf", "structural_tag"):
        if getattr(req, name) is not None:
            found.append((name, name, getattr(req, name)))
    rf = req.response_format
    if rf is not None:
        if not isinstance(rf, dict):
            raise ValueError("response_format must be an object with a type")
        kind = rf.get("type", "text")
        if kind not in RESPONSE_FORMATS:
            raise ValueError(f"response_format type must be one of {', '.join(RESPONSE_FORMATS)}, got {kind!r}")
        if kind == "json_object":
            found.append(("response_format", "json_schema", JSON_OBJECT_SCHEMA))
        elif kind == "json_schema":
            spec = rf.get("json_schema")
            if not isinstance(spec, dict) or "schema" not in spec and "schema_" not in spec:
                raise ValueError("response_format json_schema needs a json_schema object with a schema "
                                 "({\"name\": ..., \"schema\": {...}})")
            schema = spec.get("schema", spec.get("schema_"))
            if not isinstance(schema, dict | bool):
                raise ValueError("response_format json_schema.schema must be a JSON schema object")
            found.append(("response_format", "json_schema", json.dumps(schema)))
        elif kind == "structural_tag":
            found.append(("response_format", "structural_tag", json.dumps(rf)))
    if req.guided_json is not None:
        text = req.guided_json if isinstance(req.guided_json, str) else json.dumps(req.guided_json)
        found.append(("guided_json", "json_schema", text))
    if req.guided_regex is not None:
        found.append(("guided_regex", "regex", req.guided_regex))
    if req.guided_choice is not None:
        if not req.guided_choice:
            raise ValueError("guided_choice must list at least one choice")
        found.append(("guided_choice", "regex", "|".join(f"({_regex_literal(c)})" for c in req.guided_choice)))
    if req.guided_grammar is not None:
        found.append(("guided_grammar", "ebnf", req.guided_grammar))
    if len(found) > 1:
        raise ValueError(f"only one structured-output constraint may be given, got {found[0][0]} and {found[1][0]}")
    return {found[0][1]: found[0][2]} if found else {}


def end_at_stop(req: SamplingExtras, out: dict[str, Any]) -> dict[str, Any]:
    """vLLM's include_stop_str_in_output: the text ends with the matched stop string. It runs with
    no_stop_trim, which also keeps the rest of the token that completed the stop string; that rest is cut
    here. Only the finishing output can hold it (the token completing a stop string is the last)."""
    finish = out["meta_info"]["finish_reason"]
    if not req.include_stop_str_in_output or req.no_stop_trim or not finish or finish.get("type") != "stop":
        return out
    matched, text = finish.get("matched"), out["text"]
    end = text.find(matched) + len(matched) if isinstance(matched, str) and matched in text else len(text)
    return out if end == len(text) else {**out, "text": text[:end]}


def usage_of(outputs: Iterable[tuple[int, dict[str, Any]]], n: int) -> UsageInfo:
    """Usage of (choice index, output) pairs: prompt tokens once per prompt (choice i belongs to prompt
    i // n), completion tokens of every choice."""
    prompts: dict[int, int] = {}
    completion = 0
    for i, out in outputs:
        prompts.setdefault(i // max(n, 1), out["meta_info"]["prompt_tokens"])
        completion += out["meta_info"]["completion_tokens"]
    prompt = sum(prompts.values())
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def finish_reason_of(finish: dict[str, Any] | None) -> tuple[str | None, int | str | None]:
    """SGLang finish reason → OpenAI's ("stop" | "length" | "abort" | None) and the matched stop."""
    if finish is None:
        return None, None
    kind = finish.get("type")
    return kind, finish.get("matched") if kind == "stop" else None
