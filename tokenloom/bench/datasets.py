"""Benchmark workloads: turn dataset flags into a list of `DatasetRow`s (prompt, prompt length, output length).

Datasets (SGLang's `bench_serving` names):
- `random`: text prompts of drawn lengths. The text comes from a ShareGPT file when `--dataset-path` names one
  (each first human turn is tokenized and its ids truncated or repeated to the target length, then decoded).
  Without a file it comes from a *local* corpus built from the tokenizer's own vocabulary (`VocabCorpus`):
  whole-word tokens drawn with a Zipf-like weight by vocabulary rank, with sentence punctuation. Nothing is
  ever downloaded, the corpus exists for every tokenizer, and because each word is one token that the
  tokenizer reproduces on its own, the decoded text re-tokenizes to the target length.
- `random-ids`: prompt i is the consecutive ids `(offset_i + i + j) % vocab_size`; decoded to text unless
  `--tokenize-prompt`. The reported prompt length is the target, not the server's count.
- `sharegpt`: the first two turns of each conversation of a ShareGPT-format JSON file; pairs with a prompt or
  a completion under 2 tokens (or, with `--sharegpt-context-len`, too long) are dropped; the output length is
  the completion's unless `--sharegpt-output-len`.
- `generated-shared-prefix`: `--gsp-num-groups` groups of `--gsp-prompts-per-group` prompts; each group shares
  one random system prompt, each prompt is `system + "\\n\\n" + question`; shuffled unless `--gsp-ordered`.

Lengths follow `compute_random_lens`: uniform on `[max(int(L * ratio), 1), L]`, so ratio 1 means fixed lengths
and the default 0 means anywhere in `[1, L]`. Every draw comes from a `numpy` generator seeded by `--seed`.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

DATASET_NAMES = ("random", "random-ids", "sharegpt", "generated-shared-prefix")
_WORD = re.compile(r"^ [a-z]{3,}$")


class DatasetError(ValueError):
    """Bad dataset input (missing file, wrong format, impossible lengths): reported as one line."""


@dataclass
class DatasetRow:
    """One request of the workload. `prompt` is text, or token ids with `--tokenize-prompt`."""

    prompt: str | list[int]
    prompt_len: int
    output_len: int


def compute_random_lens(full_len: int, range_ratio: float, num: int, rng: np.random.Generator) -> np.ndarray:
    """`num` lengths uniform on [max(int(full_len * range_ratio), 1), full_len] (inclusive)."""
    if full_len < 1:
        raise DatasetError(f"length must be at least 1, got {full_len}")
    if not 0.0 <= range_ratio <= 1.0:
        raise DatasetError(f"range ratio must be in [0, 1], got {range_ratio}")
    low = max(int(full_len * range_ratio), 1)
    return rng.integers(low, full_len + 1, size=num)


class VocabCorpus:
    """A local text source made of the tokenizer's whole-word tokens (see the module docstring).

    Invariant: every id in `words` decodes to " <lowercase word>" and encodes back to exactly that one id, and
    every id in `punct` is a punctuation token; so any sequence drawn here that starts with a word decodes to
    text that re-tokenizes to the same ids.
    """

    def __init__(self, tokenizer: Any) -> None:
        vocab_size = len(tokenizer)
        texts = tokenizer.batch_decode([[i] for i in range(vocab_size)])
        candidates = [i for i, t in enumerate(texts) if _WORD.match(t)]
        if not candidates:
            raise DatasetError("the tokenizer has no whole-word tokens to build the local corpus from; "
                               "pass a ShareGPT file with --dataset-path")
        encoded = tokenizer([texts[i] for i in candidates], add_special_tokens=False).input_ids
        self.words = np.array([i for i, ids in zip(candidates, encoded, strict=True) if ids == [i]], dtype=np.int64)
        if len(self.words) < 100:
            raise DatasetError(f"the tokenizer has only {len(self.words)} stable whole-word tokens; "
                               "pass a ShareGPT file with --dataset-path")
        # Lower ids are earlier merges, i.e. more frequent words: a Zipf-like weight by rank looks like text.
        weights = 1.0 / (np.arange(len(self.words)) + 20.0)
        self.weights = weights / weights.sum()
        punct = [tokenizer.convert_tokens_to_ids(t) for t in (".", ",")]
        unk = getattr(tokenizer, "unk_token_id", None)
        self.punct = [p for p in punct if isinstance(p, int) and p != unk and tokenizer.decode([p]) in (".", ",")]

    def sample_ids(self, length: int, rng: np.random.Generator) -> list[int]:
        """`length` ids of word tokens, with a '.' or ',' after about one word in eight."""
        ids = rng.choice(self.words, size=length, p=self.weights)
        if self.punct and length > 2:
            marks = rng.random(length) < 0.125
            marks[0] = False
            marks[-1] = False
            ids[marks] = rng.choice(self.punct, size=int(marks.sum()))
            # No two punctuation tokens in a row (",." could merge into one token).
            for j in np.flatnonzero(marks[1:] & marks[:-1]) + 1:
                ids[j] = self.words[0]
        return [int(i) for i in ids]


def _fit_length(ids: Sequence[int], length: int) -> list[int]:
    """Truncate or repeat `ids` to exactly `length` ids."""
    if not ids:
        raise DatasetError("cannot build a prompt from an empty text")
    reps = -(-length // len(ids))
    return (list(ids) * reps)[:length]


def load_sharegpt(path: str) -> list[tuple[str, str]]:
    """(first human turn, first answer) pairs of a ShareGPT-format JSON file (a list of
    `{"conversations": [{"from": ..., "value": ...}, ...]}`); conversations with fewer than 2 turns skipped."""
    if not path:
        raise DatasetError("--dataset-path is required for this dataset (a ShareGPT-format JSON file)")
    if not os.path.isfile(path):
        raise DatasetError(f"dataset file not found: {path}")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DatasetError(f"cannot read {path} as JSON: {e}") from None
    if not isinstance(data, list):
        raise DatasetError(f"{path}: expected a JSON list of conversations in ShareGPT format")
    pairs = []
    for item in data:
        turns = item.get("conversations", item.get("conversation")) if isinstance(item, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        first, second = turns[0], turns[1]
        if isinstance(first, dict) and isinstance(second, dict) and isinstance(first.get("value"), str) \
                and isinstance(second.get("value"), str):
            pairs.append((first["value"], second["value"]))
    if not pairs:
        raise DatasetError(f"{path}: no conversation with at least two turns (ShareGPT format: "
                           '[{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]}])')
    return pairs


def _chat_wrap(tokenizer: Any, text: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         tokenize=False)


def _count(tokenizer: Any, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def sample_random(tokenizer: Any, num: int, input_len: int, output_len: int, range_ratio: float,
                  rng: np.random.Generator, dataset_path: str = "", apply_chat_template: bool = False,
                  tokenize_prompt: bool = False) -> list[DatasetRow]:
    """The `random` dataset: text of drawn lengths from a ShareGPT file or the local vocabulary corpus."""
    special = tokenizer.num_special_tokens_to_add()
    input_lens = compute_random_lens(input_len, range_ratio, num, rng)
    output_lens = compute_random_lens(output_len, range_ratio, num, rng)
    sources: list[list[int]] = []
    if dataset_path:
        prompts = [p for p, _ in load_sharegpt(dataset_path)]
        order = rng.permutation(len(prompts))
        for k in order:
            ids = tokenizer.encode(prompts[k], add_special_tokens=False)
            if ids:
                sources.append(ids)
            if len(sources) == num:
                break
        if not sources:
            raise DatasetError(f"{dataset_path}: every prompt is empty")
    corpus = None if dataset_path else VocabCorpus(tokenizer)
    rows = []
    for i in range(num):
        target = max(int(input_lens[i]) - special, 1)
        ids = corpus.sample_ids(target, rng) if corpus else _fit_length(sources[i % len(sources)], target)
        rows.append(_text_row(tokenizer, ids, int(input_lens[i]), int(output_lens[i]), apply_chat_template,
                              tokenize_prompt))
    return rows


def _text_row(tokenizer: Any, ids: list[int], prompt_len: int, output_len: int, apply_chat_template: bool,
              tokenize_prompt: bool) -> DatasetRow:
    if tokenize_prompt:
        return DatasetRow(ids, len(ids), output_len)
    text = tokenizer.decode(ids)
    if apply_chat_template:
        text = _chat_wrap(tokenizer, text)
        prompt_len = _count(tokenizer, text)
    return DatasetRow(text, prompt_len, output_len)


def sample_random_ids(tokenizer: Any, num: int, input_len: int, output_len: int, range_ratio: float,
                      rng: np.random.Generator, apply_chat_template: bool = False,
                      tokenize_prompt: bool = False) -> list[DatasetRow]:
    """The `random-ids` dataset: consecutive token ids from a random offset; no data needed."""
    vocab = tokenizer.vocab_size
    input_lens = compute_random_lens(input_len, range_ratio, num, rng)
    output_lens = compute_random_lens(output_len, range_ratio, num, rng)
    offsets = rng.integers(0, vocab, size=num)
    rows = []
    for i in range(num):
        length = int(input_lens[i])
        ids = [int((offsets[i] + i + j) % vocab) for j in range(length)]
        rows.append(_text_row(tokenizer, ids, length, int(output_lens[i]), apply_chat_template, tokenize_prompt))
    return rows


def sample_sharegpt(tokenizer: Any, num: int, dataset_path: str, rng: np.random.Generator,
                    fixed_output_len: int | None = None, context_len: int | None = None,
                    apply_chat_template: bool = False, tokenize_prompt: bool = False) -> list[DatasetRow]:
    """The `sharegpt` dataset: first two turns of shuffled conversations, filtered as SGLang does."""
    if fixed_output_len is not None and fixed_output_len < 1:
        raise DatasetError(f"--sharegpt-output-len must be at least 1, got {fixed_output_len}")
    pairs = load_sharegpt(dataset_path)
    rows: list[DatasetRow] = []
    for k in rng.permutation(len(pairs)):
        if len(rows) == num:
            break
        prompt, completion = pairs[k]
        if apply_chat_template:
            prompt = _chat_wrap(tokenizer, prompt)
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
        completion_len = _count(tokenizer, completion)
        output_len = fixed_output_len if fixed_output_len is not None else completion_len
        if len(prompt_ids) < 2 or completion_len < 2:
            continue
        if context_len is not None and len(prompt_ids) + output_len > context_len:
            continue
        rows.append(DatasetRow(prompt_ids if tokenize_prompt else prompt, len(prompt_ids), output_len))
    if len(rows) < num:
        raise DatasetError(f"{dataset_path}: only {len(rows)} usable conversations, {num} prompts requested")
    return rows


def sample_generated_shared_prefix(tokenizer: Any, num_groups: int, prompts_per_group: int, system_prompt_len: int,
                                   question_len: int, output_len: int, range_ratio: float,
                                   rng: np.random.Generator, ordered: bool = False,
                                   fast_prepare: bool = False) -> list[DatasetRow]:
    """The `generated-shared-prefix` dataset: groups of prompts sharing one system prompt."""
    if num_groups < 1 or prompts_per_group < 1:
        raise DatasetError("--gsp-num-groups and --gsp-prompts-per-group must be at least 1")
    corpus = VocabCorpus(tokenizer)
    total = num_groups * prompts_per_group
    sys_lens = compute_random_lens(system_prompt_len, range_ratio, num_groups, rng)
    q_lens = compute_random_lens(question_len, range_ratio, total, rng)
    out_lens = compute_random_lens(output_len, range_ratio, total, rng)
    rows = []
    for g in range(num_groups):
        system = tokenizer.decode(corpus.sample_ids(int(sys_lens[g]), rng))
        for p in range(prompts_per_group):
            k = g * prompts_per_group + p
            question = tokenizer.decode(corpus.sample_ids(int(q_lens[k]), rng))
            prompt = f"{system}\n\n{question}"
            prompt_len = int(sys_lens[g]) + int(q_lens[k]) if fast_prepare else _count(tokenizer, prompt)
            rows.append(DatasetRow(prompt, prompt_len, int(out_lens[k])))
    if not ordered:
        rows = [rows[k] for k in rng.permutation(len(rows))]
    return rows


def build_dataset(args: Any, tokenizer: Any) -> list[DatasetRow]:
    """The rows for the parsed bench_serving flags (`args` as built by `bench_serving.build_parser`)."""
    rng = np.random.default_rng(args.seed)
    name = args.dataset_name
    tokenize = bool(getattr(args, "tokenize_prompt", False))
    if name == "random":
        return sample_random(tokenizer, args.num_prompts, args.random_input_len, args.random_output_len,
                             args.random_range_ratio, rng, args.dataset_path, args.apply_chat_template, tokenize)
    if name == "random-ids":
        return sample_random_ids(tokenizer, args.num_prompts, args.random_input_len, args.random_output_len,
                                 args.random_range_ratio, rng, args.apply_chat_template, tokenize)
    if name == "sharegpt":
        return sample_sharegpt(tokenizer, args.num_prompts, args.dataset_path, rng, args.sharegpt_output_len,
                               args.sharegpt_context_len, args.apply_chat_template, tokenize)
    if name == "generated-shared-prefix":
        return sample_generated_shared_prefix(
            tokenizer, args.gsp_num_groups, args.gsp_prompts_per_group, args.gsp_system_prompt_len,
            args.gsp_question_len, args.gsp_output_len, args.gsp_range_ratio, rng, args.gsp_ordered,
            args.gsp_fast_prepare)
    raise DatasetError(f"unknown dataset {name!r} (choose from {', '.join(DATASET_NAMES)})")
