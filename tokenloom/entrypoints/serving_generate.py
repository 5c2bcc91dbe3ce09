"""The native `/generate` route's work: the body schema (SGLang's `GenerateReqInput` fields), its
translation into TokenizerManager calls, and the JSON or SSE answer.

Single prompt → one object, batch (list of texts or of id lists, or n > 1) → a list. Streaming sends
`data: <object>` events with cumulative `text` and `output_ids` (a batch's events carry `index`), then
`data: [DONE]`. Errors: a bad body is a 400 in the body-error shape; a bad request (validation in the
TokenizerManager) a 400 `{"error": {"message"}}`; a scheduler-side refusal keeps its status (503 when the
queue is full).

Every top-level field of SGLang's `GenerateReqInput` is accepted (the rule is in `request_fields`): the ones
used are declared below, hints are ignored, and a feature tokenloom lacks (LoRA, multimodal input, hidden
states, ...) set to anything but its default is a 400 naming the field. Unknown keys are ignored, as SGLang
does (its router forwards its own defaults such as `model`, `no_logs`, `return_entropy: false`).
`return_prompt_token_ids` adds the prompt's token ids to each object as `prompt_token_ids`; one string
`rid` for a batch names its prompts `<rid>_<i>`, as in SGLang.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, ClassVar

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tokenloom.entrypoints.request_fields import (
    COMMON_UNSUPPORTED,
    NO_EMBEDS,
    NO_LORA,
    NO_MULTIMODAL,
    NO_REASONING,
    LenientRequest,
)
from tokenloom.entrypoints.serving_utils import (
    SSE_DONE,
    ClientDisconnected,
    abort_error,
    body_error,
    cancel_on_disconnect,
    format_validation_errors,
    gather_or_cancel,
    native_error,
    read_json_body,
    require_object,
    sse,
    start_stream,
)
from tokenloom.frontend.tokenizer_manager import DetokenizeError, EngineDeadError, TokenizerManager
from tokenloom.protocol import TokenizedRequest

# SGLang's GenerateReqInput fields (python/sglang/srt/managers/io_struct.py) that /generate does not use.
_MULTIMODAL = ("image_data", "video_data", "audio_data", "mm_hashes", "mm_content_hashes", "modalities",
               "video_config", "max_dynamic_patch", "min_dynamic_patch", "image_max_dynamic_patch",
               "video_max_dynamic_patch", "images_config")


class GenerateReqInput(LenientRequest):
    """Body of POST /generate: the fields tokenloom uses; SGLang's others are classified below."""

    text: Any = None
    input_ids: Any = None
    sampling_params: Any = None
    rid: Any = None
    stream: bool = False
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    token_ids_logprob: Any = None
    return_prompt_token_ids: bool = False
    # prefill/decode disaggregation (SGLang's router adds them; a unified server ignores them)
    bootstrap_host: Any = None
    bootstrap_port: Any = None
    bootstrap_room: Any = None

    # Hints and bookkeeping with no effect on one text-only tokenloom server (no DP, PD, priorities,
    # per-request metric labels or tracing); `no_logs` holds trivially: request contents are never logged.
    IGNORED: ClassVar[frozenset[str]] = frozenset({
        "model", "session_id", "log_metrics", "priority", "routing_key", "conversation_id", "http_worker_ipc",
        "background", "no_logs", "custom_labels", "return_bytes", "external_trace_header", "received_time",
        "bootstrap_pair_key", "decode_tp_size",
        "disagg_prefill_dp_rank", "kv_router_hint", "routed_experts_start_len", "need_wait_for_mm_inputs",
        "num_items_assigned", "encoder_urls"})
    UNSUPPORTED: ClassVar[dict[str, tuple[Any, str]]] = {
        "input_embeds": (None, NO_EMBEDS),
        "positional_embed_overrides": (None, NO_EMBEDS),
        **{name: (None, NO_MULTIMODAL) for name in _MULTIMODAL},
        "use_audio_in_video": (False, NO_MULTIMODAL),
        **COMMON_UNSUPPORTED,
        "lora_id": (None, NO_LORA),
        "return_indexer_topk": (False, "it has no sparse-attention indexer"),
        "return_entropy": (False, "per-token entropy is not computed"),
        "return_sampling_mask": (False, "the sampling support of each token is not returned"),
        "return_flat_raw_top_logprobs": (False, "top logprobs come only as nested lists"),
        "return_flat_raw_top_logprobs_b64": (False, "top logprobs come only as nested lists"),
        "multi_item_delimiter_indices": (None, "it has no multi-item scoring"),
        "require_reasoning": (False, NO_REASONING),
        "max_thinking_tokens": (None, NO_REASONING),
    }


def batch_rid(obj: GenerateReqInput) -> Any:
    """SGLang's rule for one string rid on a batch: it is the prefix of per-prompt ids `<rid>_<i>`."""
    ids = obj.input_ids
    is_batch = isinstance(obj.text, list) if obj.text is not None else (
        isinstance(ids, list) and bool(ids) and isinstance(ids[0], list))
    if isinstance(obj.rid, str) and is_batch:
        return [f"{obj.rid}_{i}" for i in range(len(obj.text if obj.text is not None else ids))]
    return obj.rid


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
            reqs, is_batch = await self.tm.off_loop(self._tokenize, obj)
        except ValueError as e:
            return native_error(str(e))
        if obj.stream:
            return await start_stream(request, self.tm, reqs, native_error, lambda items: self._stream(
                items, reqs, is_batch, obj.return_text_in_logprobs, obj.return_prompt_token_ids))
        try:
            outs = await cancel_on_disconnect(request, self._collect(reqs))
        except ClientDisconnected:
            return Response(status_code=499)
        except EngineDeadError as e:  # the runtime died under the request: unavailable, not a bad request
            return native_error(str(e), 503)
        for out in outs:
            error = abort_error(out)
            if error is not None:
                return native_error(error[1], error[0])
        outs = [self._finish(out, obj.return_text_in_logprobs) for out in outs]
        if obj.return_prompt_token_ids:
            outs = [{**out, "prompt_token_ids": req.input_ids} for out, req in zip(outs, reqs, strict=True)]
        return JSONResponse(outs if is_batch else outs[0])

    def _tokenize(self, obj: GenerateReqInput) -> tuple[list[TokenizedRequest], bool]:
        obj.check_supported()
        return self.tm.tokenize_batch(obj.text, obj.input_ids, obj.sampling_params, batch_rid(obj), stream=obj.stream,
                                      return_logprob=obj.return_logprob, top_logprobs_num=obj.top_logprobs_num,
                                      logprob_start_len=obj.logprob_start_len,
                                      token_ids_logprob=obj.token_ids_logprob,
                                      bootstrap=(obj.bootstrap_host, obj.bootstrap_port, obj.bootstrap_room))

    async def _collect(self, reqs: list[TokenizedRequest]) -> list[dict[str, Any]]:
        async def last(req: TokenizedRequest) -> dict[str, Any]:
            out: dict[str, Any] = {}
            async for out in self.tm.generate_request(req):  # noqa: B007 - only the final output matters
                pass
            return out

        return await gather_or_cancel([last(r) for r in reqs])

    async def _stream(self, items: AsyncIterator[tuple[int, dict[str, Any]]], reqs: list[TokenizedRequest],
                      is_batch: bool, with_text: bool, with_prompt_ids: bool = False) -> AsyncIterator[str]:
        try:
            async for i, out in items:
                if is_batch:
                    out = {**out, "index": i}
                if with_prompt_ids:
                    out = {**out, "prompt_token_ids": reqs[i].input_ids}
                yield sse(self._finish(out, with_text))
        except (ValueError, EngineDeadError, DetokenizeError) as e:  # the stream ends with the reason
            yield sse({"error": {"message": str(e)}})
        yield SSE_DONE

    def _finish(self, out: dict[str, Any], with_text: bool) -> dict[str, Any]:
        """Fill the text slot of logprob triples when return_text_in_logprobs is set."""
        meta = out["meta_info"]
        if not with_text or "output_token_logprobs" not in meta:
            return out
        meta = dict(meta)
        for key in ("output_token_logprobs", "input_token_logprobs"):
            if key in meta:
                meta[key] = self._with_text(meta[key])
        for key in ("output_top_logprobs", "input_top_logprobs", "output_token_ids_logprobs",
                    "input_token_ids_logprobs"):
            if key in meta:  # per position a list of triples (None: a prompt position nothing scores)
                meta[key] = [None if pos is None else self._with_text(pos) for pos in meta[key]]
        return {**out, "meta_info": meta}

    def _with_text(self, triples: list[list[Any]]) -> list[list[Any]]:
        texts = self.tm.token_texts([t[1] for t in triples])
        return [[t[0], t[1], text] for t, text in zip(triples, texts, strict=True)]
