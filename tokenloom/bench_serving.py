"""`python -m tokenloom.bench_serving [flags]`: SGLang's spelling of the serving benchmark client
(`tokenloom.bench.bench_serving`)."""

from __future__ import annotations

import sys

from tokenloom.bench.bench_serving import main

if __name__ == "__main__":
    sys.exit(main())
