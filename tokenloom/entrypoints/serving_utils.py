"""HTTP plumbing shared by the native and OpenAI-compatible routes: reading a JSON body with clear 400s,
error bodies in SGLang's shapes, SSE framing, merging the output streams of a batch, and tying a request's
lifetime to its client's connection.

Disconnects: a non-streaming handler runs its generation with `cancel_on_disconnect`, which races it
against the ASGI `http.disconnect` message; a streaming one answers with `DisconnectAwareStream`, which does
the same around the body iterator. Either way the generation task is cancelled, which closes the
TokenizerManager's `generate_request` generator, whose `finally` aborts the request in the scheduler (so
its KV is freed at once, not when the request would have finished).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from tokenloom.finish_reason import error_type_for
from tokenloom.frontend.tokenizer_manager import ACCEPTED, EngineDeadError

T = TypeVar("T")

SSE_DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
UNSUPPORTED_MEDIA_TYPE = "Unsupported Media Type: Only 'application/json' is allowed"
# cheap pre-check of a body's text: a surrogate escape, or a surrogate encoded as such (which json accepts)
MAY_HOLD_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]|[\ud800-\udfff]")
MAX_JSON_DEPTH = 64  # no request field nests beyond a few levels; deeper bodies only exhaust the parsers' stacks


class BadRequestBody(Exception):
    """The body is not a JSON document of the expected shape; answered 400 with SGLang's body-error shape."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class ClientDisconnected(Exception):
    """The client went away before its response was ready; the request has been aborted."""


# --- bodies and errors -------------------------------------------------------------------------------
async def read_json_body(request: Request, require_json_type: bool) -> Any:
    """Parse the body as JSON. `require_json_type`: the Content-Type must say JSON (the OpenAI routes, as
    in SGLang); the native routes read JSON whatever the header says (`curl -d` sends a form type)."""
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if require_json_type and media != "application/json" and not media.endswith("+json"):
        raise BadRequestBody(UNSUPPORTED_MEDIA_TYPE + f" (got {media or 'no Content-Type'})")
    body = await request.body()
    if not body.strip():
        raise BadRequestBody("The request body is empty; expected a JSON object.")
    try:
        text = body.decode(json.detect_encoding(body), "surrogatepass")  # as json.loads decodes bytes
        parsed = json.loads(text)
    except RecursionError:
        parsed = None
    except ValueError as e:  # syntax, encoding, or an integer of more digits than Python converts
        raise BadRequestBody(f"Malformed JSON body: {e}") from None
    if parsed is None and body.strip() != b"null" or json_depth(parsed) > MAX_JSON_DEPTH:
        raise BadRequestBody(f"The JSON body is nested more than {MAX_JSON_DEPTH} levels deep.")
    surrogate = lone_surrogate(parsed) if MAY_HOLD_SURROGATE.search(text) else None
    if surrogate is not None:  # no tokenizer or UTF-8 encoder takes one: refused here, not a 500 later
        where, char = surrogate
        raise BadRequestBody(f"{where}: a lone UTF-16 surrogate ({ascii(char)[1:-1]}) is not valid "
                             "Unicode text.")
    return parsed


def lone_surrogate(value: Any) -> tuple[str, str] | None:
    """(where, code point) of the first lone surrogate in the strings of parsed JSON, keys included, or None;
    `where` is the field's path (`sampling_params.stop[0]`; "a key in <path>" for a key). JSON's `\\ud800` escapes
    decode to one when they do not form a pair."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, dict):
            for key, child in node.items():
                found = _surrogate_in(key)
                if found is not None:
                    return f"a key in {path or 'the body'}", found
                stack.append((child, f"{path}.{key}" if path else key))
        elif isinstance(node, list):
            stack.extend((child, f"{path}[{i}]") for i, child in enumerate(node))
        elif isinstance(node, str):
            found = _surrogate_in(node)
            if found is not None:
                return path or "the body", found
    return None


def _surrogate_in(text: str) -> str | None:
    return None if text.isascii() else next((c for c in text if "\ud800" <= c <= "\udfff"), None)


def json_depth(value: Any) -> int:
    """How deeply arrays and objects nest in `value` (a scalar: 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return deepest


def require_object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise BadRequestBody(f"The request body must be a JSON object, got {type(body).__name__}.")
    return body


def format_validation_errors(errors: list[dict[str, Any]]) -> str:
    """Pydantic errors as one line: `field.path: message; ...` (the field names the problem)."""
    parts = []
    for err in errors:
        loc = ".".join(str(x) for x in err.get("loc", ()) if x not in ("body",))
        parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
    return "; ".join(parts) or "Invalid request body."


def body_error(message: str) -> JSONResponse:
    """SGLang's answer to a body that does not parse or validate (FastAPI's 422 made a 400)."""
    return JSONResponse({"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400},
                        status_code=400)


def native_error(message: str, status_code: int = 400) -> JSONResponse:
    """Error body of the native routes (/generate)."""
    return JSONResponse({"error": {"message": message}}, status_code=status_code)


def openai_error(message: str, status_code: int = 400, err_type: str | None = None,
                 param: str | None = None) -> JSONResponse:
    """Error body of the OpenAI-compatible routes."""
    return JSONResponse(openai_error_body(message, status_code, err_type, param), status_code=status_code)


def openai_error_body(message: str, status_code: int, err_type: str | None = None,
                      param: str | None = None) -> dict[str, Any]:
    if err_type is None:
        err_type = error_type_for(status_code)
    return {"object": "error", "message": message, "type": err_type, "param": param, "code": status_code}


def abort_error(out: dict[str, Any]) -> tuple[int, str] | None:
    """(status, message) when a finished output is an abort to report as an error: the scheduler refused
    or failed it (a status code is attached). An abort the client asked for has none and is a normal
    response with finish_reason abort."""
    finish = out["meta_info"].get("finish_reason") or {}
    if finish.get("type") == "abort" and finish.get("status_code"):
        return int(finish["status_code"]), str(finish.get("message"))
    return None


# --- SSE ---------------------------------------------------------------------------------------------
_JSON = json.JSONEncoder(ensure_ascii=False)  # json.dumps builds an encoder per call for non-default options


def sse(obj: Any) -> str:
    """One SSE event of `obj` as compact JSON (SGLang's server encodes its stream with orjson too). A /generate
    chunk carries the text and output ids so far, so its encoding grows with the output: orjson takes 1.4 us for
    a 128-id chunk where the stdlib encoder took 14 (every streamed token, on the cores the decode step needs).
    What orjson refuses (an int past 64 bits, a type it does not know) goes through the stdlib encoder."""
    try:
        body = orjson.dumps(obj, option=orjson.OPT_NON_STR_KEYS).decode()
    except TypeError:
        body = _JSON.encode(obj)
    return f"data: {body}\n\n"


async def merge_streams(gens: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Interleave several async iterators as (index, item) in arrival order. An error in one ends the
    merge; closing the merge closes every source (aborting their requests)."""
    if len(gens) == 1:
        async with contextlib.aclosing(gens[0]) as only:  # type: ignore[type-var]
            async for item in only:
                yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(i: int, gen: AsyncIterator[T]) -> None:
        try:
            async with contextlib.aclosing(gen):  # type: ignore[type-var]
                async for item in gen:
                    queue.put_nowait((i, item, None))
            queue.put_nowait((i, end, None))
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which re-raises it
            queue.put_nowait((i, None, e))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item, error = await queue.get()
            if error is not None:
                raise error
            if item is end:
                remaining -= 1
                continue
            yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def open_stream(request: Request, gens: list[AsyncIterator[Any]], accepted: Any
                      ) -> tuple[list[Any], AsyncIterator[tuple[int, Any]]]:
    """Merge `gens` (`merge_streams`) and wait, before the response starts, until every one of them was
    either accepted by the scheduler (it yields the `accepted` marker: queued, nothing generated yet) or
    answered (a refusal such as a full queue: a finished abort output). A refused request can then be answered
    with its HTTP status instead of a 200 stream holding an error event, while accepted ones start streaming
    before their first token. Returns the outputs that arrived meanwhile and an iterator of every (index, output)
    (those first, markers left out); raises ClientDisconnected (the requests then aborted) or what a source
    raised."""
    merged = merge_streams(gens)
    early: list[tuple[int, Any]] = []

    async def wait_for_each() -> None:
        heard: set[int] = set()
        while len(heard) < len(gens):
            i, item = await anext(merged)
            heard.add(i)
            if item is not accepted:
                early.append((i, item))

    try:
        await cancel_on_disconnect(request, wait_for_each())
    except BaseException:
        await merged.aclose()
        raise

    async def items() -> AsyncIterator[tuple[int, Any]]:
        try:
            for item in early:
                yield item
            async for i, item in merged:
                if item is not accepted:
                    yield i, item
        finally:
            await merged.aclose()

    return [item for _, item in early], items()


async def start_stream(request: Request, tm: Any, reqs: list[Any], error: Callable[[str, int], Response],
                       body: Callable[[AsyncIterator[tuple[int, Any]]], AsyncIterator[str]]) -> Response:
    """The answer to streaming `reqs`: once each is queued (`open_stream`), an SSE response of `body(items)`;
    an error response (`error(message, status)`) when one was refused at once (its status: 503 for a full
    queue), the runtime is dead (503) or the input is bad (400); 499 when the client left meanwhile."""
    try:
        early, items = await open_stream(request, [tm.generate_request(r, announce_acceptance=True) for r in reqs],
                                         ACCEPTED)
    except ClientDisconnected:
        return Response(status_code=499)
    except EngineDeadError as e:
        return error(str(e), 503)
    except ValueError as e:
        return error(str(e), 400)
    refusal = next((e for e in map(abort_error, early) if e is not None), None)
    if refusal is not None:  # refused before anything was generated (e.g. the queue is full)
        await items.aclose()
        return error(refusal[1], refusal[0])
    return DisconnectAwareStream(body(items), source=items)


async def gather_or_cancel(coros: list[Awaitable[T]]) -> list[T]:
    """Like asyncio.gather, but the first failure (or our own cancellation) cancels the others, so no
    request of a failed batch keeps running."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            if not task.done():
                task.cancel()


# --- disconnects -------------------------------------------------------------------------------------
async def wait_for_disconnect(receive: Receive) -> None:
    """Returns when the ASGI server reports the client gone (after the body has been read, the next
    message is `http.disconnect`; uvicorn also sends it once the response is complete)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`; if the client disconnects first, cancel it and raise ClientDisconnected."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise ClientDisconnected()
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()


class DisconnectAwareStream(StreamingResponse):
    """An SSE response that stops (and closes its body iterator) as soon as the client disconnects, even
    while no chunk is due (a queued request, a long prefill), instead of at the next failed write."""

    def __init__(self, content: AsyncIterator[str], source: Any = None) -> None:
        """`source`: an async iterator `content` reads (from `open_stream`), closed with it even if `content`
        never started (a client gone before the first chunk), so its requests are aborted either way."""
        super().__init__(content, media_type="text/event-stream", headers=SSE_HEADERS)
        self.source = source

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream = asyncio.ensure_future(self.stream_response(send))
        watcher = asyncio.ensure_future(wait_for_disconnect(receive))
        try:
            await asyncio.wait({stream, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if stream.done():
                error = stream.exception()
                if error is not None and not isinstance(error, OSError):  # OSError: the client went away
                    raise error
            else:
                stream.cancel()
                with contextlib.suppress(asyncio.CancelledError, OSError):
                    await stream
        finally:
            watcher.cancel()
            if not stream.done():
                stream.cancel()
            for iterator in (self.body_iterator, self.source):
                aclose = getattr(iterator, "aclose", None)
                if aclose is not None:
                    with contextlib.suppress(Exception):
                        await aclose()
