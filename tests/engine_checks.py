"""Checks shared by the in-process Engine tests."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

import pytest

from tokenloom.frontend.tokenizer_manager import EngineDeadError


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


def assert_killed_rank_fails_everything(eng: Any, key: str, named: str, delay_s: float = 0.5,
                                        bound_s: float = 30) -> None:
    """SIGKILL the engine's child `key` (e.g. "scheduler1") while a long request runs: the request fails with
    an EngineDeadError matching `named` (a regex) within `bound_s`, a new request is refused the same way,
    and every child process ends."""
    procs = eng.tokenizer_manager.processes

    async def scenario() -> float:
        task = asyncio.ensure_future(eng.async_generate("hello", {"max_new_tokens": 1500, "ignore_eos": True}))
        await asyncio.sleep(delay_s)
        os.kill(procs[key].pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match=named):
            await asyncio.wait_for(task, timeout=bound_s)
        return time.monotonic() - start

    assert asyncio.run(scenario()) < bound_s
    with pytest.raises(EngineDeadError, match=named):
        eng.generate("again")
    deadline = time.monotonic() + 20
    while any(p.is_alive() for p in procs.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(p.is_alive() for p in procs.values())


async def abort_mid_flight(eng: Any, others: list[str], params: list[dict]) -> list[list[int]]:
    """Stream a long request and abort it after three chunks while `others` (with `params`) run beside it:
    it ends with an abort finish reason; returns the others' output ids."""
    stream = await eng.async_generate("a request to abort " * 4, {"max_new_tokens": 1500, "ignore_eos": True},
                                      rid="abort-me", stream=True)
    rest = asyncio.ensure_future(eng.async_generate(others, params))
    chunks, last = 0, None
    async for item in stream:
        chunks, last = chunks + 1, item
        if chunks == 3:
            eng.abort("abort-me")
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(last["output_ids"]) < 1500
    return [o["output_ids"] for o in await rest]
