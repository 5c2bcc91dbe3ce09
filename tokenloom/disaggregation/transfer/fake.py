"""The fake transfer engine (SGLang's "fake" backend semantics): every write succeeds at once and moves
nothing. For unit tests of the disaggregation protocol and for warm-up requests; the destination's bytes are
whatever they were."""

from __future__ import annotations

from tokenloom.disaggregation.transfer.base import Run


class FakeEngine:
    backend = "fake"

    def register(self, addr: int, nbytes: int) -> None:
        """Nothing to register: no byte ever moves."""

    def descriptor(self) -> str:
        return "fake"

    def write(self, peer: str, runs: list[Run], timeout_s: float) -> None:
        """Returns at once; the runs are not read."""

    def expect_incoming(self, active: bool) -> None:
        """No-op."""

    def close(self) -> None:
        """No-op."""
