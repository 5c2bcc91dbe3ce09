"""The native `/generate` route's work: the body schema (SGLang's `GenerateReqInput` fields), its
translation into TokenizerManager calls, and the JSON or SSE answer.

Single prompt → one object, batch (list of texts or of id lists, or n > 1) → a list. Streaming sends
`data: <object>` events with cumulative `text` and `output_ids` (a batch's events carry `index`), then
`data: [DONE]`. Errors: a bad body is a 400 in the body-error shape; a bad request (validation in the
TokenizerManager) a 400 `{"error": {"message"}}`; a scheduler-side refusal keeps its status (503 when the
queue is full). Unknown top-level keys are rejected (a typo would otherwise be silently ignored).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tokenloom.entrypoints.serving_utils import (
    SSE_DONE,
    ClientDisconnected,
    DisconnectAwareStream,
    abort_error,
    body_error,
    cancel_on_disconnect,
    format_validation_errors,
    gather_or_cancel,
    merge_streams,
    native_error,
    read_json_body,
    require_object,
    sse,
)
from tokenloom.frontend.tokenizer_manager import EngineDeadError, TokenizerManager
from tokenloom.protocol import TokenizedRequest

# SGLang request fields for features tokenloom does not have: accepted only when unset.
UNSUPPORTED_FIELDS = ("input_embeds", "lora_path", "image_data", "video_data", "audio_data", "session_params",
                      "custom_logit_processor", "token_ids_logprob")


class GenerateReqInput(BaseModel):
    """Body of POST /generate."""

    model_config = ConfigDict(extra="forbid")

    text: Any = None
    input_ids: Any = None
    sampling_params: Any = None
    rid: Any = None
    stream: bool = False
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    # Unsupported features (must stay unset), see UNSUPPORTED_FIELDS.
    input_embeds: Any = None
    lora_path: Any = None
    image_data: Any = None
    video_data: Any = None
    audio_data: Any = None
    session_params: Any = None
    custom_logit_processor: Any = None
    token_ids_logprob: Any = None
    return_hidden_states: bool = False
    # Placement and bookkeeping hints with no effect on a single tokenloom server; accepted and ignored.
    priority: int | None = None
    extra_key: str | None = None
    routing_key: str | None = None
    data_parallel_rank: int | None = None
    bootstrap_host: Any = None
    bootstrap_port: Any = None
    bootstrap_room: Any = None
    log_metrics: bool = True
    modalities: Any = None


class GenerateServing:
    def __init__(self, tokenizer_manager: TokenizerManager) -> None:
        self.tm = tokenizer_manager

    async def handle(self, request: Request) -> Response:
        body = require_object(await read_json_body(request, require_json_type=False))
        try:
            obj = GenerateReqInput.model_validate(body)
        except ValidationError as e:
            return body_error(format_validation_errors(e.errors()))
        try:
            reqs, is_batch = self._tokenize(obj)
        except ValueError as e:
            return native_error(str(e))
        if obj.stream:
            return DisconnectAwareStream(self._stream(reqs, is_batch, obj.return_text_in_logprobs))
        try:
            outs = await cancel_on_disconnect(request, self._collect(reqs))
        except ClientDisconnected:
            return Response(status_code=499)
        except EngineDeadError as e:
            return native_error(str(e), 500)
        for out in outs:
            error = abort_error(out)
            if error is not None:
                return native_error(error[1], error[0])
        outs = [self._finish(out, obj.return_text_in_logprobs) for out in outs]
        return JSONResponse(outs if is_batch else outs[0])

    def _tokenize(self, obj: GenerateReqInput) -> tuple[list[TokenizedRequest], bool]:
        for name in UNSUPPORTED_FIELDS:
            if getattr(obj, name) is not None:
                raise ValueError(f"{name} is not supported by tokenloom")
        if obj.return_hidden_states:
            raise ValueError("return_hidden_states is not supported by tokenloom")
        return self.tm.tokenize_batch(obj.text, obj.input_ids, obj.sampling_params, obj.rid, stream=obj.stream,
                                      return_logprob=obj.return_logprob, top_logprobs_num=obj.top_logprobs_num,
                                      logprob_start_len=obj.logprob_start_len)

    async def _collect(self, reqs: list[TokenizedRequest]) -> list[dict[str, Any]]:
        async def last(req: TokenizedRequest) -> dict[str, Any]:
            out: dict[str, Any] = {}
            async for out in self.tm.generate_request(req):  # noqa: B007 - only the final output matters
                pass
            return out

        return await gather_or_cancel([last(r) for r in reqs])

    async def _stream(self, reqs: list[TokenizedRequest], is_batch: bool, with_text: bool) -> AsyncIterator[str]:
        try:
            async for i, out in merge_streams([self.tm.generate_request(r) for r in reqs]):
                if is_batch:
                    out = {**out, "index": i}
                yield sse(self._finish(out, with_text))
        except (ValueError, EngineDeadError) as e:
            yield sse({"error": {"message": str(e)}})
        yield SSE_DONE

    def _finish(self, out: dict[str, Any], with_text: bool) -> dict[str, Any]:
        """Fill the text slot of logprob triples when return_text_in_logprobs is set."""
        meta = out["meta_info"]
        if not with_text or "output_token_logprobs" not in meta:
            return out
        meta = dict(meta)
        meta["output_token_logprobs"] = self._with_text(meta["output_token_logprobs"])
        if "output_top_logprobs" in meta:
            meta["output_top_logprobs"] = [self._with_text(pos) for pos in meta["output_top_logprobs"]]
        return {**out, "meta_info": meta}

    def _with_text(self, triples: list[list[Any]]) -> list[list[Any]]:
        texts = self.tm.token_texts([t[1] for t in triples])
        return [[t[0], t[1], text] for t, text in zip(triples, texts, strict=True)]
