"""`inference`: `torch.inference_mode()` as a decorator that costs one flag read when the calling thread is in
inference mode already.

Why: a decode step's Python side calls half a dozen decorated methods (execute, forward, sample, the runner's
prepare / forward / sample), nested; torch's decorator builds and enters a new context object on every call
(~5 us each warm, several times that right after the step has streamed the weights through the caches).
Outside inference mode (tests, benchmarks, a first call) it enters `torch.inference_mode()` as before.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import torch

F = TypeVar("F", bound=Callable)


def inference(fn: F) -> F:
    """`fn` run under `torch.inference_mode()`, entered only when this thread is not in it already."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if torch.is_inference_mode_enabled():
            return fn(*args, **kwargs)
        with torch.inference_mode():
            return fn(*args, **kwargs)

    return run  # type: ignore[return-value]
