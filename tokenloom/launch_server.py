"""`python -m tokenloom.launch_server [flags]`: SGLang's spelling of `tokenloom serve`.

The server module is imported only when run, so processes that import this one (spawned children
re-import the main module) stay light.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from tokenloom.entrypoints.launch_server import main as launch

    return launch(argv, prog="python -m tokenloom.launch_server")


if __name__ == "__main__":
    sys.exit(main())
