"""A tokenloom server on a machine shared with a busy process: decode speed with a background CPU hog
(`python -c "while True: pass"`, normal priority) on vs off, for several server settings side by side.

    .venv/bin/python bench/shared_machine.py                      # before the fix / fixed threads / default
    .venv/bin/python bench/shared_machine.py --quick              # 1 round, 32 new tokens
    .venv/bin/python bench/shared_machine.py --mode spin:OMP_WAIT_POLICY=ACTIVE --mode one:--num-threads=1

Every mode's server (`python -m tokenloom.launch_server`, the default model unless `--model-path`, a small KV
pool) is started first and stays up, idle while another is measured; per round, the modes in a rotating order
and, per mode, the background hog off then on (on then off in odd rounds), each measuring:
- throughput: `--concurrency` (8) requests of `--input-len` random token ids at once, `--output-len` new tokens
  each (`ignore_eos`): output tokens / wall time;
- ITL: one streamed request of `--output-len` tokens: (last chunk - first chunk) / (tokens - 1).
Reported per mode: medians over rounds, and the median over rounds of loaded / unloaded (the slowdown the hog
causes, measured back to back in the same round). The target (issue 30): a slowdown of at most 2.5x with one
hog on two cores (it takes a third of the CPU if shared evenly), and the fix's unloaded speed within noise of
the fix off. `--hogs N` runs N busy processes while the load is on (an oversubscribed machine), each
in its own session (its own autogroup: N shares of the CPU, as N independent jobs would take).

Modes: `NAME:SETTING,SETTING...`, each setting `ENV=VALUE` (in the server's environment, so its rank processes
inherit it) or `--flag=value` / `--flag` (a server flag). Default:
`before:GOMP_SPINCOUNT=300000,--cpu-threads-policy=fixed` (libgomp's own spin and a fixed thread count: a
user's GOMP_SPINCOUNT wins over the launcher's),
`fixed:--cpu-threads-policy=fixed` (the short spin, fixed threads) and `default:` (tokenloom's defaults: the
short spin and the adaptive thread count, tokenloom/executor/cpu_threads.py). Other load on the machine
moves absolute numbers: compare the ratios. The last stdout line is one JSON object.

`--llama-server [PATH]` adds llama.cpp's own server as one more mode, `llama.cpp`, measured the same way on the
file tokenloom serves by default (the packaged Q4_1 GGUF, or `--model-path` when that is a .gguf): `-np
concurrency` slots, 2 threads, its `/completion` endpoint with the same token ids, `n_predict` and
`ignore_eos`, streamed tokens counted from each chunk's `tokens` (bench/llama_server.py builds the binary).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench.common import stop_process_group  # noqa: E402
from bench.serve_vs_peers import free_port  # noqa: E402

STARTUP_TIMEOUT_S = 600
REQUEST_TIMEOUT_S = 900
HOG = "while True: pass"
# after the hogs end, before the next measurement: a server that adapts to the load (cpu_threads.py measures
# every 0.5 s) sees them gone; the bench measures each state's steady speed, not the transition
SETTLE_S = 1.5
# before: libgomp's own default spin and fixed threads (rank processes before issue 30; a user's GOMP_SPINCOUNT
# wins over the launcher's); fixed: the launcher's short spin, fixed threads; default: tokenloom's defaults
DEFAULT_MODES = ("before:GOMP_SPINCOUNT=300000,--cpu-threads-policy=fixed", "fixed:--cpu-threads-policy=fixed",
                 "default:")


def parse_mode(spec: str) -> tuple[str, dict[str, str], list[str]]:
    """`NAME:A=1,--flag=2,--switch` -> (NAME, {"A": "1"}, ["--flag", "2", "--switch"])."""
    name, _, settings = spec.partition(":")
    if not name:
        raise SystemExit(f"--mode {spec!r}: no name before ':'")
    env: dict[str, str] = {}
    flags: list[str] = []
    for setting in filter(None, settings.split(",")):
        key, eq, value = setting.partition("=")
        if key.startswith("--"):
            flags += [key, value] if eq else [key]
        elif eq and key:
            env[key] = value
        else:
            raise SystemExit(f"--mode {spec!r}: {setting!r} is neither ENV=VALUE nor --flag[=value]")
    return name, env, flags


class Server:
    """A tokenloom server (SGLang's native `/generate`) of one mode."""

    def __init__(self, name: str, env: dict[str, str], flags: list[str], ns: argparse.Namespace,
                 log_dir: str) -> None:
        self.name = name
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log_path = os.path.join(log_dir, f"server_{name}.log")
        self._start(self._command(flags, ns), env)

    def _command(self, flags: list[str], ns: argparse.Namespace) -> list[str]:
        return [sys.executable, "-m", "tokenloom.launch_server", "--port", self.url.rsplit(":", 1)[1],
                "--max-total-tokens", "8192", "--max-running-requests", str(max(8, ns.concurrency)),
                "--log-level", "warning", *(["--model-path", ns.model_path] if ns.model_path else []), *flags]

    def _start(self, cmd: list[str], env: dict[str, str]) -> None:
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True, cwd=REPO)

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                with open(self.log_path, errors="replace") as f:
                    tail = " | ".join(f.read().strip().splitlines()[-5:])
                raise RuntimeError(f"server {self.name} did not start: {tail}")
            time.sleep(1)

    def stop(self) -> None:
        stop_process_group(self.proc, 30)

    def generate(self, ids: list[int], max_new_tokens: int) -> int:
        """Greedy, `ignore_eos`; the number of tokens generated."""
        out = _post(self.url + "/generate", {"input_ids": ids, "sampling_params": {
            "max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}})
        return len(out["output_ids"])

    def stream(self, ids: list[int], max_new_tokens: int) -> list[tuple[float, int]]:
        """(arrival time, tokens so far) per streamed chunk."""
        body = {"input_ids": ids, "stream": True,
                "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}}
        return [(t, len(chunk["output_ids"])) for t, chunk in _sse(self.url + "/generate", body)]


class LlamaServer(Server):
    """llama.cpp's `llama-server` on a GGUF, with its own `/completion` endpoint."""

    def __init__(self, exe: str, gguf: str, env: dict[str, str], ns: argparse.Namespace, log_dir: str) -> None:
        self.exe, self.gguf = exe, gguf
        super().__init__("llama.cpp", env, [], ns, log_dir)

    def _command(self, flags: list[str], ns: argparse.Namespace) -> list[str]:
        from bench.llama_server import server_cmd

        fill = {"{np}": str(ns.concurrency), "{ctx}": "8192", "{port}": self.url.rsplit(":", 1)[1]}
        return [fill.get(part, part) for part in server_cmd(self.exe, self.gguf)] + flags

    def _body(self, ids: list[int], max_new_tokens: int, stream: bool) -> dict[str, Any]:
        return {"prompt": ids, "n_predict": max_new_tokens, "temperature": 0, "ignore_eos": True,
                "cache_prompt": False, "stream": stream, "return_tokens": True}

    def generate(self, ids: list[int], max_new_tokens: int) -> int:
        return int(_post(self.url + "/completion", self._body(ids, max_new_tokens, False))["tokens_predicted"])

    def stream(self, ids: list[int], max_new_tokens: int) -> list[tuple[float, int]]:
        got, total = [], 0
        for t, chunk in _sse(self.url + "/completion", self._body(ids, max_new_tokens, True)):
            if chunk.get("tokens"):
                total += len(chunk["tokens"])
                got.append((t, total))
        return got


def _post(url: str, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as resp:
        return json.loads(resp.read())


def _sse(url: str, body: dict[str, Any]) -> list[tuple[float, dict[str, Any]]]:
    """(arrival time, parsed JSON) of each server-sent `data:` line but the closing `[DONE]`."""
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    chunks = []
    with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data:") and line != "data: [DONE]":
                chunks.append((time.perf_counter(), json.loads(line[5:])))
    return chunks


def _prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(1000, 40000) for _ in range(length)]


def throughput(server: Server, ns: argparse.Namespace, rng: random.Random) -> float:
    """Output tokens per second of `concurrency` requests sent at once."""
    prompts = [_prompt(rng, ns.input_len) for _ in range(ns.concurrency)]
    counts = [0] * len(prompts)

    def one(i: int) -> None:
        counts[i] = server.generate(prompts[i], ns.output_len)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    if min(counts) != ns.output_len:
        raise RuntimeError(f"requests returned {counts} tokens; expected {ns.output_len} each")
    return sum(counts) / wall


def itl_ms(server: Server, ns: argparse.Namespace, rng: random.Random) -> float:
    """Mean inter-token latency of one streamed request: (last chunk - first chunk) / the tokens between."""
    chunks = server.stream(_prompt(rng, ns.input_len), ns.output_len)
    tokens = chunks[-1][1] if chunks else 0
    if tokens != ns.output_len or len(chunks) < 2:
        raise RuntimeError(f"streamed {tokens} tokens in {len(chunks)} chunks; expected {ns.output_len}")
    return 1000 * (chunks[-1][0] - chunks[0][0]) / (tokens - chunks[0][1])


def start_hogs(count: int) -> list[subprocess.Popen]:
    # each in its own session: Linux's autogroup scheduling shares the CPU between sessions first, so hogs of
    # one session would together take one share, like one hog
    hogs = [subprocess.Popen([sys.executable, "-c", HOG], start_new_session=True) for _ in range(count)]
    time.sleep(0.5)  # let them take their share before the measurement starts
    return hogs


def measure(server: Server, hog_on: bool, ns: argparse.Namespace, rng: random.Random) -> dict[str, float]:
    hogs = start_hogs(ns.hogs) if hog_on else []
    try:
        return {"tok_s": throughput(server, ns, rng), "itl_ms": itl_ms(server, ns, rng)}
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
        if hogs:
            time.sleep(SETTLE_S)


def summarize(rounds: list[dict[str, dict[str, float]]]) -> dict[str, Any]:
    """Medians of each measure with the hog off and on, and the median of the per-round slowdowns."""
    out: dict[str, Any] = {}
    for key in ("tok_s", "itl_ms"):
        off = [r["off"][key] for r in rounds]
        on = [r["on"][key] for r in rounds]
        slow = [(o / h) if key == "tok_s" else (h / o) for o, h in zip(off, on, strict=True)]
        out[key] = {"off": statistics.median(off), "on": statistics.median(on), "slowdown": statistics.median(slow),
                    "rounds_off": off, "rounds_on": on}
    return out


def _llama_server(ns: argparse.Namespace, log_dir: str) -> LlamaServer:
    """llama-server on the GGUF tokenloom serves by default (or `--model-path` when it is a .gguf)."""
    from bench.llama_server import find_llama_server
    from tokenloom.models.default_model import default_model_file

    exe = find_llama_server(ns.llama_server or None)
    if exe is None:
        raise SystemExit("--llama-server: no llama-server found (build it as bench/llama_server.py says)")
    if ns.model_path and not ns.model_path.endswith(".gguf"):
        raise SystemExit("--llama-server needs a .gguf --model-path (or none: the default model's file)")
    return LlamaServer(exe, ns.model_path or default_model_file(), {}, ns, log_dir)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", action="append", default=None, help="NAME:SETTING,... (repeatable)")
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--hogs", type=int, default=1, help="busy processes while the load is on (default 1)")
    ap.add_argument("--quick", action="store_true", help="1 round, 32 new tokens")
    ap.add_argument("--llama-server", nargs="?", const="", default=None, metavar="PATH",
                    help="also measure llama-server (found as bench/llama_server.py says, or PATH)")
    ns = ap.parse_args()
    if ns.quick:
        ns.rounds, ns.output_len = 1, 32
    modes = [parse_mode(m) for m in (ns.mode or DEFAULT_MODES)]
    log_dir = tempfile.mkdtemp(prefix="tokenloom-bench-shared-")
    servers = [Server(name, env, flags, ns, log_dir) for name, env, flags in modes]
    if ns.llama_server is not None:
        servers.append(_llama_server(ns, log_dir))
    rng = random.Random(0)
    results: dict[str, list[dict[str, dict[str, float]]]] = {s.name: [] for s in servers}
    try:
        for server in servers:
            server.wait_healthy()
            server.generate(_prompt(rng, ns.input_len), 4)  # warm-up
        for r in range(ns.rounds):
            order = servers[r % len(servers):] + servers[: r % len(servers)]
            for server in order:
                hog_order = (False, True) if r % 2 == 0 else (True, False)
                got = {("on" if on else "off"): measure(server, on, ns, rng) for on in hog_order}
                results[server.name].append(got)
                print(f"round {r + 1} {server.name:>8s}: hog off {got['off']['tok_s']:7.1f} tok/s "
                      f"{got['off']['itl_ms']:6.1f} ms ITL | hog on {got['on']['tok_s']:7.1f} tok/s "
                      f"{got['on']['itl_ms']:6.1f} ms ITL", flush=True)
    finally:
        for server in servers:
            server.stop()
    report: dict[str, Any] = {"bench": "shared_machine", "cores": len(os.sched_getaffinity(0)),
                              "hogs": ns.hogs, "rounds": ns.rounds, "concurrency": ns.concurrency,
                              "output_len": ns.output_len,
                              "modes": {}}
    print(f"\n{'mode':>8s} {'tok/s off':>10s} {'tok/s on':>9s} {'slowdown':>9s} {'ITL off':>8s} {'ITL on':>7s} "
          f"{'slowdown':>9s}")
    for name, rounds in results.items():
        s = summarize(rounds)
        report["modes"][name] = s
        print(f"{name:>8s} {s['tok_s']['off']:10.1f} {s['tok_s']['on']:9.1f} {s['tok_s']['slowdown']:8.2f}x "
              f"{s['itl_ms']['off']:8.1f} {s['itl_ms']['on']:7.1f} {s['itl_ms']['slowdown']:8.2f}x")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
