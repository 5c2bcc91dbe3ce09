"""KV transfer engines (Mooncake, NIXL, fake) behind one `TransferEngine` interface (base.py); `make_engine`
(factory.py) picks one."""

from tokenloom.disaggregation.transfer.base import TransferEngine, TransferError
from tokenloom.disaggregation.transfer.factory import make_engine

__all__ = ["TransferEngine", "TransferError", "make_engine"]
