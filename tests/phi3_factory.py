"""Tiny random Phi-3 checkpoints made with transformers' own Phi3Config / Phi3ForCausalLM (no downloads).

The LongRoPE configs exercise what they test: original length 64 and max_position_embeddings 512 (factor 8,
attention factor sqrt(1 + ln 8 / ln 64)), short and long factors far apart (so picking the wrong set changes
the logits), and Phi-4-mini's partial rotary (0.75 of head_dim 16: 12 rotated dimensions, 6 factors).
"""

from __future__ import annotations

import os
from typing import Any

import torch

ORIG = 64
TINY_PHI3 = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256, max_position_embeddings=512,
                 original_max_position_embeddings=ORIG, rms_norm_eps=1e-5, pad_token_id=0, bos_token_id=1,
                 eos_token_id=2, initializer_range=0.15)  # wide enough that a random model's greedy path varies


def longrope(partial: float = 1.0, head_dim: int = 16, rope_type: str = "longrope") -> dict[str, Any]:
    half = int(head_dim * partial) // 2
    return {"rope_type": rope_type, "rope_theta": 10000.0, "partial_rotary_factor": partial,
            "short_factor": [1.0 + 0.05 * i for i in range(half)],
            "long_factor": [1.5 + 0.9 * i for i in range(half)]}


VARIANTS: dict[str, dict[str, Any]] = {
    # Phi-4-mini-like: LongRoPE, partial rotary, tied embeddings
    "phi4mini_longrope_partial": dict(rope_parameters=longrope(0.75), tie_word_embeddings=True),
    # Phi-3.5-mini-like: LongRoPE over the whole head, untied head
    "phi35_longrope": dict(rope_parameters=longrope(1.0), tie_word_embeddings=False),
    # Phi-3-mini-4k-like: plain RoPE and a sliding window shorter than the tests' longer prompts
    "phi3_window": dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, sliding_window=96,
                        tie_word_embeddings=False),
}


def make_tiny_phi3(folder: str, variant: str, seed: int = 0, smollm2_tokenizer: bool = False,
                   **overrides: Any) -> torch.nn.Module:
    """Create, save (safetensors) and return a tiny random Phi3ForCausalLM; with `smollm2_tokenizer` its
    vocabulary is SmolLM2's and the tokenizer is saved beside it (for the HTTP server tests)."""
    import transformers

    spec = {**TINY_PHI3, **VARIANTS[variant], **overrides}
    if smollm2_tokenizer:
        spec.update(vocab_size=49152, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    config = transformers.Phi3Config(**spec)
    torch.manual_seed(seed)
    model = transformers.Phi3ForCausalLM(config).eval()
    with torch.no_grad():  # HF inits norms to 1; make them non-trivial so they are tested
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)
    os.makedirs(folder, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    if smollm2_tokenizer:
        from tests.family_models import smollm2_tokenizer  # read once per process

        smollm2_tokenizer().save_pretrained(folder)
    return model


def hf_greedy_stepwise(hf: torch.nn.Module, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs from transformers' Phi3ForCausalLM forward: the prompt in one forward,
    then one cached forward per token, each choosing LongRoPE's factors from its own sequence length (the
    model's rule). transformers.generate adds one thing to it (Phi3ForCausalLM.prepare_inputs_for_generation):
    when a sequence first grows past the original length it drops the cache and recomputes every token with the
    long factors. tokenloom does not (nor do vLLM or SGLang): its earlier keys stay as computed. For a prompt
    already past the original length, or a sequence that stays within it, the two are the same."""
    tokens: list[int] = []
    logprobs: list[float] = []
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), use_cache=True)
        for _ in range(n):
            logits = out.logits[0, -1].float()
            token = int(logits.argmax())
            tokens.append(token)
            logprobs.append(torch.log_softmax(logits, -1)[token].item())
            out = hf(torch.tensor([[token]]), cache=out.past_key_values, use_cache=True)
    return tokens, logprobs

