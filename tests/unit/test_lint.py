"""ruff runs as part of the test suite: the tree stays lint-clean."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_ruff_clean():
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "tokenloom", "tests", "bench"], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
