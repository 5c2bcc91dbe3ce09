"""The KV transfer engine interface of prefill/decode disaggregation, its error, and the helpers engines share
(run checks, registered regions, deadlines). The engines (fake.py, mooncake.py, nixl.py) import this module;
it imports none of them (factory.py picks one).

A `TransferEngine` moves bytes from this process's registered memory into a peer engine's registered memory
(one-sided WRITE; the receiver learns of completion from the writer over the control channel, not from the
engine). Lifecycle: construct (`factory.make_engine`) -> `register` every buffer a transfer may touch -> hand
`descriptor()` to the peers -> `write` from any number of threads -> `close`.

Invariants every engine keeps:
- `write` returns only when every byte of every run is at the destination, and raises `TransferError` (never
  another exception type) when the peer is dead, frozen, refuses the write, or an address falls outside
  registered memory, within `timeout_s` (Mooncake: plus up to its `SETTLE_S` while runs it left in flight
  resolve, so that none lands after the raise). After a `TransferError` the destination may hold part of the
  runs: the caller treats that range as garbage until it is written again.
- `expect_incoming(True)` is how a receiver says transfers are due; engines whose transfers need the receiver
  to make progress (NIXL with its progress thread off) poll only while it is on.
"""

from __future__ import annotations

import bisect
import ipaddress
import operator
import threading
import time
from typing import Protocol, runtime_checkable

Run = tuple[int, int, int]  # (local source address, remote destination address, bytes)


class TransferError(RuntimeError):
    """A write did not complete: the peer is dead, frozen or refused it, an address is outside registered memory,
    or it timed out."""


@runtime_checkable
class TransferEngine(Protocol):
    backend: str  # "mooncake" | "nixl" | "fake"

    def register(self, addr: int, nbytes: int) -> None:
        """Make local memory [addr, addr + nbytes) a valid source or destination of transfers."""

    def descriptor(self) -> str:
        """A JSON-safe string a peer passes to `write` to reach this engine (call after `register`)."""

    def write(self, peer: str, runs: list[Run], timeout_s: float) -> None:
        """Blocking WRITE of (src_addr local, dst_addr remote, nbytes) runs; thread-safe; any run count."""

    def expect_incoming(self, active: bool) -> None:
        """Receiver-side hint: transfers into this engine are (or are no longer) expected."""

    def close(self) -> None:
        """Release the engine's resources; no call may follow."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def checked_runs(runs: list[Run]) -> list[Run]:
    """`runs` as tuples of Python ints, without the empty ones; a malformed run raises TransferError."""
    out = []
    for run in runs:
        try:
            src, dst, n = (operator.index(v) for v in run)
        except (TypeError, ValueError) as e:
            raise TransferError(f"a run must be three ints (src_addr, dst_addr, nbytes), got {run!r}") from e
        if src < 0 or dst < 0 or n < 0:
            raise TransferError(f"a run's addresses and length must be non-negative, got {run!r}")
        if n:
            out.append((src, dst, n))
    return out


class Deadline:
    """A point in monotonic time `timeout_s` from now."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.at = time.monotonic() + timeout_s

    def remaining(self) -> float:
        return max(0.0, self.at - time.monotonic())

    def passed(self) -> bool:
        return time.monotonic() >= self.at


class Regions:
    """Registered local memory as sorted [start, end) intervals; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._starts: list[int] = []
        self._ends: list[int] = []

    def add(self, addr: int, nbytes: int) -> None:
        with self._lock:
            i = bisect.bisect_right(self._starts, addr)
            self._starts.insert(i, addr)
            self._ends.insert(i, addr + nbytes)

    def items(self) -> list[tuple[int, int]]:
        with self._lock:
            return [(s, e - s) for s, e in zip(self._starts, self._ends, strict=True)]

    def outside(self, runs: list[Run]) -> Run | None:
        """The first run whose source is not inside one registered interval, or None."""
        with self._lock:
            starts, ends = self._starts, self._ends
            for run in runs:
                src, _, n = run
                i = bisect.bisect_right(starts, src) - 1
                # An interval starting later cannot contain src; an earlier-starting, longer one might.
                while i >= 0 and ends[i] < src + n:
                    i -= 1
                if i < 0:
                    return run
        return None
