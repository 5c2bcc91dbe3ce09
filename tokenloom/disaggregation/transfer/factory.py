"""`make_engine`: the `TransferEngine` a `--disaggregation-transfer-backend` names.

The engine modules import their libraries (Mooncake's, NIXL's) only when an engine is constructed, so every
backend's module is importable here and the fake engine works without either library installed.
"""

from __future__ import annotations

from tokenloom.disaggregation.transfer.base import TransferEngine
from tokenloom.disaggregation.transfer.fake import FakeEngine
from tokenloom.disaggregation.transfer.mooncake import MooncakeEngine
from tokenloom.disaggregation.transfer.nixl import NixlEngine

BACKENDS = ("mooncake", "nixl", "fake")


def make_engine(backend: str, host: str = "127.0.0.1") -> TransferEngine:
    """The engine for `backend`, listening on `host` (the address peers reach this process at)."""
    if backend == "fake":
        return FakeEngine()
    if backend == "mooncake":
        return MooncakeEngine(host)
    if backend == "nixl":
        return NixlEngine(host)
    raise ValueError(f"unknown transfer backend {backend!r}; choose one of {', '.join(BACKENDS)}")
