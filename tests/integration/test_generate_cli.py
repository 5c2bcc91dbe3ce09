"""The one-shot `tokenloom generate` command: runs prompts through the engine (the README's examples on the
real SmolLM2 in the default configuration, bf16); bad input exits 2 with one clear line."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

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


def _completions(result: subprocess.CompletedProcess) -> list[str]:
    return [line.split(" -> ", 1)[1] for line in result.stdout.splitlines() if " -> " in line]


@pytest.mark.slow
def test_readme_example_answers_paris():
    """README: `tokenloom generate "The capital city of France is" --max-new-tokens 16` (no model, no dtype)."""
    result = _cli("The capital city of France is", "--max-new-tokens", "16")
    assert result.returncode == 0, result.stderr
    [completion] = _completions(result)
    assert "Paris" in completion, completion


@pytest.mark.slow
def test_readme_seeded_gguf_example_is_reproducible(smollm2_file):
    """README: `--model-path model.gguf --temperature 0.7 --seed 1 "Once upon a time"`, run twice: the same
    seed samples the same tokens. Two runs of one request each, not the prompt twice in one batch: two
    requests of one run may be admitted in different steps (the scheduler can poll between them), and then
    decode a step at batch 1 and a step at batch 2, whose kernels round differently, so a near-tie in
    sampling could part them (a full-suite run on a loaded machine, session 38)."""
    runs = [_cli("--model-path", smollm2_file, "--temperature", "0.7", "--seed", "1", "Once upon a time")
            for _ in range(2)]
    for result in runs:
        assert result.returncode == 0, result.stderr
    [first], [second] = (_completions(result) for result in runs)
    assert first == second and first.strip("'\" ")


def test_missing_model_is_a_clear_error(tmp_path):
    result = _cli("--model-path", str(tmp_path / "missing"), "hi")
    assert result.returncode == 2
    assert "does not exist" in result.stderr and "Traceback" not in result.stderr


def test_bad_flag_is_a_usage_error():
    result = _cli("--dtype", "float64", "hi")
    assert result.returncode == 2 and "invalid choice" in result.stderr


def test_generate_refuses_tensor_parallelism():
    result = _cli("--tp-size", "2", "Hello")
    assert result.returncode == 2
    assert "--tp-size 2: `tokenloom generate` runs one process" in result.stderr and "Traceback" not in result.stderr
