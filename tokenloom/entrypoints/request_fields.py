"""What a request body may carry besides the fields a route uses: the rule shared by /generate and the
OpenAI routes, so that SGLang's and vLLM's clients (and SGLang's router, which forwards its own defaults)
are served.

`LenientRequest` is the base of the request schemas. A body field is one of:
- used: a declared pydantic field, type-checked;
- ignored (`IGNORED`): a hint with no effect on one tokenloom server (routing keys, priorities, log and
  tracing flags, PD bootstrap fields); accepted with any value;
- unsupported (`UNSUPPORTED`, name -> (default, reason)): asks for a feature tokenloom does not have; the
  default and "empty" values (null, false, "", [], {}, a list of such) pass, anything else is refused by
  `check_supported` with a ValueError naming the field (the routes answer 400);
- unknown: ignored, as SGLang and vLLM do (a typo is not an error), and logged at debug level.
A null for a declared field whose type does not allow null means "the default" (clients send null for
unset knobs), so `{"stream": null}` is `stream: false`.
"""

from __future__ import annotations

import logging
import types
import typing
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, model_validator
from pydantic.fields import FieldInfo

logger = logging.getLogger(__name__)

# Reasons shared by both routes' tables (the 400 message is "<field> is not supported by tokenloom: <reason>").
NO_LORA = "it serves no LoRA adapters"
NO_MULTIMODAL = "it serves text-only models (no image, video or audio input)"
NO_EMBEDS = "prompts must be text or token ids (no embedding input)"
NO_SESSIONS = "it has no sessions (continual prompting)"
NO_LOGIT_PROCESSORS = "it runs no custom logit processors"
NO_HIDDEN_STATES = "hidden states are not returned"
NO_MOE_CAPTURE = "it captures no expert routing"
NO_CACHE_NAMESPACES = "every request shares one prefix cache (no cache namespaces)"
ONE_DP_RANK = "it runs one data-parallel rank (only 0 is valid)"
NO_REASONING = "it serves no reasoning models"

# Fields every route refuses when set (SGLang's /generate and both OpenAI routes declare them), with the
# value that means "unset" and the reason.
COMMON_UNSUPPORTED: dict[str, tuple[Any, str]] = {
    "lora_path": (None, NO_LORA),
    "session_params": (None, NO_SESSIONS),
    "custom_logit_processor": (None, NO_LOGIT_PROCESSORS),
    "return_hidden_states": (False, NO_HIDDEN_STATES),
    "return_routed_experts": (False, NO_MOE_CAPTURE),
    "extra_key": (None, NO_CACHE_NAMESPACES),
    "cache_salt": (None, NO_CACHE_NAMESPACES),
    "routed_dp_rank": (0, ONE_DP_RANK),
    "data_parallel_rank": (0, ONE_DP_RANK),
}


def _is_empty(value: Any) -> bool:
    if value is None or value is False or value == "":
        return True
    if isinstance(value, list | tuple):
        return all(_is_empty(v) for v in value)  # e.g. a batch's lora_path [null, null]
    return isinstance(value, dict) and not value


def asks_for_something(value: Any, default: Any) -> bool:
    """Whether `value` differs from the field's `default` in a way that requests a feature: null and the
    default itself never do, and neither do empty values when the default is null or false."""
    if value is None:
        return False
    # bool compares equal to 0/1; a flag only matches a flag
    same = value is default if isinstance(default, bool) or isinstance(value, bool) else value == default
    if same:
        return False
    if default is None or default is False:
        return not _is_empty(value)
    return True


def _accepts_none(field: FieldInfo) -> bool:
    annotation = field.annotation
    if annotation is Any or annotation is None:
        return True
    return typing.get_origin(annotation) in (typing.Union, types.UnionType) and type(None) in typing.get_args(
        annotation)


class LenientRequest(BaseModel):
    """A request schema that keeps unknown fields aside (in `model_extra`) instead of failing on them."""

    model_config = ConfigDict(extra="allow")

    IGNORED: ClassVar[frozenset[str]] = frozenset()
    UNSUPPORTED: ClassVar[dict[str, tuple[Any, str]]] = {}

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items()
                if not (v is None and k in fields and not fields[k].is_required() and not _accepts_none(fields[k]))}

    def check_supported(self) -> None:
        """Raise ValueError naming the first unsupported field set to a value that asks for something."""
        extra = self.model_extra or {}
        for name, (default, reason) in self.UNSUPPORTED.items():
            if name in extra and asks_for_something(extra[name], default):
                raise ValueError(f"{name} is not supported by tokenloom: {reason}")
        unknown = sorted(set(extra) - set(self.UNSUPPORTED) - self.IGNORED)
        if unknown:
            logger.debug("%s: ignoring unknown fields %s", type(self).__name__, ", ".join(unknown))
