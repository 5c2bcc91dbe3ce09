"""`bench/shared_machine.py`'s llama-server mode without llama.cpp: its command line (slots, context, port
from the bench's settings) and the ITL it derives from streamed chunks that carry several tokens."""

from __future__ import annotations

import argparse
import random

import pytest

from bench import shared_machine as sm


def test_llama_server_command_fills_the_workload():
    server = sm.LlamaServer.__new__(sm.LlamaServer)  # no process: only the command is built
    server.exe, server.gguf, server.url = "/bin/llama-server", "/m.gguf", "http://127.0.0.1:4321"
    cmd = server._command([], argparse.Namespace(concurrency=8))
    assert cmd[0] == "/bin/llama-server" and cmd[cmd.index("-m") + 1] == "/m.gguf"
    assert cmd[cmd.index("-np") + 1] == "8" and cmd[cmd.index("-c") + 1] == "8192"
    assert cmd[cmd.index("--port") + 1] == "4321"
    assert not any("{" in part for part in cmd)


class _Chunks:
    def __init__(self, chunks: list[tuple[float, int]]) -> None:
        self.chunks = chunks

    def stream(self, ids: list[int], max_new_tokens: int) -> list[tuple[float, int]]:
        return self.chunks


def test_itl_counts_tokens_after_the_first_chunk():
    ns = argparse.Namespace(input_len=4, output_len=5)
    # first chunk at t=1.0 holds 1 token; the 4 after it arrive over 0.2 s: 50 ms each
    got = sm.itl_ms(_Chunks([(1.0, 1), (1.1, 3), (1.2, 5)]), ns, random.Random(0))
    assert got == pytest.approx(50.0)
    with pytest.raises(RuntimeError, match="expected 5"):
        sm.itl_ms(_Chunks([(1.0, 1), (1.1, 3)]), ns, random.Random(0))
