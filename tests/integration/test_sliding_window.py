"""Sliding-window attention against transformers float32 on the same weights: a tiny Mistral (every layer
sliding) and a tiny Qwen2 with one full and one sliding layer, window 8 (far shorter than the prompts), on both
attention backends: one-step prefill (batched and request-by-request extend), chunked prefill whose chunks
start inside and beyond the window, and decode steps (the native paged kernel's windowed index lists).
Tolerance: logits within 2e-4 of transformers' float32 and the same argmax."""

from __future__ import annotations

import pytest
import torch

from tests.forward_steps import ForwardSteps
from tests.model_factory import TINY
from tokenloom.config import ServerArgs
from tokenloom.executor.model_runner import ModelRunner

WINDOW = 8


def make_window_model(kind: str, folder: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """A random tiny Mistral (all layers sliding) or Qwen2 (layer 0 full, layer 1 sliding), saved to `folder`."""
    import transformers

    if kind == "mistral":
        config = transformers.MistralConfig(**{**TINY, "sliding_window": WINDOW, **overrides})
        cls = transformers.MistralForCausalLM
    else:
        config = transformers.Qwen2Config(**{**TINY, "use_sliding_window": True, "sliding_window": WINDOW,
                                             "max_window_layers": 1, **overrides})
        cls = transformers.Qwen2ForCausalLM
    torch.manual_seed(seed)
    model = cls(config).eval()
    model.save_pretrained(folder, safe_serialization=True)
    return model


@pytest.fixture(scope="module")
def window_models(tmp_path_factory):
    cache = {}

    def get(kind: str):
        if kind not in cache:
            folder = str(tmp_path_factory.mktemp(f"window_{kind}"))
            cache[kind] = (folder, make_window_model(kind, folder))
        return cache[kind]
    return get


def _reference(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def _close(mine: torch.Tensor, ref: torch.Tensor) -> None:
    assert (mine - ref).abs().max().item() < 2e-4
    assert torch.equal(mine.argmax(-1), ref.argmax(-1))


def test_config_parses_windows(window_models):
    from tokenloom.model_config import ModelConfig
    from tokenloom.models.loader import resolve_model_source

    for kind, want in (("mistral", (WINDOW, WINDOW)), ("qwen2", (0, WINDOW))):
        source = resolve_model_source(ServerArgs(model_path=window_models(kind)[0]))
        cfg: ModelConfig = source.config
        assert tuple(cfg.layer_window(i) for i in range(cfg.num_hidden_layers)) == want
        assert cfg.context_length == TINY["max_position_embeddings"]  # the window no longer caps the context


@pytest.mark.parametrize("backend", ["cpu", "torch_native"])
@pytest.mark.parametrize("kind", ["mistral", "qwen2"])
def test_window_forward_matches_transformers(window_models, kind, backend):
    folder, hf = window_models(kind)
    runner = ModelRunner(ServerArgs(model_path=folder, dtype="float32", max_total_tokens=2048, max_running_requests=8,
                                    attention_backend=backend))
    steps = ForwardSteps(runner)
    gen = torch.Generator().manual_seed(1)
    # one-step prefill: lengths far apart (request-by-request extend), then close together (batched extend)
    for lengths in ([37, 5, 100], [30, 33]):
        prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lengths]
        seqs = [steps.start() for _ in prompts]
        ours = torch.split(steps.extend(seqs, prompts, return_all_logits=True), lengths)
        for prompt, mine in zip(prompts, ours, strict=True):
            _close(mine, _reference(hf, prompt))
        for s in seqs:
            steps.release(s)
    # chunked prefill: chunks of two sequences together, starting inside and past the window, then decode
    full = [torch.randint(0, 256, (60,), generator=gen).tolist() for _ in range(2)]
    seqs = [steps.start(), steps.start()]
    done = [0, 0]
    for chunk in ([5, 3], [6, 9], [14, 13], [10, 30]):
        new = [full[i][done[i]: done[i] + chunk[i]] for i in range(2)]
        mine = torch.split(steps.extend(seqs, new, return_all_logits=True), chunk)
        for i in range(2):
            done[i] += chunk[i]
            _close(mine[i], _reference(hf, full[i][: done[i]])[-chunk[i]:])
    for _ in range(4):  # decode: one token each, the sequences of different lengths
        nxt = [[int(torch.randint(0, 256, (1,), generator=gen))] for _ in range(2)]
        mine = steps.extend(seqs, nxt)
        for i in range(2):
            full[i] = full[i][: done[i]] + nxt[i]
            done[i] += 1
            _close(mine[i], _reference(hf, full[i])[-1])
    for s in seqs:
        steps.release(s)
    assert runner.token_allocator.available_size() == runner.max_total_num_tokens


def test_window_bf16_within_transformers_bf16_distance(window_models):
    """The default dtype: tokenloom bf16 vs transformers float32 no further than transformers' own bf16 run
    (times 2, the two bf16 paths round differently), on a prompt 8x the window."""
    folder, hf = window_models("qwen2")
    runner = ModelRunner(ServerArgs(model_path=folder, max_total_tokens=2048, max_running_requests=8))
    prompt = torch.randint(0, 256, (64,), generator=torch.Generator().manual_seed(3)).tolist()
    steps = ForwardSteps(runner)
    seq = steps.start()
    mine = steps.extend([seq], [prompt], return_all_logits=True).float()
    ref = _reference(hf, prompt)
    import copy
    hf16 = copy.deepcopy(hf).to(torch.bfloat16)
    own = (_reference(hf16, prompt) - ref).abs().max().item()
    assert (mine - ref).abs().max().item() <= 2 * own + 1e-3
    steps.release(seq)
