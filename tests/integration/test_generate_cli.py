"""The one-shot `tokenloom generate` command: runs prompts through the forward path; bad input exits 2
with one clear line."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tokenloom.cli", "generate", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_generate_runs_prompts(tiny_runtime_model):
    result = _cli("--model-path", tiny_runtime_model, "--dtype", "float32", "--max-new-tokens", "5",
                  "--max-total-tokens", "2048", "Hello there", "Second prompt")
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if "->" in line]
    assert len(lines) == 2 and lines[0].startswith("'Hello there' -> ")
    assert "10 tokens" in result.stderr


def test_missing_model_is_a_clear_error(tmp_path):
    result = _cli("--model-path", str(tmp_path / "missing"), "hi")
    assert result.returncode == 2
    assert "does not exist" in result.stderr and "Traceback" not in result.stderr


def test_bad_flag_is_a_usage_error():
    result = _cli("--dtype", "float64", "hi")
    assert result.returncode == 2 and "invalid choice" in result.stderr
