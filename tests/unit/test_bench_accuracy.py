"""`bench/accuracy.py`'s pure helpers: chunking the corpus, perplexity from a server's prompt logprobs (checked
against torch's cross-entropy on the same logits), greedy agreement, and the per-type targets (the default
file's layer type read from the file, checked against the gguf package's own tensor list)."""

from __future__ import annotations

import math

import pytest
import torch

from bench import accuracy


def test_chunk_tokens_contiguous_and_bounded():
    ids = list(range(100))
    chunks = accuracy.chunk_tokens(ids, 3, 10, shift=5)
    assert chunks == [list(range(5, 15)), list(range(15, 25)), list(range(25, 35))]
    assert accuracy.chunk_tokens(ids, 10, 10) == [ids[i:i + 10] for i in range(0, 100, 10)]  # exactly all
    with pytest.raises(ValueError, match="100 tokens: too few for 10 chunks of 10 from token 1"):
        accuracy.chunk_tokens(ids, 10, 10, shift=1)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        accuracy.chunk_tokens(ids, 3, 1)


def test_perplexity_from_prompt_logprobs_matches_cross_entropy():
    torch.manual_seed(0)
    window = torch.randint(0, 50, (20,))
    logits = torch.randn(20, 50, dtype=torch.float64)
    logprobs = logits.log_softmax(-1)
    # the server's shape: position 0 has no logprob; position i is log p(token i | tokens < i)
    entries = [[None, int(window[0]), "t"]] + [[float(logprobs[i - 1, window[i]]), int(window[i]), "t"]
                                               for i in range(1, 20)]
    nlls = accuracy.nlls_from_prompt_logprobs(entries, window.tolist())
    expected = torch.nn.functional.cross_entropy(logits[:-1], window[1:])
    assert accuracy.perplexity(nlls) == pytest.approx(math.exp(float(expected)), rel=1e-12)


def test_prompt_logprobs_mismatches_are_errors():
    window = [5, 6, 7]
    good = [[None, 5, ""], [-1.0, 6, ""], [-0.5, 7, ""]]
    assert accuracy.nlls_from_prompt_logprobs(good, window) == [1.0, 0.5]
    with pytest.raises(ValueError, match="2 entries for a 3-token prompt"):
        accuracy.nlls_from_prompt_logprobs(good[:2], window)
    with pytest.raises(ValueError, match="other tokens"):
        accuracy.nlls_from_prompt_logprobs(good, [5, 6, 8])
    with pytest.raises(ValueError, match="first position has a logprob"):
        accuracy.nlls_from_prompt_logprobs([[-0.1, 5, ""], *good[1:]], window)
    with pytest.raises(ValueError, match=r"positions \[2\]"):
        accuracy.nlls_from_prompt_logprobs([*good[:2], [0.5, 7, ""]], window)
    with pytest.raises(ValueError, match="no tokens"):
        accuracy.perplexity([])


def test_greedy_agreement():
    prefix, equal = accuracy.greedy_agreement([[1, 2, 3, 4], [1, 9, 3, 4]], [[1, 2, 3, 4], [1, 2, 3, 4]])
    assert (prefix, equal) == (pytest.approx((1 + 0.25) / 2), 0.5)  # a diverged continuation stays diverged


def test_targets_by_layer_type():
    types = {"token_embd.weight": ("Q8_0", 1000), "blk.0.attn_norm.weight": ("F32", 10),
             "blk.0.ffn_down.weight": ("Q6_K", 300), "blk.0.ffn_up.weight": ("Q4_K", 600)}
    assert accuracy.dominant_type(types) == "Q4_K"  # the embedding and norms do not count
    assert accuracy.ppl_target("Q4_K") == 0.01 and accuracy.ppl_target("Q4_1") == 0.01
    assert accuracy.ppl_target("Q8_0") == 0.005 and accuracy.ppl_target("BF16") == 0.005
    with pytest.raises(ValueError, match="no layer weight matrices"):
        accuracy.dominant_type({"token_embd.weight": ("Q8_0", 1)})


def test_default_file_info():
    import gguf

    from tokenloom.models.default_model import default_model_file

    path = default_model_file()
    info = accuracy.gguf_info(path)
    layer_types = {t.tensor_type.name for t in gguf.GGUFReader(path).tensors
                   if t.name.startswith("blk.") and len(t.shape) == 2}
    assert layer_types == {"Q4_1"} and info["weight_type"] == "Q4_1"
    assert info["file_type"] == "Q4_1" and info["context_length"] == 8192
