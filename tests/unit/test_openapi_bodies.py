"""openapi_bodies: the request-body documents are the routes' own pydantic schemas, standing alone (no $refs)."""

from __future__ import annotations

import json

import pytest
from pydantic import BaseModel

from tokenloom.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from tokenloom.entrypoints.openapi_bodies import inline_defs, model_request_body
from tokenloom.entrypoints.serving_generate import GenerateReqInput


@pytest.mark.parametrize("model", [GenerateReqInput, CompletionRequest, ChatCompletionRequest])
def test_a_body_document_is_the_models_schema_without_refs(model):
    body = model_request_body(model)["requestBody"]
    schema = body["content"]["application/json"]["schema"]
    assert body["required"] is True
    assert "$ref" not in json.dumps(schema) and "$defs" not in schema
    assert set(schema["properties"]) == set(model.model_fields)


def test_nested_models_are_inlined():
    schema = model_request_body(ChatCompletionRequest)["requestBody"]["content"]["application/json"]["schema"]
    message = schema["properties"]["messages"]["items"]
    assert message["required"] == ["role"] and message["properties"]["role"] == {"title": "Role", "type": "string"}
    part = next(alt for alt in message["properties"]["content"]["anyOf"] if alt.get("type") == "array")["items"]
    assert part["properties"]["type"]["type"] == "string"


class Node(BaseModel):
    children: list[Node] = []


def test_a_recursive_definition_is_refused():
    with pytest.raises(ValueError, match="recursive schema definition 'Node'"):
        inline_defs(Node.model_json_schema())  # {"$ref": "#/$defs/Node", "$defs": {"Node": ...Node...}}
