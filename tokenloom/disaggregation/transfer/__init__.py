"""KV transfer engines (Mooncake, NIXL, fake) behind one `TransferEngine` interface; see base.py."""

from tokenloom.disaggregation.transfer.base import TransferEngine, TransferError, make_engine

__all__ = ["TransferEngine", "TransferError", "make_engine"]
