"""The finish reasons a request ends with, in SGLang's `meta_info.finish_reason` shape: `{"type": "length",
"length": N}`, `{"type": "stop", "matched": <token id or stop string>}`, `{"type": "abort", "message", "status_code",
"err_type"}`. The scheduler sets them, the IPC messages carry them, the HTTP layer maps them to responses."""

from __future__ import annotations

from typing import Any


def finish_length(length: int) -> dict[str, Any]:
    return {"type": "length", "length": length}


def finish_stop(matched: int | str) -> dict[str, Any]:
    return {"type": "stop", "matched": matched}


def finish_abort(message: str, status_code: int = 400, err_type: str = "BadRequestError") -> dict[str, Any]:
    return {"type": "abort", "message": message, "status_code": status_code, "err_type": err_type}
