"""A `TransferAgent`'s settings: its rank and server, and the clocks of the PD protocol, read from SGLang's
environment variables (TOKENLOOM_DISAGGREGATION_<NAME> first, then SGLANG_DISAGGREGATION_<NAME>), and the
transfer-failure test hook."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from tokenloom.disaggregation.pairing import RankKV

SENDER_THREADS = 4  # prefill: KV writes run on this many threads (the engines release the GIL while copying)


def env_float(name: str, default: float) -> float:
    """TOKENLOOM_DISAGGREGATION_<name>, else SGLang's SGLANG_DISAGGREGATION_<name>, else `default`."""
    for key in (f"TOKENLOOM_DISAGGREGATION_{name}", f"SGLANG_DISAGGREGATION_{name}"):
        if os.environ.get(key):
            return float(os.environ[key])
    return default


def test_failure_prob() -> float:
    """The injected transfer-failure probability (a test hook like SGLang's DISAGGREGATION_TEST_FAILURE_PROB)."""
    raw = os.environ.get("TOKENLOOM_DISAGGREGATION_TEST_FAILURE_PROB") or \
        os.environ.get("DISAGGREGATION_TEST_FAILURE_PROB") or "0"
    return float(raw)


@dataclass
class AgentConfig:
    role: str  # "prefill" | "decode"
    me: RankKV
    world: list[RankKV]  # this server's ranks, by rank
    host: str  # the address peers reach this rank at
    page_size: int
    kv_dtype: str
    events_address: str | None  # the entry's own scheduler inbox (entry rank only)
    expected_decode_tp: int | None = None  # prefill: --disaggregation-decode-tp
    bootstrap_timeout_s: float = field(default_factory=lambda: env_float("BOOTSTRAP_TIMEOUT", 300.0))
    waiting_timeout_s: float = field(default_factory=lambda: env_float("WAITING_TIMEOUT", 300.0))
    heartbeat_interval_s: float = field(default_factory=lambda: env_float("HEARTBEAT_INTERVAL", 5.0))
    heartbeat_max_failure: int = field(default_factory=lambda: int(env_float("HEARTBEAT_MAX_FAILURE", 2)))
    transfer_timeout_s: float = field(default_factory=lambda: env_float("TRANSFER_TIMEOUT", 60.0))

    @property
    def is_entry(self) -> bool:
        return self.events_address is not None
