"""`BodyLimitMiddleware`: refuses request bodies over `--max-request-body-bytes` with a 413 and a JSON error.

Plain ASGI, so it costs nothing on the routes (no BaseHTTPMiddleware, which would hide client disconnects).
Two cases:
- the request declares its length (Content-Length): over the limit, it is answered at once, before a byte of
  the body is read;
- it does not (chunked transfer encoding): the body is read here, counting bytes, and answered 413 as soon as
  the count passes the limit; under it, the buffered body is handed to the app as one message and every later
  `receive` (the disconnect the routes wait for) goes to the client's connection as before.
Nothing of a refused body is kept: what the client still sends after the 413 is read and dropped by the
HTTP layer (uvicorn discards a body once its response is complete), and the connection stays usable. The
413 deliberately does not close the connection: closing a socket with unread data makes the kernel reset
it, and the client would see a reset instead of the answer. A client that goes away while its chunked body
is being read is dropped without calling the app.
"""

from __future__ import annotations

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

FLAG = "--max-request-body-bytes"


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"{FLAG} must be >= 1; got {max_bytes}")
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None:
            if declared > self.max_bytes:
                await self._refuse(scope, receive, send, f"{declared} bytes")
                return
            await self.app(scope, receive, send)
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if len(body) > self.max_bytes:
                await self._refuse(scope, receive, send, f"more than {self.max_bytes} bytes")
                return
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(bytes(body), receive), send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, size: str) -> None:
        message = (f"Request body too large: {size}; the limit is {self.max_bytes} bytes ({FLAG}).")
        response = JSONResponse({"error": {"message": message, "type": "invalid_request_error", "code": 413}},
                                status_code=413)
        await response(scope, receive, send)


def _content_length(scope: Scope) -> int | None:
    """The declared body length, or None (chunked, or no body). A malformed value never reaches here: the
    HTTP parser refuses it."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that first returns the whole body already read, then defers to the connection's."""
    delivered = False

    async def replay() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
