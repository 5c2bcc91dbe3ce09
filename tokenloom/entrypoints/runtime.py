"""Starting an engine: the processes behind it and the `TokenizerManager` in front of them.

`start_tokenizer_manager(args)` resolves the model, picks fresh IPC addresses, builds the `EngineRuntime` (the
scheduler ranks and the detokenizer through a `RuntimeLauncher`, and on a prefill server the bootstrap service
its ranks register with) and hands it to a new `TokenizerManager`, which starts it once its own sockets are
bound. The Engine, the HTTP server and the CLI start an engine this way; nothing below the entry points
launches processes.
"""

from __future__ import annotations

import multiprocessing as mp
from typing import Any

from tokenloom.config import ServerArgs
from tokenloom.disaggregation.bootstrap_server import BootstrapServer
from tokenloom.entrypoints.launcher import RuntimeLauncher
from tokenloom.frontend.tokenizer_manager import TokenizerManager
from tokenloom.ipc import IpcAddresses
from tokenloom.models.loader import ModelSource, resolve_model_source


class EngineRuntime:
    """The processes of one engine (a `RuntimeProcesses`): the launcher's children, and the bootstrap service
    of a prefill server (started first: its ranks register with it as they start; stopped with them)."""

    def __init__(self, args: ServerArgs, source: ModelSource, addresses: IpcAddresses) -> None:
        self.args = args
        self.launcher = RuntimeLauncher(args, source, addresses)
        self.processes: dict[str, mp.Process] = self.launcher.processes
        self.bootstrap_server: BootstrapServer | None = None

    def start(self) -> dict[str, Any]:
        if self.args.disaggregation_mode == "prefill":
            self.bootstrap_server = BootstrapServer(self.args.host, self.args.disaggregation_bootstrap_port,
                                                    expected_ranks=self.args.tp_size * self.args.pp_size)
            self.bootstrap_server.start()
        return self.launcher.start()

    def dead(self) -> str | None:
        return self.launcher.dead()

    def dead_besides(self, name: str) -> list[str]:
        return self.launcher.dead_besides(name)

    def stop_all(self, clean: bool = False) -> None:
        self.launcher.stop_all(clean=clean)
        if self.bootstrap_server is not None:  # idempotent, like the launcher's
            self.bootstrap_server.stop()


def start_tokenizer_manager(args: ServerArgs) -> TokenizerManager:
    """A running engine's tokenizer manager (raises when the model or a child process fails to start)."""
    source = resolve_model_source(args)
    addresses = IpcAddresses.fresh(args.detokenizer_process)
    return TokenizerManager(args, source, addresses, EngineRuntime(args, source, addresses))
