"""Constrained decoding pieces on their own: the packed token mask (against a bit-by-bit reference), the sampler
under a mask in every mode (never a disallowed token; logprobs those of the masked distribution), grammar specs
and the OpenAI/vLLM aliases, the compile cache, and real backend matchers walked token by token against
Python's `re`."""

from __future__ import annotations

import json
import re
import time

import pytest
import torch

from tokenloom.entrypoints.openai.protocol import CompletionRequest
from tokenloom.entrypoints.openai.serving_base import grammar_params
from tokenloom.grammar.compiler import GrammarCompiler
from tokenloom.grammar.mask import allocate_bitmask, allowed_tokens, apply_bitmask
from tokenloom.grammar.spec import GrammarError, GrammarSpec, spec_from_params, validate_spec
from tokenloom.kernels import cpu_ops
from tokenloom.layers.sampler import Sampler, apply_grammar_mask
from tokenloom.sampling.sampling_batch import SamplingBatchInfo
from tokenloom.sampling.sampling_params import SamplingParams

VOCAB = 200  # not a multiple of 32: the last word is partial


def _random_bitmask(rows: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    words = (vocab + 31) // 32
    bits = torch.randint(0, 2, (rows, words * 32), generator=g, dtype=torch.int64)
    bits[:, 3] = 1  # every row allows something
    bits[0, :32] = 1  # a full word
    weights = (1 << torch.arange(32, dtype=torch.int64))
    packed = (bits.view(rows, words, 32) * weights).sum(-1)
    return (packed - (packed >= 2**31).long() * 2**32).to(torch.int32)


def _reference_allowed(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    out = torch.zeros(bitmask.shape[0], vocab, dtype=torch.bool)
    for r in range(bitmask.shape[0]):
        for t in range(vocab):
            w = t // 32
            out[r, t] = w < bitmask.shape[1] and bool((int(bitmask[r, w]) >> (t % 32)) & 1)
    return out


@pytest.mark.parametrize("apply", [apply_grammar_mask, apply_bitmask], ids=["native", "torch"])
@pytest.mark.parametrize("width", [VOCAB, VOCAB + 40, VOCAB - 7])  # logits wider / narrower than the grammar's
def test_mask_matches_a_bit_by_bit_reference_torch_and_native(width, apply):
    if apply is apply_grammar_mask:
        assert cpu_ops.available(torch.zeros(1)), "the native kernels must build on this machine"
    mask = _random_bitmask(3, VOCAB, seed=1)
    expected = _reference_allowed(mask, width)
    assert torch.equal(allowed_tokens(mask, width), expected)
    logits = torch.randn(5, width)
    rows = torch.tensor([4, 0, 2])
    out = logits.clone()
    apply(out, mask, rows)
    want = logits.clone()
    for i, r in enumerate(rows.tolist()):
        want[r][~expected[i]] = float("-inf")
    assert torch.equal(out, want)
    full = logits[:3].clone()
    apply(full, mask)  # every row, in order: in place
    assert torch.equal(full, torch.where(expected, logits[:3], torch.tensor(float("-inf"))))
    strided = torch.randn(3, width + 9)[:, :width]  # rows at a stride wider than the row
    want = torch.where(expected, strided, torch.tensor(float("-inf")))
    apply(strided, mask)
    assert torch.equal(strided, want)


def test_native_mask_refuses_rows_outside_the_logits():
    mask = _random_bitmask(2, VOCAB, seed=2)
    with pytest.raises(IndexError):
        apply_grammar_mask(torch.randn(3, VOCAB), mask, torch.tensor([0, 3]))


def _info(params: list[SamplingParams], mask: torch.Tensor, rows: list[int], **kw) -> SamplingBatchInfo:
    info = SamplingBatchInfo.from_requests(params, [[1, 2, 3]] * len(params), [[5, 6]] * len(params), VOCAB, [0],
                                           torch.device("cpu"), **kw)
    info.grammar_bitmask, info.grammar_rows = mask, torch.tensor(rows)
    return info


MODES = {
    "greedy": dict(temperature=0),
    "temperature": dict(temperature=1.3),
    "top_k_top_p_min_p": dict(temperature=0.9, top_k=5, top_p=0.8, min_p=0.05),
    "penalties_bias": dict(temperature=1.0, frequency_penalty=1.5, presence_penalty=0.5, repetition_penalty=1.5,
                           logit_bias={"5": 100.0, "7": 50.0}),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_sampler_never_picks_a_disallowed_token_and_reports_masked_logprobs(mode):
    mask = _random_bitmask(2, VOCAB, seed=2)
    allowed = _reference_allowed(mask, VOCAB)
    params = [SamplingParams.from_dict({**MODES[mode], "sampling_seed": s}, VOCAB) for s in range(3)]
    sampler = Sampler(seed=0)
    for step in range(60):
        logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(step)) * 4
        raw = logits.clone()
        info = _info(params, mask, [0, 2], return_logprob=True, top_logprobs_num=3)
        info.output_lens = info.output_lens + step  # a new seeded draw per step
        out = sampler(logits, info)
        ids = out.next_token_ids.tolist()
        assert allowed[0, ids[0]] and allowed[1, ids[2]], (mode, step, ids)
        masked = raw.clone()
        masked[0][~allowed[0]] = float("-inf")
        masked[2][~allowed[1]] = float("-inf")
        ref = torch.log_softmax(masked, dim=-1)
        expect = ref.gather(1, out.next_token_ids[:, None]).squeeze(1)
        torch.testing.assert_close(out.next_token_logprobs, expect, rtol=0, atol=1e-5)
        assert bool(torch.isinf(ref[0][~allowed[0]]).all())
        assert all(allowed[0, t] for t in out.top_logprob_ids[0].tolist() if ref[0, t] > float("-inf"))


def test_specs_and_aliases():
    assert spec_from_params(None, None, None, None) is None
    assert spec_from_params('{"type": "object"}', None, None, None) == GrammarSpec("json_object", '{"type": "object"}')
    with pytest.raises(GrammarError, match="only one of"):
        spec_from_params("{}", "a", None, None)
    legacy = {"type": "structural_tag", "structures": [{"begin": "<f>", "schema": {"type": "object"}, "end": "</f>"}],
              "triggers": ["<f>"]}
    spec = spec_from_params(None, None, None, json.dumps(legacy))
    assert json.loads(spec.text)["format"]["type"] == "triggered_tags"
    validate_spec(spec)
    for bad, message in [(GrammarSpec("json_schema", '{"type": "strin"}'), 'Unsupported type "strin"'),
                         (GrammarSpec("regex", "a("), "parenthesis is not closed"),
                         (GrammarSpec("ebnf", 'foo ::= "a"'), 'root rule with name "root" is not found')]:
        with pytest.raises(GrammarError, match=re.escape(message)):
            validate_spec(bad)

    def params(**body):
        return grammar_params(CompletionRequest(prompt="x", **body))

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert params(response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}) == \
        {"json_schema": json.dumps(schema)}
    assert params(response_format={"type": "json_object"}) == {"json_schema": '{"type": "object"}'}
    assert params(response_format={"type": "text"}) == {}
    assert params(guided_json=schema) == {"json_schema": json.dumps(schema)}
    assert params(guided_regex="a+") == {"regex": "a+"}
    assert params(guided_grammar='root ::= "a"') == {"ebnf": 'root ::= "a"'}
    choice = params(guided_choice=["a.b", "c d", "(x)"])["regex"]
    assert all(re.fullmatch(choice, c) for c in ["a.b", "c d", "(x)"]) and not re.fullmatch(choice, "axb")
    with pytest.raises(ValueError, match="only one structured-output constraint"):
        params(guided_regex="a", regex="b")


class _CountingBackend:
    name = "fake"

    def __init__(self):
        self.compiles = 0

    def compile(self, spec):
        self.compiles += 1
        if spec.text == "bad":
            raise GrammarError("invalid regex: bad")
        return ("compiled", spec)

    def new_matcher(self, compiled):
        return compiled


def test_compile_cache_shares_one_compile_per_spec_including_failures():
    backend = _CountingBackend()
    compiler = GrammarCompiler(lambda: backend)
    try:
        a, b = compiler.submit(GrammarSpec("regex", "a+")), compiler.submit(GrammarSpec("regex", "a+"))
        assert a.result(5) == ("compiled", GrammarSpec("regex", "a+")) and b.result(5) == a.result(5)
        bad1, bad2 = compiler.submit(GrammarSpec("regex", "bad")), compiler.submit(GrammarSpec("regex", "bad"))
        assert isinstance(bad1.exception(5), GrammarError) and bad2.exception(5) is bad1.exception(5)
        assert backend.compiles == 2 and compiler.hits == 2 and compiler.misses == 2
    finally:
        compiler.shutdown()


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from tokenloom.config import ServerArgs
    from tokenloom.models.loader import resolve_model_source
    from tokenloom.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model_source(ServerArgs()))


@pytest.mark.parametrize("backend_name", ["xgrammar", "llguidance", "outlines"])
def test_backend_matcher_walk_matches_python_re(backend_name, smollm2_tokenizer):
    from tokenloom.grammar.backends import make_backend

    vocab, eos = 49152, 2
    backend = make_backend(backend_name, smollm2_tokenizer, vocab, (eos,))
    regex = r"(ab|cd)[0-9]{2}x?"
    matcher = backend.new_matcher(backend.compile(GrammarSpec("regex", regex)))
    g = torch.Generator().manual_seed(0)
    text, ids = "", []
    for _ in range(20):
        mask = allocate_bitmask(1, vocab)
        matcher.fill(mask, 0)
        allowed = allowed_tokens(mask, vocab)[0].nonzero().flatten()
        assert allowed.numel() > 0
        token = int(allowed[torch.randint(allowed.numel(), (1,), generator=g)])
        if token == eos:
            assert re.fullmatch(regex, text), text  # EOS only where the language may end
            assert matcher.accept(token) and matcher.is_terminated()
            break
        ids.append(token)
        text = smollm2_tokenizer.decode(ids)
        assert any(re.fullmatch(regex, text + tail) for tail in ("", "0", "00", "x", "0x", "00x", "b00", "d00",
                                                                 "b0", "d0", "bx", "dx", "b00x", "d00x")), text
        assert matcher.accept(token)
    else:
        pytest.fail(f"no EOS after {text!r}")
    if backend_name != "llguidance":
        with pytest.raises(GrammarError, match="invalid regex"):
            backend.compile(GrammarSpec("regex", "a("))


def test_grammar_compile_timeout_ends_only_the_slow_request():
    """--grammar-compile-timeout: a grammar still compiling past its deadline fails its request with the flag
    named; a request whose grammar is ready is unaffected and the queue keeps working."""
    import threading
    from types import SimpleNamespace

    from tokenloom.config import ServerArgs
    from tokenloom.scheduler.grammar_queue import GrammarQueue

    release = threading.Event()

    class SlowBackend:
        def compile(self, spec):
            if spec.text == "slow":
                release.wait(5)
            return spec.text

        def new_matcher(self, compiled):
            return compiled

    timeout = ServerArgs(grammar_compile_timeout=0.2).grammar_compile_timeout
    queue = GrammarQueue(SlowBackend, timeout)
    slow, fast = SimpleNamespace(rid="slow", grammar=None), SimpleNamespace(rid="fast", grammar=None)
    queue.add(fast, GrammarSpec("regex", "fast"))
    queue.add(slow, GrammarSpec("regex", "slow"))
    ready, failed, deadline = [], [], time.monotonic() + 5
    while len(queue) and time.monotonic() < deadline:
        r, f = queue.poll(idle=True)
        ready += r
        failed += f
    release.set()
    assert [r.rid for r in ready] == ["fast"] and fast.grammar == "fast"
    assert [(r.rid, "--grammar-compile-timeout" in why, status) for r, why, status in failed] == [("slow", True, 400)]


@pytest.mark.parametrize("backend, body, message", [
    ("none", {"json_schema": '{"type": "object"}'}, "--grammar-backend none"),
    ("llguidance", {"structural_tag": '{"type": "structural_tag", "format": {"type": "const_string", '
                                      '"value": "x"}}'}, "structural_tag needs --grammar-backend xgrammar"),
    ("outlines", {"ebnf": 'root ::= "a"'}, "ebnf needs --grammar-backend xgrammar or llguidance"),
])
def test_grammar_backend_flag_decides_what_is_accepted(backend, body, message):
    from types import SimpleNamespace

    from tokenloom.config import ServerArgs
    from tokenloom.frontend.tokenizer_manager import TokenizerManager
    from tokenloom.sampling.sampling_params import SamplingParams

    args = ServerArgs(grammar_backend=backend)
    stub = SimpleNamespace(args=args, _valid_grammars={})
    with pytest.raises(ValueError, match=message):
        TokenizerManager._check_grammar(stub, SamplingParams(**body))


def test_outlines_gets_bounded_integers_as_enums_and_refuses_bounds_it_cannot_spell():
    from tokenloom.grammar.outlines_backend import bounded_integers_as_enums

    schema = {"type": "object", "properties": {
        "age": {"type": "integer", "minimum": 0, "maximum": 4, "description": "kept"},
        "odd": {"anyOf": [{"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 8, "multipleOf": 3}]}}}
    out = bounded_integers_as_enums(schema)
    assert out["properties"]["age"] == {"enum": [0, 1, 2, 3, 4], "description": "kept"}
    assert out["properties"]["odd"]["anyOf"][0] == {"enum": [3, 6]}
    for bad, where in (({"type": "number", "maximum": 1.5}, "schema"),
                       ({"type": "integer", "minimum": 0}, "schema"),
                       ({"items": {"type": "integer", "minimum": 0, "maximum": 10**6}}, r"schema\.items")):
        with pytest.raises(GrammarError, match=f"outlines cannot enforce .* at {where}"):
            bounded_integers_as_enums(bad)
