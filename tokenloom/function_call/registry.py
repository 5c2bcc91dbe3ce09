"""`--tool-call-parser` names (SGLang's) -> the format that reads them."""

from __future__ import annotations

from typing import Any

from tokenloom.function_call.core import ToolFormat
from tokenloom.function_call.json_formats import DeepSeekV3Format, HermesFormat, Llama3Format, MistralFormat
from tokenloom.function_call.text_formats import PythonicFormat, Qwen3CoderFormat

TOOL_CALL_PARSERS: dict[str, type[ToolFormat]] = {
    "llama3": Llama3Format,
    "qwen25": HermesFormat,
    "qwen": HermesFormat,
    "hermes": HermesFormat,
    "mistral": MistralFormat,
    "pythonic": PythonicFormat,
    "deepseekv3": DeepSeekV3Format,
    "qwen3_coder": Qwen3CoderFormat,
}


def tool_format(name: str, tools: list[dict[str, Any]] | None = None) -> ToolFormat:
    """The format `name` reads, for a request offering `tools` (some formats type values by their schema)."""
    try:
        cls = TOOL_CALL_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {', '.join(TOOL_CALL_PARSERS)}") \
            from None
    return cls(tools) if cls is Qwen3CoderFormat else cls()
