"""The launch commands: bad flags are usage errors (exit 2, no traceback), a bad model path is a clear
error (exit 1), and `tokenloom serve` / `python -m tokenloom.launch_server` are the same command."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
import torch

from tests.e2e.server_process import REPO


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("flags, fragment", [
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["--port", "70000"], "--port must be in [1, 65535]"),
    (["--port", "http"], "argument --port: invalid int value"),
    (["--dtype", "float64"], "argument --dtype: invalid choice"),
    (["--max-queued-requests", "0"], "--max-queued-requests must be >= 1"),
    (["--api-key", " "], "--api-key must not be empty"),
    (["--pp-size", "2", "--pp-max-micro-batch-size", "0"], "--pp-max-micro-batch-size must be >= 1"),
    (["--tensor-parallel-size", "3", "--nnodes", "2"], "--tp-size x --pp-size (3) must be divisible by --nnodes"),
    (["--kv-cache-dtype", "int4"], "argument --kv-cache-dtype: invalid choice: 'int4' (choose from"),
    (["--num-threads", "0"], "--num-threads must be >= 1"),
], ids=["unknown", "port_range", "port_type", "dtype", "queue", "api_key", "pp", "tp_nnodes", "kv_dtype",
        "threads"])
def test_bad_flags_are_usage_errors(flags, fragment):
    result = run("-m", "tokenloom.launch_server", *flags)
    assert result.returncode == 2, result.stderr
    assert "usage: python -m tokenloom.launch_server" in result.stderr and fragment in result.stderr
    assert "Traceback" not in result.stderr


def test_serve_subcommand_and_help():
    result = run("-m", "tokenloom.cli", "serve", "--help")
    assert result.returncode == 0 and "usage: tokenloom serve" in result.stdout
    for flag in ("--model-path", "--host", "--port", "--api-key", "--served-model-name", "--max-queued-requests",
                 "--enable-metrics", "--stream-interval", "--context-length", "--mem-fraction-static",
                 "--trust-remote-code", "--disable-cuda-graph", "--cuda-graph-max-bs", "--enable-torch-compile",
                 "--kv-cache-dtype"):
        assert flag in result.stdout
    result = run("-m", "tokenloom.cli")
    assert result.returncode == 2 and "serve" in result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_cuda_without_a_gpu_is_a_usage_error_before_loading():
    result = run("-m", "tokenloom.launch_server", "--device", "cuda")
    assert result.returncode == 2, result.stderr
    assert "--device cuda: no CUDA device" in result.stderr and "--device cpu" in result.stderr
    assert "Traceback" not in result.stderr


def test_ignored_sglang_flags_warn_once_each_at_start():
    result = run("-m", "tokenloom.launch_server", "--model-path", "/no/such/model", "--trust-remote-code",
                 "--disable-cuda-graph", "--cuda-graph-max-bs", "8", "--enable-torch-compile")
    assert result.returncode == 1  # the missing model stops it after the warnings
    for flag in ("--trust-remote-code", "--disable-cuda-graph", "--cuda-graph-max-bs", "--enable-torch-compile"):
        assert result.stderr.count(f"WARNING {flag} has no effect") == 1, result.stderr


def test_missing_model_is_a_clear_error():
    result = run("-m", "tokenloom.cli", "serve", "--model-path", "/no/such/model")
    assert result.returncode == 1
    assert "error: model path '/no/such/model' does not exist" in result.stderr
    assert "Traceback" not in result.stderr


def test_missing_model_on_a_worker_node_is_a_clear_error():
    result = run("-m", "tokenloom.cli", "serve", "--model-path", "/no/such/model", "--tp-size", "2", "--nnodes",
                 "2", "--node-rank", "1", "--dist-init-addr", "127.0.0.1:29999")
    assert result.returncode == 1
    assert "error: node 1: model path '/no/such/model' does not exist" in result.stderr
    assert "Traceback" not in result.stderr


def test_busy_port_fails_before_loading_the_model():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run("-m", "tokenloom.launch_server", "--port", str(port))
    assert result.returncode == 1
    assert f"error: cannot listen on 127.0.0.1:{port}: Address already in use" in result.stderr
    result = run("-m", "tokenloom.launch_server", "--host", "no-such-host.invalid")
    assert result.returncode == 1 and "cannot listen on no-such-host.invalid:30000" in result.stderr
