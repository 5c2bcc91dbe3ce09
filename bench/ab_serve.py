"""Batch-1 ITL of two tokenloom servers side by side, alternating rounds in one run: what a change costs served.

    .venv/bin/python bench/ab_serve.py --base-dir /path/to/old/checkout               # this tree against it
    .venv/bin/python bench/ab_serve.py --base-dir . --new-env GLIBC_TUNABLES=glibc.malloc.hugetlb=0
    .venv/bin/python bench/ab_serve.py --base-dir /old --model /path/to/file.gguf --rounds 8 --quick
    .venv/bin/python bench/ab_serve.py --base-dir /old --model /path/to/hf --server-args "--torchao-config int8wo"

Why: `bench/ab_decode.py` times the decode step inside one process; a served token also pays for the scheduler's
Python step, the process hops and the memory the serving processes touch after the step's weight stream, and
on this machine a single run of `bench/serve_vs_peers.py` drifts more than a 5% change. Here both servers run
at once (each from its own checkout, with its own environment additions); round r sends `--requests`
sequential streamed /generate requests (random `--prompt-len` token prompts, greedy, `--output-len` tokens,
ignore_eos) to one server, then the same prompts to the other (who goes first alternates), after one short
warm-up request each. A request's ITL is (last chunk − first chunk) / (chunks − 1); a round's figure is the
median over its requests, and the result is the median over rounds of the within-round ratio new / base,
next to each side's median; the tail too: per round the 99th percentile and the largest gap between two
chunks over its requests, their medians over rounds. The idle server is idle: each round measures one server
alone. Each side's CPU time per generated token is measured too (Linux: /proc/<pid>/task/*/schedstat over its
round's requests, warm-up excluded), for the HTTP server process and for its children (the scheduler rank: the
step's threads): on two cores what the server process spends beside the step is taken from the step, and its
CPU time varies much less from round to round than the ITL. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import stop_process_group  # noqa: E402
from bench.peer_engines import free_port, http_status  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
READY_TIMEOUT_S = 300
REQUEST_TIMEOUT_S = 300


def parse_env(items: list[str]) -> dict[str, str]:
    """KEY=VALUE strings as a dict (a bad item is a usage error)."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"expected KEY=VALUE, got {item!r}")
        out[key] = value
    return out


class Server:
    """`python -m tokenloom.launch_server` started from `checkout` (its code is the one imported)."""

    def __init__(self, name: str, checkout: str, model: str, env_extra: dict[str, str], log_dir: str,
                 server_args: list[str]) -> None:
        self.name, self.port = name, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = os.path.join(log_dir, f"server_{name}.log")
        cmd = [sys.executable, "-m", "tokenloom.launch_server", "--model-path", model, "--host", "127.0.0.1",
               "--port", str(self.port), "--max-total-tokens", "2048", "--log-level", "warning", *server_args]
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, cwd=checkout, env={**os.environ, **env_extra}, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; see {self.log_path}")
            if http_status(self.url + "/health", timeout=2) == 200:
                return
            time.sleep(1)
        raise RuntimeError(f"{self.name} not ready after {READY_TIMEOUT_S} s; see {self.log_path}")

    def stop(self) -> None:
        stop_process_group(self.proc, term_timeout_s=30)

    def cpu_ns(self) -> tuple[int, int]:
        """CPU time so far (ns) of the HTTP server process and of its child processes, all threads; (0, 0) where
        /proc cannot tell (not Linux)."""
        try:
            children = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout
        except OSError:
            return 0, 0
        return _process_cpu_ns(self.proc.pid), sum(_process_cpu_ns(int(c)) for c in children.split())

    def generate(self, ids: list[int], output_len: int) -> tuple[float, float, list[float]]:
        """(TTFT s, ITL s, every gap between two chunks s) of one streamed greedy request."""
        body = json.dumps({"input_ids": ids, "stream": True, "sampling_params": {
            "temperature": 0, "max_new_tokens": output_len, "ignore_eos": True}}).encode()
        request = urllib.request.Request(self.url + "/generate", data=body,
                                         headers={"Content-Type": "application/json"})
        start, chunks = time.perf_counter(), []
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as resp:
            for line in resp:
                if line.startswith(b"data:") and not line.startswith(b"data: [DONE]"):
                    chunks.append(time.perf_counter())
        if len(chunks) < 2:
            raise RuntimeError(f"{self.name}: {len(chunks)} chunks streamed for {output_len} tokens")
        gaps = [b - a for a, b in zip(chunks, chunks[1:], strict=False)]
        return chunks[0] - start, (chunks[-1] - chunks[0]) / (len(chunks) - 1), gaps


def _process_cpu_ns(pid: int) -> int:
    """Run time of every thread of `pid` (ns, from /proc/<pid>/task/*/schedstat); 0 when unreadable. Not
    executor/process_tree.py's /proc/<pid>/stat reading: that counts 10 ms clock ticks, and a server process's
    share of one round is ~80 ms."""
    total = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass
    return total


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-dir", required=True, help="a checkout of the baseline")
    p.add_argument("--new-dir", default=REPO, help="the checkout measured against it (default: this tree)")
    p.add_argument("--base-env", action="append", default=[], metavar="KEY=VALUE", help="added to the base server's")
    p.add_argument("--new-env", action="append", default=[], metavar="KEY=VALUE", help="added to the new server's")
    p.add_argument("--model", default=None, help="model path for both (default: the packaged default GGUF)")
    p.add_argument("--base-model", default=None, help="another model for the base server (default: --model): "
                   "two checkpoints of one model side by side, e.g. with --base-dir .")
    p.add_argument("--server-args", default="", help="more server flags for both, one string "
                   "(e.g. \"--torchao-config int4wo-64\")")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--requests", type=int, default=4, help="sequential requests per server per round")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="2 rounds of 2 requests of 32 tokens")
    args = p.parse_args()
    if args.quick:
        args.rounds, args.requests, args.output_len = 2, 2, 32
    if args.model is None:
        from tokenloom.models.default_model import default_model_file
        args.model = str(default_model_file())
    log_dir = tempfile.mkdtemp(prefix="ab_serve-")
    extra = shlex.split(args.server_args)
    servers = {"base": Server("base", os.path.abspath(args.base_dir), args.base_model or args.model,
                              parse_env(args.base_env), log_dir, extra),
               "new": Server("new", os.path.abspath(args.new_dir), args.model, parse_env(args.new_env), log_dir,
                             extra)}
    rng = random.Random(args.seed)
    itl: dict[str, list[float]] = {"base": [], "new": []}
    ttft: dict[str, list[float]] = {"base": [], "new": []}
    tail: dict[str, dict[str, list[float]]] = {name: {"p99": [], "max": []} for name in ("base", "new")}
    cpu_us: dict[str, dict[str, list[float]]] = {name: {"server": [], "children": []} for name in ("base", "new")}
    try:
        for server in servers.values():
            server.wait_ready()
        print(f"batch-1 ITL, {args.rounds} rounds x {args.requests} requests of {args.prompt_len}/{args.output_len}, "
              f"base {args.base_dir} vs {args.new_dir}; logs in {log_dir}", flush=True)
        for r in range(args.rounds):
            prompts = [[rng.randrange(100, 30000) for _ in range(args.prompt_len)] for _ in range(args.requests)]
            for name in (("base", "new") if r % 2 == 0 else ("new", "base")):
                servers[name].generate(prompts[0][:32], 8)  # warm-up: the idle server's threads wake
                before = servers[name].cpu_ns()
                results = [servers[name].generate(ids, args.output_len) for ids in prompts]
                after = servers[name].cpu_ns()
                tokens = len(prompts) * args.output_len
                cpu_us[name]["server"].append((after[0] - before[0]) / tokens / 1e3)
                cpu_us[name]["children"].append((after[1] - before[1]) / tokens / 1e3)
                itl[name].append(statistics.median(x[1] for x in results) * 1e3)
                ttft[name].append(statistics.median(x[0] for x in results) * 1e3)
                gaps = sorted(g for x in results for g in x[2])
                tail[name]["p99"].append(gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))] * 1e3)
                tail[name]["max"].append(gaps[-1] * 1e3)
            print(f"round {r + 1}: base {itl['base'][-1]:.2f} ms, new {itl['new'][-1]:.2f} ms, "
                  f"new/base {itl['new'][-1] / itl['base'][-1]:.3f}", flush=True)
    finally:
        for server in servers.values():
            server.stop()
    ratios = [n / b for n, b in zip(itl["new"], itl["base"], strict=True)]
    print(f"median ITL: base {statistics.median(itl['base']):.2f} ms, new {statistics.median(itl['new']):.2f} ms; "
          f"new/base {statistics.median(ratios):.3f} (rounds {min(ratios):.3f}-{max(ratios):.3f})", flush=True)
    tails = {name: {q: statistics.median(values) for q, values in parts.items()} for name, parts in tail.items()}
    print(f"median over rounds of a round's p99 / max gap between chunks: base {tails['base']['p99']:.2f} / "
          f"{tails['base']['max']:.2f} ms, new {tails['new']['p99']:.2f} / {tails['new']['max']:.2f} ms", flush=True)
    cpu = {name: {part: statistics.median(values) for part, values in parts.items()} for name, parts in cpu_us.items()}
    print(f"median CPU per token (server process / its children): base {cpu['base']['server']:.0f} / "
          f"{cpu['base']['children']:.0f} us, new {cpu['new']['server']:.0f} / {cpu['new']['children']:.0f} us",
          flush=True)
    print(json.dumps({"bench": "ab_serve", "base": args.base_dir, "new": args.new_dir, "model": args.model,
                      "base_model": args.base_model or args.model,
                      "server_args": args.server_args, "base_env": args.base_env, "new_env": args.new_env,
                      "rounds": args.rounds,
                      "requests": args.requests, "prompt_len": args.prompt_len, "output_len": args.output_len,
                      "base_itl_ms": statistics.median(itl["base"]), "new_itl_ms": statistics.median(itl["new"]),
                      "ratio": statistics.median(ratios), "ratios": ratios,
                      "base_ttft_ms": statistics.median(ttft["base"]), "new_ttft_ms": statistics.median(ttft["new"]),
                      "itl_tail_ms": tails, "cpu_us_per_token": cpu}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
