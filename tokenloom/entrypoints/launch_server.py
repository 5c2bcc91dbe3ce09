"""Launching the HTTP server: `tokenloom serve [flags]` or `python -m tokenloom.launch_server [flags]`.

    tokenloom serve                                  # SmolLM2-135M-Instruct on http://127.0.0.1:30000
    tokenloom serve --model-path /path/to/hf-folder --port 8000 --api-key secret

Every server flag (SGLang's names: --model-path, --host, --port, --dtype, --context-length, ...) is accepted; an
unknown flag or a value that cannot work is a usage error (exit 2). Order of events: check that host:port can be
listened on (exit 1 at once if not), load the model (scheduler processes, and a detokenizer process with
--detokenizer-process), bind, warm up, report healthy. SIGINT/SIGTERM stop the server and its processes (exit 0
after SIGINT; SIGTERM is re-raised, as uvicorn does). If a child process dies, or the warm-up fails, the server
stops and exits 1 with the reason on stderr.

Several machines: run the same command on each with `--nnodes N --node-rank K --dist-init-addr host:port`
(an address of node 0). Node 0 serves HTTP; the others run scheduler ranks only (entrypoints/worker_node.py).

Logs: once the runtime is ready, a start-up summary (entrypoints/startup_summary.py); uvicorn's access log
keeps a line per request except health probes and metric scrapes (`QUIET_ACCESS_PATHS`), which would
otherwise drown it.
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys
from typing import TYPE_CHECKING

from tokenloom.config import ConfigError, ServerArgs, check_device, warn_ignored_flags

if TYPE_CHECKING:
    from tokenloom.frontend.tokenizer_manager import TokenizerManager

GRACEFUL_SHUTDOWN_S = 5
QUIET_ACCESS_PATHS = frozenset({"/health", "/health_generate", "/metrics"})  # no access-log line for these


def build_parser(prog: str = "tokenloom serve") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    ServerArgs.add_cli_args(parser)
    return parser


def parse_args(argv: list[str] | None, prog: str = "tokenloom serve") -> ServerArgs:
    """Flags → ServerArgs; exits with a usage error (status 2) on anything invalid, a device this machine
    lacks included."""
    parser = build_parser(prog)
    ns = parser.parse_args(argv)
    try:
        args = ServerArgs.from_cli_namespace(ns)
        check_device(args)
        return args
    except ConfigError as e:
        parser.error(str(e))
        raise  # unreachable: parser.error exits


def main(argv: list[str] | None = None, prog: str = "tokenloom serve") -> int:
    args = parse_args(argv, prog)
    from tokenloom.frontend.process_utils import configure_logging

    configure_logging(args.log_level, "server")
    warn_ignored_flags(args)
    if args.node_rank > 0:  # a node other than 0 runs scheduler ranks only (entrypoints/worker_node.py)
        from tokenloom.entrypoints.worker_node import run_worker_node

        return run_worker_node(args)
    problem = check_listen_address(args.host, args.port)
    if problem is not None:  # fail before the model load, not after it
        print(f"error: {problem}", file=sys.stderr)
        return 1
    from tokenloom.entrypoints.runtime import start_tokenizer_manager

    try:
        tm = start_tokenizer_manager(args)
    except (ValueError, RuntimeError, OSError) as e:  # bad model path/config, a child that failed to start
        print(f"error: {e}", file=sys.stderr)
        return 1
    from tokenloom.entrypoints.startup_summary import log_startup_summary

    log_startup_summary(args, tm.source.path, tm.source.config.architecture, tm.scheduler_info)
    return serve(tm, args)


def check_listen_address(host: str, port: int) -> str | None:
    """Why the server could not listen on host:port (port taken, unknown host), or None."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
            sock.bind(address)
    except OSError as e:
        return f"cannot listen on {host}:{port}: {e.strerror or e}"
    return None


class QuietProbesFilter(logging.Filter):
    """Drops uvicorn access-log records of `QUIET_ACCESS_PATHS` (uvicorn logs them with the arguments
    (client, method, path with query, HTTP version, status)); every other record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        fields = record.args
        if isinstance(fields, tuple) and len(fields) >= 3 and isinstance(fields[2], str):
            return fields[2].split("?", 1)[0] not in QUIET_ACCESS_PATHS
        return True


def quiet_probe_access_lines(access_logger: logging.Logger) -> None:
    """Install `QuietProbesFilter` on uvicorn's access logger (once)."""
    if not any(isinstance(f, QuietProbesFilter) for f in access_logger.filters):
        access_logger.addFilter(QuietProbesFilter())


def serve(tm: TokenizerManager, args: ServerArgs) -> int:
    """Run uvicorn until a signal or a fatal error; returns the exit status."""
    import uvicorn

    from tokenloom.entrypoints.http_server import create_app

    fatal: list[str] = []
    server: uvicorn.Server | None = None

    def on_fatal(reason: str) -> None:  # may run on the TokenizerManager's receiver thread
        fatal.append(reason)
        if server is not None:
            server.should_exit = True

    app = create_app(tm, args, on_fatal)
    quiet_probe_access_lines(logging.getLogger("uvicorn.access"))
    config = uvicorn.Config(app, host=args.host, port=args.port, log_config=None, log_level=args.log_level,
                            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, lifespan="on")
    server = uvicorn.Server(config)
    tm.on_dead = on_fatal
    if tm.dead_error is not None:  # died before the callback was in place
        fatal.append(tm.dead_error)
    try:
        if not fatal:
            server.run()
    except SystemExit as e:  # uvicorn exits 1 when it cannot bind the port (already logged)
        fatal.append(f"the HTTP server could not start on {args.host}:{args.port} (exit status {e.code})")
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it handled; the shutdown is complete
        pass
    finally:
        tm.shutdown()
    if fatal:
        print(f"error: {fatal[0]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(prog="python -m tokenloom.entrypoints.launch_server"))
