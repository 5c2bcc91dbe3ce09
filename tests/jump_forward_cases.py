"""The grammars and prompts both jump-forward test modules use (tests/integration/test_jump_forward.py in process,
tests/e2e/test_jump_forward.py over HTTP): a schema with fixed keys, and a language of one string."""

EOS = 2
KEYS_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6}, "city": {"enum": ["Paris", "Rome"]},
    "age": {"type": "integer", "minimum": 0, "maximum": 99}, "verified": {"type": "boolean"}},
    "required": ["name", "city", "age", "verified"], "additionalProperties": False}
# a language of one string: every token after the first is forced
CONST_SCHEMA = {"type": "object", "properties": {
    "kind": {"const": "point"}, "version": {"const": 2}, "tags": {"const": ["alpha", "beta"]}},
    "required": ["kind", "version", "tags"], "additionalProperties": False}
CONST_VALUE = {"kind": "point", "version": 2, "tags": ["alpha", "beta"]}
PROMPTS = [[1, 422, 7542, 28], [1, 3070, 314, 253, 1142], [1, 1326, 15], [1, 905, 2128, 6110, 42, 19]]
