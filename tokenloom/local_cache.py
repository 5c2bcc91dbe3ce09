"""Where tokenloom keeps files it derives on this machine (built kernels, tokenizers extracted from GGUF):
`$TOKENLOOM_CACHE_DIR`, default `~/.cache/tokenloom`. Imports nothing from tokenloom, so any module may use it."""

from __future__ import annotations

import os


def cache_dir() -> str:
    return os.environ.get("TOKENLOOM_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "tokenloom"))
