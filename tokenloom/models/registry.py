"""Architecture name -> model class. Llama, Mistral and Qwen2 share one implementation; their
differences (QKV bias, tied embeddings, sliding window) come from the config."""

from __future__ import annotations

from tokenloom.model_config import SUPPORTED_ARCHITECTURES, ModelConfigError
from tokenloom.models.llama import LlamaForCausalLM

_MODELS = {name: LlamaForCausalLM for name in SUPPORTED_ARCHITECTURES}


def model_class_for(architecture: str) -> type[LlamaForCausalLM]:
    try:
        return _MODELS[architecture]
    except KeyError:
        raise ModelConfigError(f"unknown architecture {architecture!r}; supported: {', '.join(_MODELS)}") from None
