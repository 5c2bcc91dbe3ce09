"""The PD fields of a request body (`bootstrap_host`, `bootstrap_port`, `bootstrap_room`, as SGLang's router
adds them: scalars for one prompt, lists for a batch) turned into one `Bootstrap` per prompt.

A unified server ignores them (accepted with any value). A prefill or decode server needs all three for
every prompt (a client that bypasses the router gets a 400 naming the field), except requests to SGLang's
fake bootstrap host (warm-up, health checks), which are served without a peer.
"""

from __future__ import annotations

from typing import Any

from tokenloom.protocol import Bootstrap

MAX_ROOM = 2**63 - 1


def _per_prompt(name: str, value: Any, count: int) -> list[Any]:
    if isinstance(value, list):
        if len(value) != count:
            raise ValueError(f"{name} has {len(value)} entries for {count} prompts")
        return value
    return [value] * count


def bootstraps_for(mode: str, host: Any, port: Any, room: Any, count: int, copies: int) -> list[Bootstrap | None]:
    """One `Bootstrap` (or None on a unified server) per prompt; raises ValueError with a client-facing message."""
    if mode == "null":
        return [None] * count
    if room is None or host is None:
        missing = "bootstrap_room" if room is None else "bootstrap_host"
        raise ValueError(f"{missing} is required on a disaggregated ({mode}) server: send requests through "
                         "SGLang's router (sglang_router.launch_router --pd-disaggregation)")
    if copies > 1:
        raise ValueError("n > 1 is not supported on a disaggregated server (one bootstrap room per prompt)")
    hosts, ports, rooms = (_per_prompt("bootstrap_host", host, count), _per_prompt("bootstrap_port", port, count),
                           _per_prompt("bootstrap_room", room, count))
    out = []
    for h, p, r in zip(hosts, ports, rooms, strict=True):
        if not isinstance(h, str) or not h:
            raise ValueError(f"bootstrap_host must be a host name, got {h!r}")
        if p is None and h == "2.2.2.2":
            p = 0
        if isinstance(p, bool) or not isinstance(p, int) or not 0 <= p <= 65535:
            raise ValueError(f"bootstrap_port must be a port number, got {p!r}")
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r <= MAX_ROOM:
            raise ValueError(f"bootstrap_room must be an integer in [0, 2**63), got {r!r}")
        out.append(Bootstrap(h, p, r))
    if len({b.room for b in out}) != len(out):
        raise ValueError("bootstrap_room values must differ between the prompts of a batch")
    return out
