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
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.types import Receive, Scope, Send

T = TypeVar("T")

SSE_DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
UNSUPPORTED_MEDIA_TYPE = "Unsupported Media Type: Only 'application/json' is allowed"


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
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequestBody(f"Malformed JSON body: {e}") from None


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
        err_type = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                    503: "ServiceUnavailableError"}.get(status_code, "InternalServerError")
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
def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


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

    def __init__(self, content: AsyncIterator[str]) -> None:
        super().__init__(content, media_type="text/event-stream", headers=SSE_HEADERS)

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
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()
