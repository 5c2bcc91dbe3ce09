"""The clocks and health probes of the PD control protocol, read only on an entry rank's control thread
(control_channel.py; the probes themselves run on its look-up pool): `RoomTimers` (per room: when it is due,
and what then) for the rooms' timeouts and the decode side's drain bounds; `Heartbeats` (per prefill server a
decode entry uses: when to probe its bootstrap /health next, and how many probes in a row failed); and
`ranks_gone`, whether a server's rank processes have all exited.

They only keep time and ask: what an expiry or an answer means (a failed room, a let-go) is the agent's.
Monotonic time only; an expired timer is removed as it is reported, so each fires once.
"""

from __future__ import annotations

import socket
import time
from typing import Generic, TypeVar

T = TypeVar("T")


class RoomTimers(Generic[T]):
    """Per room: a due time and what the timer is for (`T`)."""

    def __init__(self) -> None:
        self._due: dict[int, tuple[float, T]] = {}

    def set(self, room: int, after_s: float, what: T) -> None:
        """Due `after_s` from now (replacing the room's timer, if any)."""
        self._due[room] = (time.monotonic() + after_s, what)

    def cancel(self, room: int) -> None:
        self._due.pop(room, None)

    def expired(self, now: float) -> list[tuple[int, T]]:
        """The rooms due by `now`, removed."""
        rooms = [(room, what) for room, (due, what) in self._due.items() if now >= due]
        for room, _ in rooms:
            del self._due[room]
        return rooms

    def __contains__(self, room: int) -> bool:
        return room in self._due

    def __len__(self) -> int:
        return len(self._due)


Target = tuple[str, int]  # a prefill server's bootstrap (host, port)


class Heartbeats:
    """A decode entry's probes of the prefill servers its rooms came from."""

    def __init__(self, interval_s: float, max_failures: int) -> None:
        self.interval_s = interval_s
        self.max_failures = max_failures
        self._targets: dict[Target, tuple[float, int]] = {}  # -> (next probe, failed probes in a row)

    def track(self, target: Target) -> None:
        """Probe `target` from one interval from now on (a no-op when it is probed already)."""
        self._targets.setdefault(target, (time.monotonic() + self.interval_s, 0))

    def due(self, now: float) -> list[Target]:
        """The targets whose probe is due by `now`; each is due again one interval later."""
        targets = [target for target, (due, _) in self._targets.items() if now >= due]
        for target in targets:
            self._targets[target] = (now + self.interval_s, self._targets[target][1])
        return targets

    def record(self, target: Target, healthy: bool) -> int | None:
        """Count a probe's answer. The number of failed probes in a row when it reached `max_failures` (the
        target is then no longer probed), else None (also for a target not probed any more)."""
        if target not in self._targets:
            return None
        due, misses = self._targets[target]
        misses = 0 if healthy else misses + 1
        if misses >= self.max_failures:
            del self._targets[target]
            return misses
        self._targets[target] = (due, misses)
        return None


def ranks_gone(control_addresses: list[str], timeout_s: float) -> bool:
    """Whether every rank at `control_addresses` ("tcp://host:port", its control socket) has exited: a
    connection to each is refused (no process listens there any more). A rank that accepts, or does not answer
    in time (a frozen process's socket still accepts; a partitioned network is not proof), is not gone."""
    for address in control_addresses:
        host, _, port = address.removeprefix("tcp://").rpartition(":")
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
                return False
        except ConnectionRefusedError:
            continue
        except (OSError, ValueError):
            return False
    return True
