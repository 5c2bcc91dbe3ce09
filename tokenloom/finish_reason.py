"""The finish reasons a request ends with, in SGLang's `meta_info.finish_reason` shape: `{"type": "length",
"length": N}`, `{"type": "stop", "matched": <token id or stop string>}`, `{"type": "abort", "message", "status_code",
"err_type"}`. The scheduler sets them, the IPC messages carry them, the HTTP layer maps them to responses."""

from __future__ import annotations

from typing import Any


def finish_length(length: int) -> dict[str, Any]:
    return {"type": "length", "length": length}


def finish_stop(matched: int | str) -> dict[str, Any]:
    return {"type": "stop", "matched": matched}


def error_type_for(status_code: int) -> str:
    """The OpenAI-style error type named by an HTTP status (a 5xx is an InternalServerError, never a bad request)."""
    return {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
            503: "ServiceUnavailableError"}.get(status_code, "InternalServerError")


def finish_abort(message: str, status_code: int = 400, err_type: str | None = None) -> dict[str, Any]:
    """An abort with its status; the error type follows the status unless given."""
    return {"type": "abort", "message": message, "status_code": status_code,
            "err_type": err_type or error_type_for(status_code)}
