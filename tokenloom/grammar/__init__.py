"""Constrained decoding: grammars (JSON schema, regex, EBNF, structural tag) compiled against the model's
vocabulary into per-request matchers whose token masks the sampler applies.

- spec.py: which grammar a request asks for (`GrammarSpec`), checked without a vocabulary (cheap, for 400s);
- backends.py: the backends behind `--grammar-backend` (xgrammar, llguidance), one interface;
- compiler.py: compilation off the scheduler's critical path (a worker thread) with a cache keyed by the spec;
- mask.py: a batch's packed token bitmask and its application to logits.
"""
