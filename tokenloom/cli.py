"""`tokenloom` console script: dispatches to subcommands (`serve`: the HTTP server; `generate`: one-shot
generation)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"serve": "tokenloom.entrypoints.launch_server", "generate": "tokenloom.entrypoints.generate"}
    if not argv or argv[0] not in commands:
        print(f"usage: tokenloom {{{','.join(commands)}}} ...  (tokenloom <command> --help for its flags)",
              file=sys.stderr)
        return 2
    import importlib

    return importlib.import_module(commands[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
