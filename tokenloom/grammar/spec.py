"""`GrammarSpec`: the grammar one request asks for, as (kind, text), and its cheap validation.

Kinds: "json_schema" (a JSON schema, as JSON text), "json_object" (any JSON object: OpenAI's
`response_format: {"type": "json_object"}`), "regex", "ebnf" (GBNF-style EBNF with a `root` rule, SGLang's
`ebnf`) and "structural_tag" (xgrammar's structural tag, JSON text). The pair is the compile cache's key, so
two requests with the same schema text share one compiled grammar.

`validate_spec` parses the grammar without a vocabulary (no token masks are built: milliseconds at most), so
the HTTP side can refuse a bad schema, regex or grammar with a 400 before anything is queued; the scheduler
then compiles it against the vocabulary off its critical path (compiler.py).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

KINDS = ("json_schema", "json_object", "regex", "ebnf", "structural_tag")
# The sampling-parameter names that carry a grammar (SGLang's /generate keys).
PARAM_KINDS = ("json_schema", "regex", "ebnf", "structural_tag")


class GrammarError(ValueError):
    """A grammar that does not parse or compile; the message names the kind and the problem (a 400)."""


@dataclass(frozen=True)
class GrammarSpec:
    kind: str
    text: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise GrammarError(f"unknown grammar kind {self.kind!r} (expected one of {', '.join(KINDS)})")


# The one JSON-object grammar: `json_schema` set to this text means "any JSON object" (OpenAI's json_object).
JSON_OBJECT_SCHEMA = json.dumps({"type": "object"})


def spec_from_params(json_schema: str | None, regex: str | None, ebnf: str | None,
                     structural_tag: str | None) -> GrammarSpec | None:
    """The grammar a request's sampling params ask for (None: unconstrained). At most one may be set."""
    given = [(k, v) for k, v in zip(PARAM_KINDS, (json_schema, regex, ebnf, structural_tag), strict=True)
             if v is not None]
    if not given:
        return None
    if len(given) > 1:
        raise GrammarError(f"only one of json_schema, regex, ebnf and structural_tag may be set, got "
                           f"{' and '.join(k for k, _ in given)}")
    kind, text = given[0]
    if not isinstance(text, str):
        raise GrammarError(f"{kind} must be a string, got {type(text).__name__}")
    if kind == "structural_tag":
        try:
            tag = json.loads(text)
        except json.JSONDecodeError as e:
            raise GrammarError(f"structural_tag is not valid JSON: {e}") from None
        if not isinstance(tag, dict):
            raise GrammarError("structural_tag must be a JSON object")
        text = structural_tag_text(tag)
    if kind == "json_schema" and text == JSON_OBJECT_SCHEMA:
        return GrammarSpec("json_object", text)
    return GrammarSpec(kind, text)


def validate_spec(spec: GrammarSpec) -> None:
    """Raise `GrammarError` naming the problem when `spec` does not parse (xgrammar's parsers, which the
    llguidance backend's grammars are also checked with: every backend accepts what passes here or fails the
    request at compile time with the same 400-style message)."""
    try:
        import xgrammar as xgr
    except ImportError:  # only the llguidance backend installed: its compile in the scheduler checks instead
        return
    try:
        if spec.kind == "json_schema":
            schema = json.loads(spec.text)
            if not isinstance(schema, dict | bool):
                raise GrammarError("json_schema must be a JSON object (a JSON schema)")
            xgr.Grammar.from_json_schema(spec.text, any_whitespace=False)
        elif spec.kind == "regex":
            xgr.Grammar.from_regex(spec.text)
        elif spec.kind == "ebnf":
            xgr.Grammar.from_ebnf(spec.text)
        elif spec.kind == "structural_tag":
            xgr.Grammar.from_structural_tag(spec.text)
    except GrammarError:
        raise
    except json.JSONDecodeError as e:
        raise GrammarError(f"json_schema is not valid JSON: {e}") from None
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError subclasses with the reason
        raise GrammarError(f"invalid {spec.kind}: {first_line(str(e))}") from None


def structural_tag_text(tag: dict) -> str:
    """A structural tag as xgrammar's JSON text. SGLang's (and OpenAI-style) form {"type": "structural_tag",
    "structures": [{"begin", "schema", "end"}], "triggers": [...]} becomes xgrammar's triggered-tags format;
    a tag already in xgrammar's form ({"type": "structural_tag", "format": ...}) passes unchanged."""
    if "format" not in tag and "structures" in tag:
        structures = tag.get("structures")
        if not isinstance(structures, list) or not all(isinstance(x, dict) for x in structures):
            raise GrammarError("structural_tag structures must be a list of {begin, schema, end} objects")
        tags = [{"begin": x.get("begin"), "end": x.get("end"),
                 "content": {"type": "json_schema", "json_schema": x.get("schema", {})}} for x in structures]
        tag = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": tag.get("triggers", []),
                                                    "tags": tags}}
    return json.dumps(tag)


_NATIVE_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")  # xgrammar's "[hh:mm:ss] file.cc:line: " prefix


def first_line(message: str, limit: int = 400) -> str:
    text = _NATIVE_PREFIX.sub("", " ".join(message.strip().split()))
    return text if len(text) <= limit else text[:limit] + "..."
