"""Running the same computation at several torch thread counts (the native kernels take torch's count)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


def at_thread_counts(compute: Callable[[], Any], counts: Iterable[int]) -> dict[int, Any]:
    """`compute()`'s result at each thread count in `counts`; torch's own count is restored afterwards."""
    before = torch.get_num_threads()
    results: dict[int, Any] = {}
    try:
        for count in counts:
            torch.set_num_threads(count)
            results[count] = compute()
    finally:
        torch.set_num_threads(before)
    return results
