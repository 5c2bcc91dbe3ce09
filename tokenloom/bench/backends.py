"""One request per backend family, timed: builds the HTTP body, sends it with aiohttp, reads the JSON answer or
the SSE stream, and fills a `RequestOutput` (see `metrics.py` for what each time means).

Families (SGLang's backend names, plus `tokenloom` and `openai*`):
- native `/generate` (`tokenloom`, `sglang`, `sglang-native`): body `{text | input_ids, sampling_params:
  {temperature 0, max_new_tokens, ignore_eos}, stream}`; streamed events carry the cumulative text and
  `meta_info.completion_tokens`: the new tokens a chunk carried.
- OpenAI completions (`sglang-oai`, `vllm`, `openai`): `/v1/completions` with `prompt`, `max_tokens`.
- OpenAI chat (`sglang-oai-chat`, `vllm-chat`, `openai-chat`): `/v1/chat/completions`, the prompt as one user
  message. OpenAI streams ask for a final usage chunk; without one, the output length is the requested one.
  The new tokens of each text chunk come from `metrics.chunk_token_counts`: a cumulative count the chunk
  carries (`usage.completion_tokens`, or llama-server's `timings.predicted_n` when asked for
  `timings_per_token`), else the final usage, else `RequestInput.count_tokens` on the chunk's text.

ITL is per token on every backend (`metrics.stream_timing`): a chunk carrying k tokens adds k gaps of gap/k.

`--extra-request-body` keys go to the top level of the body; on the native backend a `sampling_params` key
in it is merged into the sampling parameters instead. Errors (HTTP status, error events, aborted requests,
connection failures) never raise: they make the output unsuccessful and carry a one-line message.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from tokenloom.bench.metrics import RequestOutput, chunk_token_counts, stream_timing

NATIVE_BACKENDS = ("tokenloom", "sglang", "sglang-native")
COMPLETION_BACKENDS = ("sglang-oai", "vllm", "openai")
CHAT_BACKENDS = ("sglang-oai-chat", "vllm-chat", "openai-chat")
BACKENDS = NATIVE_BACKENDS + COMPLETION_BACKENDS + CHAT_BACKENDS
ERROR_CHARS = 300


@dataclass
class RequestInput:
    prompt: str | list[int]
    prompt_len: int
    output_len: int
    api_url: str
    model: str = ""
    stream: bool = True
    ignore_eos: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    count_tokens: Callable[[str], int] | None = None  # tokens in a streamed text piece, for OpenAI chunk ITL


RequestFunc = Callable[[aiohttp.ClientSession, RequestInput], Awaitable[RequestOutput]]


def endpoint_of(backend: str) -> str:
    if backend in NATIVE_BACKENDS:
        return "/generate"
    if backend in COMPLETION_BACKENDS:
        return "/v1/completions"
    if backend in CHAT_BACKENDS:
        return "/v1/chat/completions"
    raise ValueError(f"unknown backend {backend!r}")


def default_port(backend: str) -> int:
    return 30000 if backend in ("tokenloom",) or backend.startswith("sglang") else 8000


def short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= ERROR_CHARS else text[:ERROR_CHARS] + "..."


def error_message(body: Any) -> str:
    """The message of an error body in any of the usual shapes."""
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if isinstance(body.get("message"), str):
            return body["message"]
        if isinstance(body.get("detail"), str):
            return body["detail"]
    return short(json.dumps(body) if not isinstance(body, str) else body)


async def sse_events(resp: aiohttp.ClientResponse) -> AsyncIterator[tuple[float, Any]]:
    """(arrival time, parsed JSON) per `data:` event; stops after `[DONE]` (its time is the last one yielded,
    with None)."""
    async for raw in resp.content:
        line = raw.strip()
        if not line or line.startswith(b":"):
            continue
        now = time.perf_counter()
        if line.startswith(b"data:"):
            line = line[5:].strip()
        if line == b"[DONE]":
            yield now, None
            return
        try:
            yield now, json.loads(line)
        except json.JSONDecodeError:
            yield now, {"error": {"message": f"unparsable stream line: {short(line.decode(errors='replace'))}"}}


def _abort_message(meta: dict[str, Any]) -> str | None:
    finish = meta.get("finish_reason")
    if isinstance(finish, dict) and finish.get("type") == "abort":
        return f"request aborted: {finish.get('message') or 'no message'}"
    return None


async def _send(session: aiohttp.ClientSession, req: RequestInput, payload: dict[str, Any],
                read: Callable[[aiohttp.ClientResponse, RequestOutput, float], Awaitable[None]]) -> RequestOutput:
    out = RequestOutput(prompt_len=req.prompt_len)
    out.start_time = start = time.perf_counter()
    try:
        async with session.post(req.api_url, json=payload, headers=req.headers) as resp:
            if resp.status != 200:
                text = await resp.text()
                try:
                    message = error_message(json.loads(text))
                except json.JSONDecodeError:
                    message = short(text)
                out.error = f"HTTP {resp.status}: {message}"
                return out
            await read(resp, out, start)
    except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as e:
        out.error = f"{type(e).__name__}: {short(str(e)) or 'no details'}"
        out.success = False
    return out


def _finish_token_times(out: RequestOutput, end: float) -> None:
    """Make `token_times` one entry per output token (tokens the stream did not time arrive at the end)."""
    if len(out.token_times) > out.output_len:
        del out.token_times[out.output_len:]
    out.token_times += [end] * (out.output_len - len(out.token_times))


async def request_native(session: aiohttp.ClientSession, req: RequestInput) -> RequestOutput:
    """POST /generate."""
    sampling = {"temperature": 0.0, "max_new_tokens": req.output_len, "ignore_eos": req.ignore_eos}
    extra = dict(req.extra_body)
    sampling.update(extra.pop("sampling_params", None) or {})
    payload = {("text" if isinstance(req.prompt, str) else "input_ids"): req.prompt,
               "sampling_params": sampling, "stream": req.stream, **extra}

    async def read(resp: aiohttp.ClientResponse, out: RequestOutput, start: float) -> None:
        if not req.stream:
            body = await resp.json(content_type=None)
            out.latency = out.ttft = time.perf_counter() - start
            _native_final(out, body)
            _finish_token_times(out, start + out.latency)
            return
        chunks: list[tuple[float, int]] = []  # (arrival, new tokens) from the first chunk carrying text on
        prev_tokens, last = 0, None
        end = start
        async for now, data in sse_events(resp):
            end = now
            if data is None:
                break
            if "error" in data:
                out.error = error_message(data)
                return
            last = data
            tokens = int(data.get("meta_info", {}).get("completion_tokens", 0))
            if not chunks:
                if data.get("text"):
                    out.ttft = now - start
                    chunks.append((now, tokens))
                    prev_tokens = tokens
                continue
            if tokens > prev_tokens:
                chunks.append((now, tokens - prev_tokens))
                prev_tokens = tokens
        out.itl, out.token_times = stream_timing(chunks)
        out.latency = end - start
        if last is None:
            out.error = "the stream ended without any output"
            return
        if not out.ttft:
            out.ttft = out.latency
        _native_final(out, last)
        _finish_token_times(out, end)

    return await _send(session, req, payload, read)


def _native_final(out: RequestOutput, body: Any) -> None:
    if isinstance(body, list):  # a batch answer: the benchmark sends one prompt per request
        body = body[0] if body else {}
    meta = body.get("meta_info", {}) if isinstance(body, dict) else {}
    aborted = _abort_message(meta)
    if aborted:
        out.error = aborted
        return
    out.generated_text = body.get("text", "")
    out.output_len = int(meta.get("completion_tokens", 0))
    if "prompt_tokens" in meta:
        out.server_prompt_tokens = int(meta["prompt_tokens"])
    if meta.get("cached_tokens") is not None:
        out.cached_tokens = int(meta["cached_tokens"])
    out.success = True


def _usage(out: RequestOutput, usage: Any) -> int | None:
    """Record prompt/cached tokens of an OpenAI usage object; its completion token count, if any."""
    if not isinstance(usage, dict):
        return None
    if usage.get("prompt_tokens") is not None:
        out.server_prompt_tokens = int(usage["prompt_tokens"])
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and details.get("cached_tokens") is not None:
        out.cached_tokens = int(details["cached_tokens"])
    value = usage.get("completion_tokens")
    return int(value) if value is not None else None


def _openai_request(chat: bool) -> RequestFunc:
    async def request(session: aiohttp.ClientSession, req: RequestInput) -> RequestOutput:
        payload: dict[str, Any] = {"model": req.model, "max_tokens": req.output_len, "temperature": 0.0,
                                   "stream": req.stream}
        if req.ignore_eos:  # an extension: sent only when wanted, as strict OpenAI servers reject it
            payload["ignore_eos"] = True
        if chat:
            payload["messages"] = [{"role": "user", "content": req.prompt}]
        else:
            payload["prompt"] = req.prompt
        if req.stream:
            payload["stream_options"] = {"include_usage": True}
        payload.update(req.extra_body)

        def piece(choice: dict[str, Any]) -> str:
            if chat:
                holder = choice.get("delta") or choice.get("message") or {}
                return holder.get("content") or ""
            return choice.get("text") or ""

        async def read(resp: aiohttp.ClientResponse, out: RequestOutput, start: float) -> None:
            reported = None
            if not req.stream:
                body = await resp.json(content_type=None)
                out.latency = out.ttft = time.perf_counter() - start
                if not isinstance(body, dict) or "error" in body or not body.get("choices"):
                    out.error = error_message(body)
                    return
                out.generated_text = piece(body["choices"][0])
                reported = _usage(out, body.get("usage"))
                out.output_len = reported if reported is not None else req.output_len
                _finish_token_times(out, start + out.latency)
                out.success = True
                return
            pieces: list[str] = []
            arrivals: list[float] = []
            cumulative: list[int | None] = []  # the completion tokens so far, as each text chunk reports it
            end = start
            async for now, data in sse_events(resp):
                end = now
                if data is None:
                    break
                if not isinstance(data, dict) or "error" in data:
                    out.error = error_message(data)
                    return
                choices = data.get("choices") or []
                text = piece(choices[0]) if choices else ""
                so_far = _usage(out, data.get("usage")) if data.get("usage") else None
                reported = so_far if so_far is not None else reported
                if text:
                    if not pieces:
                        out.ttft = now - start
                    pieces.append(text)
                    arrivals.append(now)
                    cumulative.append(so_far if so_far is not None else _predicted_n(data))
                if choices and choices[0].get("finish_reason") == "abort":
                    out.error = "request aborted"
                    return
            out.latency = end - start
            if not out.ttft:
                out.ttft = out.latency
            out.generated_text = "".join(pieces)
            if reported is None and cumulative and cumulative[-1] is not None:
                reported = cumulative[-1]
            counts = chunk_token_counts(pieces, cumulative, reported, req.count_tokens)
            out.itl, out.token_times = stream_timing(list(zip(arrivals, counts, strict=True)))
            out.output_len = reported if reported is not None else req.output_len
            _finish_token_times(out, end)
            out.success = True

        return await _send(session, req, payload, read)

    return request


def _predicted_n(data: dict[str, Any]) -> int | None:
    """llama-server's cumulative generated-token count (`timings.predicted_n`, sent per chunk when the request
    asks for `timings_per_token`)."""
    timings = data.get("timings")
    value = timings.get("predicted_n") if isinstance(timings, dict) else None
    return int(value) if isinstance(value, int | float) else None


request_completions = _openai_request(chat=False)
request_chat = _openai_request(chat=True)


def request_func_of(backend: str) -> RequestFunc:
    if backend in NATIVE_BACKENDS:
        return request_native
    if backend in COMPLETION_BACKENDS:
        return request_completions
    if backend in CHAT_BACKENDS:
        return request_chat
    raise ValueError(f"unknown backend {backend!r}")
