"""Checks shared by the in-process Engine tests."""

from __future__ import annotations

import time
from typing import Any


def wait_idle_pools_full(eng: Any, timeout_s: float = 10) -> dict[str, Any]:
    """Wait until the engine has no running or waiting request, then assert every KV slot is back (free or
    evictable in the prefix cache); returns the last server info."""
    deadline = time.monotonic() + timeout_s
    while True:
        info = eng.get_server_info()
        if info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0:
            break
        assert time.monotonic() < deadline, info
        time.sleep(0.05)
    assert info["kv_tokens_in_use"] == 0
    assert info["available_kv_tokens"] + info["evictable_kv_tokens"] == info["max_total_num_tokens"]
    return info
