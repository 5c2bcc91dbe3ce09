"""Architecture name -> model class. Each family's module registers its class here; Llama, Mistral and
Qwen2 share one implementation, their differences (QKV bias, tied embeddings) coming from the config."""

from __future__ import annotations

from torch import nn

from tokenloom.model_config import ModelConfigError
from tokenloom.models.gemma import GemmaForCausalLM
from tokenloom.models.llama import LlamaForCausalLM
from tokenloom.models.moe_decoder import MoEForCausalLM
from tokenloom.models.phi3 import Phi3ForCausalLM
from tokenloom.models.qwen3 import Qwen3ForCausalLM
from tokenloom.models.smollm3 import SmolLM3ForCausalLM

_MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "SmolLM3ForCausalLM": SmolLM3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Qwen3MoeForCausalLM": MoEForCausalLM,
    "Qwen2MoeForCausalLM": MoEForCausalLM,
    "MixtralForCausalLM": MoEForCausalLM,
    "OlmoeForCausalLM": MoEForCausalLM,
}


def model_class_for(architecture: str) -> type[nn.Module]:
    try:
        return _MODELS[architecture]
    except KeyError:
        raise ModelConfigError(f"unknown architecture {architecture!r}; supported: {', '.join(_MODELS)}") from None
