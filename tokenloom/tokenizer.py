"""Tokenizer, chat template and generation defaults through `transformers`.

From a Hugging Face folder the tokenizer loads directly. From a GGUF file transformers rebuilds it from the
metadata, which takes seconds; the result is saved under the cache folder (`$TOKENLOOM_CACHE_DIR`, default
~/.cache/tokenloom) keyed by the file's path, size and mtime, so later loads are fast.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
from typing import Any

from tokenloom.local_cache import cache_dir
from tokenloom.models.gguf_file import gc_paused
from tokenloom.models.loader import ModelSource


def load_tokenizer(source: ModelSource, tokenizer_path: str | None = None) -> Any:
    from transformers import AutoTokenizer

    if tokenizer_path:
        folder = os.path.expanduser(tokenizer_path)
        if not os.path.isdir(folder):  # else transformers would take it for a Hub id and try to download it
            raise ValueError(f"--tokenizer-path {tokenizer_path!r} is not a folder (a local tokenizer folder is "
                             "needed; nothing is downloaded)")
        return AutoTokenizer.from_pretrained(folder)
    if source.kind == "hf":
        return AutoTokenizer.from_pretrained(source.path)
    st = os.stat(source.path)
    key = hashlib.sha1(f"{os.path.abspath(source.path)}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    cached = os.path.join(cache_dir(), "tokenizers", key)
    if os.path.exists(os.path.join(cached, "tokenizer_config.json")):
        return AutoTokenizer.from_pretrained(cached)
    with gc_paused():  # transformers parses the GGUF's vocabulary with the gguf package's reader
        tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(source.path),
                                                  gguf_file=os.path.basename(source.path))
    tmp = f"{cached}.tmp{os.getpid()}"
    tokenizer.save_pretrained(tmp)
    os.makedirs(os.path.dirname(cached), exist_ok=True)
    with contextlib.suppress(OSError):  # another process won the race; its copy is identical
        os.replace(tmp, cached)
    return tokenizer


class TokenizerLoad:
    """`load_tokenizer` on a thread of its own, started at construction (the server loads its tokenizer while its
    scheduler and detokenizer processes start); `result()` waits and returns the tokenizer or raises what loading
    raised."""

    def __init__(self, source: ModelSource, tokenizer_path: str | None = None) -> None:
        self._outcome: list[Any] = []
        self._thread = threading.Thread(target=self._load, args=(source, tokenizer_path),
                                        name="tokenloom-tokenizer-load", daemon=True)
        self._thread.start()

    def _load(self, source: ModelSource, tokenizer_path: str | None) -> None:
        try:
            self._outcome.append(load_tokenizer(source, tokenizer_path))
        except BaseException as e:  # noqa: BLE001 - handed to result()'s caller
            self._outcome.append(e)

    def result(self) -> Any:
        self._thread.join()
        (outcome,) = self._outcome
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome


def generation_defaults(source: ModelSource) -> dict[str, Any]:
    """The model's preferred sampling defaults (generation_config.json), as sampling-param keys."""
    if source.kind != "hf":
        return {}
    path = os.path.join(source.path, "generation_config.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        raw = json.load(f)
    keys = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
    return {k: raw[k] for k in keys if k in raw}


def eos_token_ids(source: ModelSource, tokenizer: Any) -> tuple[int, ...]:
    """EOS ids: the config's, the generation config's, and the tokenizer's, deduplicated."""
    ids = list(source.config.eos_token_ids)
    if source.kind == "hf":
        path = os.path.join(source.path, "generation_config.json")
        if os.path.exists(path):
            with open(path) as f:
                eos = json.load(f).get("eos_token_id")
            ids += eos if isinstance(eos, list) else ([eos] if eos is not None else [])
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.append(tokenizer.eos_token_id)
    return tuple(dict.fromkeys(int(i) for i in ids))


def longest_token_chars(tokenizer: Any) -> int:
    """The most characters one token of `tokenizer` can stand for: the longest vocabulary entry (byte-level
    BPE spells each byte as one character and SentencePiece each character as one, so an entry is never shorter
    than the text it decodes to). A text of c characters therefore has at least c / this many tokens, which
    lets an overlong prompt be refused before it is tokenized."""
    vocab = tokenizer.get_vocab()
    added = getattr(tokenizer, "get_added_vocab", dict)()
    return max(1, *(len(token) for token in vocab), *(len(token) for token in added))


def read_chat_template(path: str) -> str:
    """The Jinja chat template in the file at `path` (--chat-template), checked to parse so that a broken
    template stops the server at start, naming the file, instead of failing every chat request."""
    import jinja2

    with open(os.path.expanduser(path), encoding="utf-8") as f:
        text = f.read()
    try:
        jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"--chat-template {path}: line {e.lineno}: {e.message}") from None
    return text
