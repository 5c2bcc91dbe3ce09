"""The servers `bench/serve_vs_peers.py` compares: their names, the command that starts each, and how the
client talks to it.

Engines (each skipped with a note when it is not installed, its file cannot be made, or it does not start):
- tokenloom-bf16 (`tokenloom` is another name for it, the engine of the earlier runs): `python -m
  tokenloom.launch_server` on a Hugging Face folder of the default GGUF's weights dequantized to bf16.
- tokenloom-q4_1, tokenloom-q8_0, tokenloom-q4_k_m: tokenloom on the very GGUF file llama.cpp-q4_1 /
  llama.cpp-q8_0 / llama.cpp-q4_k_m serve
  (`--model-path FILE.gguf`, the file's types kept: tokenloom's default for a GGUF since issue 30).
- tokenloom-1b-q4_k_m, tokenloom-1b-q8_0 and llama.cpp-1b-q4_k_m, llama.cpp-1b-q8_0: the ~1B bandwidth-bound
  model of `bench/llama1b.py`, the same file for both servers.
- transformers: `transformers serve --continuous-batching` on the bf16 folder.
- llama.cpp-bf16, llama.cpp-q8_0, llama.cpp-q4_1, llama.cpp-q4_k_m: `llama-server` on the default model's GGUFs
  (`bench/llama_server.py`).
Group names for `--engines`: `llama.cpp` (its four default-model GGUFs), `pairs` (tokenloom and llama.cpp on
the Q4_1 and the Q8_0 file, and tokenloom-bf16), `1b` (both servers on both ~1B files).

Invariants: every engine that serves a GGUF file has `file` set to it (the weight-bound arithmetic reads the
file); a tokenloom engine and a llama.cpp engine whose names end alike serve the same file.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from bench.common import stop_process_group
from bench.llama_server import GGUF_KINDS, ensure_ggufs, find_llama_server, find_quantize, server_cmd

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
STARTUP_TIMEOUT_S = 600
LLAMA_ENGINES = tuple(f"llama.cpp-{kind}" for kind in GGUF_KINDS)
FILE_KINDS = ("q4_1", "q8_0", "q4_k_m")  # the default model's files both servers run
PAIR_KINDS = ("q4_1", "q8_0")  # the `pairs` group's
L1B_KINDS = ("q4_k_m", "q8_0")
TOKENLOOM_FILE_ENGINES = tuple(f"tokenloom-{kind}" for kind in FILE_KINDS)
L1B_ENGINES = tuple(f"{server}-1b-{kind}" for kind in L1B_KINDS for server in ("tokenloom", "llama.cpp"))
ENGINES = ("tokenloom-bf16", *TOKENLOOM_FILE_ENGINES, "transformers", *LLAMA_ENGINES, *L1B_ENGINES)
ALIASES = {
    "tokenloom": ("tokenloom-bf16",),
    "llama.cpp": LLAMA_ENGINES,
    "pairs": (*(f"{s}-{k}" for k in PAIR_KINDS for s in ("tokenloom", "llama.cpp")), "tokenloom-bf16"),
    "1b": L1B_ENGINES,
}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_status(url: str, timeout: float = 10) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError):
        return 0


def http_json(url: str, timeout: float = 10) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return json.loads(resp.read())
    except (urllib.error.URLError, OSError, ValueError):
        return None


@dataclass
class Engine:
    """One server under test: how to start it and how the client talks to it."""

    name: str
    cmd: list[str]
    health_path: str
    backend: str
    model: str
    extra_client_flags: Any  # callable(output_len) -> list[str]
    file: str | None = None  # the GGUF it serves, when it serves one
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None
    log_path: str = ""
    startup_s: float = 0.0
    weight_bytes: int | None = None  # what the server reports holding for its weights (after start)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, log_dir: str, wl: Any, tag: str = "") -> None:
        """Start on a fresh port; `{np}` / `{ctx}` in the command become the workload's slots and total context."""
        self.port = free_port()
        self.log_path = os.path.join(log_dir, f"server_{wl.key}_{self.name}{tag}.log")
        fill = {"{port}": str(self.port), "{np}": str(wl.concurrency), "{ctx}": str(wl.concurrency * wl.slot_ctx)}
        cmd = [fill.get(c, c) for c in self.cmd]
        log = open(self.log_path, "w")  # noqa: SIM115 - lives as long as the server
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = t0 + STARTUP_TIMEOUT_S
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} server exited with {self.proc.returncode} during startup "
                                   f"(log: {self.log_path}): {self.log_tail()}")
            if http_status(self.url + self.health_path) == 200:
                self.startup_s = time.perf_counter() - t0
                self.weight_bytes = self._reported_weight_bytes()
                return
            time.sleep(1.0)
        raise RuntimeError(f"{self.name} server not healthy after {STARTUP_TIMEOUT_S} s (log: {self.log_path})")

    def _reported_weight_bytes(self) -> int | None:
        """tokenloom: `weight_bytes` of /get_server_info; llama-server: its log's model buffer sizes."""
        if self.backend == "tokenloom":
            info = http_json(self.url + "/get_server_info") or {}
            value = info.get("weight_bytes")
            return int(value) if isinstance(value, (int, float)) else None
        if self.name.startswith("llama.cpp") and self.file:
            return llama_weight_bytes(self.cmd[0], self.file)
        return None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 3) -> str:
        try:
            with open(self.log_path) as f:
                return " | ".join(x.strip() for x in f.read().splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        """SIGTERM to the server's own process group (it was started in a new session), SIGKILL if it lingers."""
        if self.proc is None:
            return
        stop_process_group(self.proc, 60)
        self.proc = None


_LLAMA_WEIGHT_BYTES: dict[tuple[str, str], int | None] = {}


def llama_weight_bytes(exe: str, gguf: str) -> int | None:
    """The model buffer bytes llama-server reports for `gguf`, from one short start of its own (once per file):
    it logs them only at verbosity 4 (`-lv 4`), which the measured servers do not run with, so their per-token
    logging stays as it is."""
    from bench.gguf_bound import llama_server_weight_bytes

    key = (exe, gguf)
    if key not in _LLAMA_WEIGHT_BYTES:
        port = free_port()
        with tempfile.TemporaryFile("w+") as log:
            proc = subprocess.Popen([exe, "-m", gguf, "-np", "1", "-c", "512", "-t", "2", "--host", "127.0.0.1",
                                     "--port", str(port), "-lv", "4"], stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                deadline = time.perf_counter() + STARTUP_TIMEOUT_S
                while proc.poll() is None and time.perf_counter() < deadline:
                    if http_status(f"http://127.0.0.1:{port}/health") == 200:
                        break
                    time.sleep(0.5)
            finally:
                stop_process_group(proc, 30)
            log.seek(0)
            _LLAMA_WEIGHT_BYTES[key] = llama_server_weight_bytes(log.read())
    return _LLAMA_WEIGHT_BYTES[key]


def tokenloom_engine(name: str, model_path: str, extra_flags: list[str], file: str | None = None) -> Engine:
    """tokenloom with a KV pool of llama-server's size for the workload (`{ctx}` tokens): the same capacity
    for both, and a pool sized from the free memory of a machine other jobs share can end in the OOM killer."""
    return Engine(name, [PY, "-m", "tokenloom.launch_server", "--model-path", model_path, "--host", "127.0.0.1",
                         "--port", "{port}", "--max-running-requests", "256", "--max-total-tokens", "{ctx}",
                         "--log-level", "warning", *extra_flags], "/health", "tokenloom", model_path,
                  lambda out_len: [], file=file)


def llama_engine(name: str, exe: str, gguf: str) -> Engine:
    body = json.dumps({"timings_per_token": True})  # per-chunk token counts, for exact per-token ITL
    return Engine(name, server_cmd(exe, gguf), "/health", "openai", gguf,
                  lambda out_len: ["--extra-request-body", body], file=gguf)


def parse_variant(text: str) -> tuple[str, list[str]]:
    """`NAME=FLAGS` -> (NAME, FLAGS split like a shell would)."""
    import argparse
    import shlex

    name, sep, flags = text.partition("=")
    if not sep or not name.strip() or name.strip() in (*ENGINES, *ALIASES):
        raise argparse.ArgumentTypeError(f"--variant wants NAME=FLAGS with a new name, got {text!r}")
    return name.strip(), shlex.split(flags)


def expand_engine_names(text: str) -> list[str]:
    """The --engines list with group names expanded (`ALIASES`), in order, each once; unknown names exit."""
    names: list[str] = []
    for name in (n.strip() for n in text.split(",")):
        for n in (ALIASES.get(name, (name,)) if name else ()):
            if n not in ENGINES:
                raise SystemExit(f"unknown engine {n!r} (choose from {', '.join(ENGINES)}, or a group: "
                                 f"{', '.join(ALIASES)})")
            if n not in names:
                names.append(n)
    return names


def _transformers_engine(hf: str, notes: list[str]) -> Engine | None:
    exe = shutil.which("transformers", path=os.path.dirname(PY)) or shutil.which("transformers")
    help_text = subprocess.run([exe, "serve", "--help"], capture_output=True, text=True).stdout if exe else ""
    if "--continuous-batching" not in help_text:
        notes.append("transformers: skipped (no `transformers serve --continuous-batching` in this install)")
        return None
    body = json.dumps({"generation_config": json.dumps({"do_sample": False})})
    return Engine("transformers", [exe, "serve", "--continuous-batching", "--device", "cpu", "--dtype", "bfloat16",
                                   "--cb-max-memory-percent", "0.25", "--host", "127.0.0.1", "--port", "{port}",
                                   "--log-level", "warning", hf],
                  "/health", "openai", hf, lambda out_len: ["--disable-ignore-eos", "--extra-request-body", body])


def _files(names: list[str], gguf: str, llama_server: str | None, notes: list[str]) -> dict[str, str]:
    """{file kind: GGUF path} for what the wanted engines serve ("q4_1", "bf16", "1b-q8_0", ...)."""
    kinds = {n.split("-", 1)[1] for n in names if n.startswith(("llama.cpp-", "tokenloom-")) and n != "tokenloom-bf16"}
    files: dict[str, str] = {}
    if kinds & {"q4_1"}:
        files["q4_1"] = gguf
    exe = find_llama_server(llama_server)
    if kinds & {"bf16", "q8_0", "q4_k_m"}:
        if exe is None:
            notes.append("q8_0/bf16 files: not made (no llama-server: build it as bench/llama_server.py says)")
        else:
            files.update(ensure_ggufs(gguf, find_quantize(exe), notes,
                                      tuple(k for k in ("bf16", "q8_0", "q4_k_m") if k in kinds)))
    if any(k.startswith("1b-") for k in kinds):
        from bench.llama1b import ensure_llama1b

        files.update({f"1b-{k}": p for k, p in ensure_llama1b(llama_server, notes).items()})
    return files


def build_engines(names: list[str], hf: str, gguf: str, llama_server: str | None, notes: list[str]) -> list[Engine]:
    """The wanted engines, in `names` order, leaving out (with a note) those whose server or file is missing."""
    files = _files(names, gguf, llama_server, notes)
    exe = find_llama_server(llama_server) if any(n.startswith("llama.cpp") for n in names) else None
    if exe is None and any(n.startswith("llama.cpp") for n in names):
        notes.append("llama.cpp: skipped (no llama-server: pass --llama-server PATH or build it as "
                     "bench/llama_server.py says)")
    engines: list[Engine] = []
    for name in names:
        server, _, kind = name.partition("-")
        if name == "tokenloom-bf16":
            engines.append(tokenloom_engine(name, hf, []))
        elif name == "transformers":
            engine = _transformers_engine(hf, notes)
            engines += [engine] if engine else []
        elif kind not in files:
            if exe is not None or server == "tokenloom":
                notes.append(f"{name}: skipped (no {kind} file)")
        elif server == "tokenloom":
            engines.append(tokenloom_engine(name, files[kind], [], file=files[kind]))
        elif exe is not None:
            engines.append(llama_engine(name, exe, files[kind]))
    return engines
