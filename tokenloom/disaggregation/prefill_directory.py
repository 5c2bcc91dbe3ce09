"""`PrefillDirectory`: what a decode server's entry rank knows of the prefill servers it takes KV from —
each one's layout (its bootstrap service's answer: every rank's control address, engine descriptor, KV layout,
layer and head range) and whether this decode server can take KV from it at all.

Freshness: a new room looks its prefill server up again unless the answer is under `PREFILL_INFO_FRESH_S`
old (a burst of rooms shares one lookup; a prefill server restarted on the same port is found by the next
room); other uses (telling a prefill entry about an abort) accept `PREFILL_INFO_TTL_S`. A prefill server
that missed heartbeats or failed a room is forgotten. Thread-safe (the agent's fetch threads use it).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from tokenloom.cache.kv_layout import KVLayout
from tokenloom.cache.pool_layout import PoolLayout
from tokenloom.disaggregation.bootstrap_server import fetch_parallel_info
from tokenloom.disaggregation.pairing import RankKV, writers_for

PREFILL_INFO_FRESH_S = 1.0
PREFILL_INFO_TTL_S = 30.0


class PrefillDirectory:
    def __init__(self, page_size: int, kv_dtype: str, backend: str, world: list[RankKV], layout: KVLayout | PoolLayout,
                 fetch_deadline_s: float) -> None:
        """This decode server's page size, KV dtype, transfer backend, ranks and KV layout (what a prefill
        server must match); `fetch_deadline_s`: how long a lookup keeps trying a prefill server not ready yet."""
        self.page_size, self.kv_dtype, self.backend = page_size, kv_dtype, backend
        self.world, self.local_layout = world, PoolLayout.of(layout)
        self.fetch_deadline_s = fetch_deadline_s
        self._known: dict[tuple[str, int], tuple[float, dict[str, Any]]] = {}  # (host, port) -> (when, answer)
        self._lock = threading.Lock()

    def layout(self, target: tuple[str, int], max_age_s: float = PREFILL_INFO_TTL_S) -> dict[str, Any]:
        """The prefill server's bootstrap answer with every rank (raises `BootstrapError` if unreachable)."""
        with self._lock:
            known = self._known.get(target)
        if known is not None and time.monotonic() - known[0] < max_age_s:
            return known[1]
        info = fetch_parallel_info(target[0], target[1], deadline_s=self.fetch_deadline_s)
        with self._lock:
            self._known[target] = (time.monotonic(), info)
        return info

    def forget(self, target: tuple[str, int]) -> None:
        with self._lock:
            self._known.pop(target, None)

    def incompatibility(self, info: dict[str, Any]) -> str | None:
        """Why this decode server cannot take KV from that prefill server (None if it can)."""
        ranks = info.get("ranks") or []
        if not ranks:
            return "the prefill server's bootstrap lists no ranks"
        first = ranks[0]
        if int(first.get("page_size", -1)) != self.page_size:
            return (f"page size mismatch: the prefill server uses --page-size {first.get('page_size')}, this decode "
                    f"server {self.page_size}")
        if first.get("kv_cache_dtype") != self.kv_dtype:
            return (f"KV cache dtype mismatch: the prefill server stores {first.get('kv_cache_dtype')}, this decode "
                    f"server {self.kv_dtype}")
        if first.get("transfer_backend") != self.backend:
            return (f"transfer backend mismatch: the prefill server uses {first.get('transfer_backend')}, this decode "
                    f"server {self.backend}")
        prefill_world = [RankKV.from_json(r["rank_kv"]) for r in ranks]
        try:
            for d in self.world:
                writers_for(d, prefill_world)
        except ValueError as e:
            return f"the prefill server does not hold the KV this decode server needs: {e}"
        layout = PoolLayout.from_json(first["layout"])
        if layout.head_dim != self.local_layout.head_dim or layout.itemsize != self.local_layout.itemsize:
            return "KV layout mismatch (head dim or element size differ): not the same model"
        if layout.hybrid != self.local_layout.hybrid:
            where = "the prefill server" if layout.hybrid else "this decode server"
            return (f"sliding-window KV pool mismatch: only {where} keeps the sliding layers' KV in its own pool; "
                    "start both servers with or both without --disable-hybrid-swa-memory")
        if layout.sliding != self.local_layout.sliding:
            return "sliding-window KV pool mismatch (the layers' window pattern differs): not the same model"
        return None
