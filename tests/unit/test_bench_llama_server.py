"""`bench/llama_server.py` and the llama-server parts of `bench/serve_vs_peers.py`, without llama.cpp: the
binary lookup order, GGUF making through a stand-in `llama-quantize` (cache names, the bf16 -> q8_0 chain,
notes when it cannot be made), the command line's per-workload slots and context, engine-name expansion."""

from __future__ import annotations

import os
import stat

import pytest

from bench import llama_server
from bench.serve_vs_peers import LLAMA_ENGINES, Engine, expand_engine_names, make_workloads

FAKE_QUANTIZE = """#!/bin/sh
# args: [--allow-requantize] SRC DST TYPE THREADS; records them and writes DST
[ "$1" = "--allow-requantize" ] && shift
echo "$@" >> "$(dirname "$0")/calls.txt"
[ "$3" = "FAIL" ] && { echo "boom" >&2; exit 3; }
printf '%s from %s' "$3" "$1" > "$2"
"""


def executable(path, text: str = "#!/bin/sh\n") -> str:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_lookup_order(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENLOOM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(llama_server.sys, "executable", str(tmp_path / "venv" / "python"))
    monkeypatch.setattr(llama_server, "_package_bin", lambda name: None)
    assert llama_server.find_llama_server(None) is None
    (tmp_path / "cache" / "llama.cpp" / "bin").mkdir(parents=True)
    cached = executable(tmp_path / "cache" / "llama.cpp" / "bin" / "llama-server")
    assert llama_server.find_llama_server(None) == cached
    (tmp_path / "venv").mkdir()
    venv = executable(tmp_path / "venv" / "llama-server")
    assert llama_server.find_llama_server(None) == venv  # the venv before the cache
    (tmp_path / "on_path").mkdir()
    on_path = executable(tmp_path / "on_path" / "llama-server")
    monkeypatch.setenv("PATH", str(tmp_path / "on_path"))
    assert llama_server.find_llama_server(None) == on_path  # PATH before the venv
    explicit = executable(tmp_path / "mine")
    assert llama_server.find_llama_server(explicit) == explicit  # the flag before everything
    with pytest.raises(SystemExit, match="is not an executable file"):
        llama_server.find_llama_server(str(tmp_path / "missing"))
    # llama-quantize next to the server first
    assert llama_server.find_quantize(cached) is None
    quantize = executable(tmp_path / "cache" / "llama.cpp" / "bin" / "llama-quantize")
    assert llama_server.find_quantize(cached) == quantize


def test_ensure_ggufs_makes_bf16_then_q8_0_once(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENLOOM_CACHE_DIR", str(tmp_path / "cache"))
    source = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    source.write_text("q4_1 weights")
    quantize = executable(tmp_path / "llama-quantize", FAKE_QUANTIZE)
    notes: list[str] = []
    paths = llama_server.ensure_ggufs(str(source), quantize, notes)
    gguf_dir = tmp_path / "cache" / "gguf"
    assert notes == []
    assert paths == {"bf16": str(gguf_dir / "SmolLM2-135M-Instruct-bf16.gguf"),
                     "q8_0": str(gguf_dir / "SmolLM2-135M-Instruct-q8_0.gguf"), "q4_1": str(source)}
    assert (gguf_dir / "SmolLM2-135M-Instruct-bf16.gguf").read_text() == f"BF16 from {source}"
    assert (gguf_dir / "SmolLM2-135M-Instruct-q8_0.gguf").read_text() == f"Q8_0 from {paths['bf16']}"
    assert sorted(os.listdir(gguf_dir)) == ["SmolLM2-135M-Instruct-bf16.gguf", "SmolLM2-135M-Instruct-q8_0.gguf"]
    calls = (tmp_path / "calls.txt").read_text().splitlines()
    assert len(calls) == 2
    assert llama_server.ensure_ggufs(str(source), quantize, notes) == paths  # cached: not made again
    assert len((tmp_path / "calls.txt").read_text().splitlines()) == 2


def test_ensure_ggufs_makes_only_the_wanted_kinds(tmp_path, monkeypatch):
    """Q4_K_M alone: made from the bf16 file (made first, as its source), no Q8_0."""
    monkeypatch.setenv("TOKENLOOM_CACHE_DIR", str(tmp_path / "cache"))
    source = tmp_path / "m.Q4_1.gguf"
    source.write_text("w")
    quantize = executable(tmp_path / "llama-quantize", FAKE_QUANTIZE)
    notes: list[str] = []
    paths = llama_server.ensure_ggufs(str(source), quantize, notes, ("q4_k_m",))
    gguf_dir = tmp_path / "cache" / "gguf"
    assert notes == [] and sorted(paths) == ["bf16", "q4_1", "q4_k_m"]
    assert (gguf_dir / "m-q4_k_m.gguf").read_text() == f"Q4_K_M from {paths['bf16']}"
    assert sorted(os.listdir(gguf_dir)) == ["m-bf16.gguf", "m-q4_k_m.gguf"]


def test_ensure_ggufs_without_quantize_or_on_failure(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENLOOM_CACHE_DIR", str(tmp_path / "cache"))
    source = tmp_path / "m.Q4_1.gguf"
    source.write_text("w")
    notes: list[str] = []
    assert llama_server.ensure_ggufs(str(source), None, notes) == {"q4_1": str(source)}
    assert len(notes) == 2 and all("no llama-quantize" in n for n in notes)
    failing = executable(tmp_path / "llama-quantize", FAKE_QUANTIZE.replace('"$3" = "FAIL"', '"$3" = "BF16"'))
    notes = []
    assert llama_server.ensure_ggufs(str(source), failing, notes) == {"q4_1": str(source)}
    assert notes[0] == "llama.cpp-bf16: skipped (llama-quantize failed with 3: boom)"
    assert notes[1].startswith("llama.cpp-q8_0: skipped (no ") and notes[1].endswith("-bf16.gguf to make it from)")
    assert not os.listdir(tmp_path / "cache" / "gguf")  # no half-written file left in the cache


def test_command_per_workload(tmp_path):
    workloads = {w.key: w for w in make_workloads(quick=False, scale=1.0, only="acde")}
    e, d, c = workloads["e"], workloads["d"], workloads["c"]
    assert (e.concurrency, e.slot_ctx) == (64, 512)  # 256 + 128 (+ margin) rounded up to 256
    assert (d.concurrency, d.slot_ctx) == (1, 512)
    assert (c.concurrency, c.slot_ctx) == (256, 768)  # 512 + 16 + 128
    assert "--max-concurrency" in e.flags and e.flags[e.flags.index("--num-prompts") + 1] == "64"
    engine = Engine("llama.cpp-bf16", llama_server.server_cmd("/bin/llama-server", "/m.gguf"), "/health",
                    "openai", "/m.gguf", lambda out_len: [])
    fill = {"{port}": "9", "{np}": str(e.concurrency), "{ctx}": str(e.concurrency * e.slot_ctx)}
    cmd = [fill.get(x, x) for x in engine.cmd]
    assert cmd == ["/bin/llama-server", "-m", "/m.gguf", "-np", "64", "-c", "32768", "-t", "2", "-tb", "2",
                   "--host", "127.0.0.1", "--port", "9"]


def test_engine_names():
    # `tokenloom` is the earlier runs' engine, now called tokenloom-bf16
    assert expand_engine_names("tokenloom,llama.cpp") == ["tokenloom-bf16", *LLAMA_ENGINES]
    assert expand_engine_names("llama.cpp-q4_1, tokenloom,llama.cpp-q4_1") == ["llama.cpp-q4_1", "tokenloom-bf16"]
    assert expand_engine_names("pairs") == ["tokenloom-q4_1", "llama.cpp-q4_1", "tokenloom-q8_0", "llama.cpp-q8_0",
                                            "tokenloom-bf16"]
    assert expand_engine_names("1b,tokenloom-1b-q8_0") == ["tokenloom-1b-q4_k_m", "llama.cpp-1b-q4_k_m",
                                                           "tokenloom-1b-q8_0", "llama.cpp-1b-q8_0"]
    with pytest.raises(SystemExit, match="unknown engine 'llama.cpp-q2'"):
        expand_engine_names("llama.cpp-q2")
