"""`IpcAddresses.fresh`: three endpoints in a new folder; without a detokenizer process the scheduler's outputs
go to the engine's own address (the server process detokenizes, the default)."""

from __future__ import annotations

from tokenloom.config import ServerArgs
from tokenloom.ipc import IpcAddresses


def test_a_detokenizer_process_gets_its_own_address():
    addresses = IpcAddresses.fresh()
    assert len({addresses.scheduler, addresses.detokenizer, addresses.engine}) == 3
    assert all(a.startswith("ipc://") for a in (addresses.scheduler, addresses.detokenizer, addresses.engine))


def test_without_a_detokenizer_process_the_scheduler_sends_to_the_engine():
    assert not ServerArgs().detokenizer_process  # the default
    addresses = IpcAddresses.fresh(detokenizer_process=False)
    assert addresses.detokenizer == addresses.engine != addresses.scheduler
