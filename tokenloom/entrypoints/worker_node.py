"""A node other than 0 of a multi-node world (`tokenloom serve --nnodes N --node-rank K --dist-init-addr ...`,
K > 0): it runs this node's scheduler ranks and nothing else (no HTTP server, tokenizer or detokenizer; those
live on node 0), supervises them, and exits when the world ends.

Exit status:
- 0 when node 0 shut down on purpose (it announced it on the world board) or on SIGINT/SIGTERM here;
- 1 when one of this node's ranks died (its death is published on the board first, so node 0 names it), when
  node 0 went away without announcing it (its rendezvous store stopped answering), or when start-up failed.
Every exit stops this node's ranks first, so nothing is left running.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading

from tokenloom.config import ServerArgs
from tokenloom.distributed.world_board import BoardUnreachable
from tokenloom.entrypoints.launcher import RuntimeLauncher
from tokenloom.models.loader import resolve_model_source

logger = logging.getLogger("tokenloom.node")

SUPERVISE_S = 0.5  # how often the ranks and the board are checked


def run_worker_node(args: ServerArgs) -> int:
    """Start this node's ranks, supervise them until the world ends; returns the exit status."""
    stop = threading.Event()

    def on_signal(signum, _frame) -> None:
        logger.info("node %d: %s received; stopping its ranks", args.node_rank, signal.Signals(signum).name)
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            launcher = RuntimeLauncher(args, resolve_model_source(args), addresses=None)
        except (ValueError, RuntimeError, OSError) as e:  # bad model path or config, shapes TP cannot split
            print(f"error: node {args.node_rank}: {e}", file=sys.stderr)
            return 1
        ranks = launcher.ranks
        names = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}-{ranks[-1]}"
        logger.info("node %d of %d: starting scheduler %s; rendezvous at %s", args.node_rank, args.nnodes, names,
                    args.dist_init_addr)
        try:
            launcher.start(cancelled=stop.is_set)
        except (RuntimeError, OSError) as e:
            if stop.is_set():  # SIGINT/SIGTERM while the ranks were starting: stopped on request
                return 0
            print(f"error: node {args.node_rank}: {e}", file=sys.stderr)
            return 1
        logger.info("node %d: scheduler %s ready", args.node_rank, names)
        try:
            return _supervise(launcher, args, stop)
        finally:
            launcher.stop_all()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _supervise(launcher: RuntimeLauncher, args: ServerArgs, stop: threading.Event) -> int:
    board = launcher.board
    assert board is not None, "a worker node joins the board at start"
    while not stop.wait(SUPERVISE_S):
        deaths = launcher.local_deaths()  # published on the board as a side effect
        try:
            announced = board.shutdown_announced()
        except BoardUnreachable:
            print(f"error: node {args.node_rank}: " + (deaths[0] if deaths else
                  f"node 0 went away (its rendezvous store at {args.dist_init_addr} stopped answering)")
                  + "; stopping this node's ranks", file=sys.stderr)
            return 1
        if announced:
            board.acknowledge_shutdown(args.node_rank)
            logger.info("node %d: node 0 shut down; stopping this node's ranks", args.node_rank)
            return 0
        if deaths:
            print(f"error: node {args.node_rank}: {deaths[0]}", file=sys.stderr)
            return 1
    return 0
