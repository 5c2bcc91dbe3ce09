"""`--log-requests`: one INFO line when a request arrives ("Receive: ...") and one when it ends ("Finish: ..."),
on the `tokenloom.requests` logger, with SGLang's `--log-requests-level` meaning:

    0  metadata: request id, prompt length, stream / logprob flags; at the end the finish reason's type,
       token counts and latency
    1  also the sampling parameters (those not at their default) and the whole finish reason
    2  also the input (text, else token ids) and the output (text and token ids), each cut to 2048
       characters or ids
    3  the same, in full

Without `--log-requests` nothing is logged here, and no other module logs a prompt or an output: that is the
server's privacy default (tests/e2e/test_server_logs.py reads a real server's whole log for it). Health
probes (`HEALTH_CHECK_*` requests, see entrypoints/http_server.py) are not logged at any level.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from tokenloom.config import ServerArgs
from tokenloom.protocol import HEALTH_CHECK_RID_PREFIX, TokenizedRequest
from tokenloom.sampling.sampling_params import SamplingParams

logger = logging.getLogger("tokenloom.requests")

TRUNCATE_AT = 2048  # characters of a text, or items of a list, at level 2 (SGLang's max_length)


def log_received(args: ServerArgs, req: TokenizedRequest) -> None:
    """The "Receive" line of `req`, when --log-requests is on."""
    if not _wanted(args, req.rid):
        return
    level = args.log_requests_level
    fields: dict[str, Any] = {"rid": req.rid, "input_tokens": len(req.input_ids), "stream": req.stream,
                              "return_logprob": req.return_logprob}
    if level >= 1:
        fields["sampling_params"] = _changed_params(req.sampling_params)
    if level >= 2:
        if req.input_text is not None:
            fields["text"] = req.input_text
        else:
            fields["input_ids"] = req.input_ids
    logger.info("Receive: %s", _format(fields, level))


def log_finished(args: ServerArgs, req: TokenizedRequest, out: dict[str, Any] | None) -> None:
    """The "Finish" line of `req`: `out` is its final output (text, output_ids, meta_info), or None when it
    ended without one (its caller went away, so it was aborted, or the engine failed)."""
    if not _wanted(args, req.rid):
        return
    level = args.log_requests_level
    if out is None:
        logger.info("Finish: %s", _format({"rid": req.rid, "finish_reason": "ended without an output"}, level))
        return
    meta = out.get("meta_info", {})
    finish = meta.get("finish_reason") or {}
    fields: dict[str, Any] = {"rid": req.rid, "finish_reason": finish if level >= 1 else finish.get("type")}
    for key in ("prompt_tokens", "completion_tokens", "cached_tokens"):
        if key in meta:
            fields[key] = meta[key]
    if "e2e_latency" in meta:
        fields["e2e_latency"] = round(meta["e2e_latency"], 4)
    if level >= 2:
        fields["text"] = out.get("text")
        fields["output_ids"] = out.get("output_ids")
    logger.info("Finish: %s", _format(fields, level))


def _wanted(args: ServerArgs, rid: str) -> bool:
    return args.log_requests and not rid.startswith(HEALTH_CHECK_RID_PREFIX) and logger.isEnabledFor(logging.INFO)


def _changed_params(params: SamplingParams) -> dict[str, Any]:
    """The sampling parameters the request set (those not at the dataclass default)."""
    return {f.name: getattr(params, f.name) for f in dataclasses.fields(params)
            if f.init and getattr(params, f.name) != f.default}


def _format(fields: dict[str, Any], level: int) -> str:
    limit = TRUNCATE_AT if level <= 2 else None
    return ", ".join(f"{key}={_truncated(value, limit)!r}" for key, value in fields.items())


def _truncated(value: Any, limit: int | None) -> Any:
    """`value` with every string and list longer than `limit` cut to it, marked with how long it was."""
    if limit is None:
        return value
    if isinstance(value, str) and len(value) > limit:
        return f"{value[:limit]}... ({len(value)} characters)"
    if isinstance(value, list):
        items = [_truncated(v, limit) for v in value[:limit]]
        return items + [f"... ({len(value)} items)"] if len(value) > limit else items
    if isinstance(value, dict):
        return {k: _truncated(v, limit) for k, v in value.items()}
    return value
