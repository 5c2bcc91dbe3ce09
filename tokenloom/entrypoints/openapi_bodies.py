"""OpenAPI request bodies for the routes that read their own JSON body (`request: Request`, so FastAPI documents
none): the JSON schema of the pydantic model a route validates its body with, with its `$defs` inlined so that it
stands alone inside the OpenAPI document (whose `#` is the document, not the schema).

Documentation only: `/openapi.json` then says what each route takes (for clients, and for schema-driven fuzzers
such as schemathesis); the routes still parse and answer errors their own way.
"""

from __future__ import annotations

import copy
from typing import Any

from pydantic import BaseModel

# POST /abort_request (SGLang's AbortReq fields the route reads); it has no pydantic model of its own.
ABORT_REQUEST_SCHEMA: dict[str, Any] = {
    "type": "object", "title": "AbortRequest",
    "properties": {"rid": {"type": "string", "title": "Rid"},
                   "abort_all": {"type": "boolean", "title": "Abort All", "default": False}},
}


def json_request_body(schema: dict[str, Any]) -> dict[str, Any]:
    """`openapi_extra` for a route whose required JSON body follows `schema`."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def model_request_body(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` for a route whose JSON body is validated with `model`."""
    return json_request_body(inline_defs(model.model_json_schema()))


def inline_defs(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` without `$defs`: every `{"$ref": "#/$defs/Name"}` replaced by a copy of that definition.
    Raises ValueError on a recursive definition (none of the request models has one; it could not be inlined)."""
    defs = schema.get("$defs", {})

    def resolve(node: Any, seen: tuple[str, ...]) -> Any:
        if isinstance(node, list):
            return [resolve(item, seen) for item in node]
        if not isinstance(node, dict):
            return node
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            name = ref.removeprefix("#/$defs/")
            if name in seen:
                raise ValueError(f"recursive schema definition {name!r} cannot be inlined")
            rest = {k: resolve(v, seen) for k, v in node.items() if k != "$ref"}
            return {**resolve(copy.deepcopy(defs[name]), (*seen, name)), **rest}
        return {k: resolve(v, seen) for k, v in node.items() if k != "$defs"}

    return resolve(schema, ())
