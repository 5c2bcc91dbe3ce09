"""Helpers shared by child processes: logging setup, dying with the parent, reporting a fatal error."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
import traceback
from typing import Any

from tokenloom.protocol import ProcessFailed

PARENT_CHECK_S = 1.0


def configure_logging(level: str, name: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper()),
                        format=f"[%(asctime)s {name}] %(levelname)s %(message)s", datefmt="%H:%M:%S", force=True)


def child_process_setup(name: str, log_level: str) -> None:
    """Log with the process name, and exit when the parent dies (no orphaned model processes)."""
    configure_logging(log_level, name)
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(PARENT_CHECK_S)
            if os.getppid() != parent:
                os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name=f"{name}-parent-watch", daemon=True).start()


def report_failure(name: str, error: BaseException, ready: Any, sender: Any) -> None:
    """Tell the engine why this process is about to exit: through the ready pipe (its launcher reads it,
    during startup or after), and through the output socket when it has one."""
    text = "".join(traceback.format_exception(error))
    logging.getLogger(name).error("%s failed:\n%s", name, text)
    with contextlib.suppress(BrokenPipeError, OSError):
        ready.send({"status": "error", "error": f"{type(error).__name__}: {error}", "traceback": text})
    if sender is None:  # a rank on a node other than 0: its launcher reports the exit
        return
    try:
        sender.send(ProcessFailed(name, f"{type(error).__name__}: {error}"))
        time.sleep(0.2)  # let ZMQ flush before the process exits
    except Exception:  # noqa: BLE001 - best effort on the way out
        pass
