"""The servers `bench/disagg.py --mode serve` compares, as real processes: a unified tokenloom server, and a
prefill server + a decode server behind SGLang's Rust router (`sglang_router.launch_router
--pd-disaggregation --prefill URL BOOTSTRAP_PORT --decode URL`).

Lifecycle: `Deployment.start()` starts its processes (servers first, healthy, then the router, ready once it
has answered a /generate), `stop()` ends them all; `stop()` is safe to call at any point, also after a
failed start, and more than once. Every process is started in its own session and stopped as a process
group (SIGTERM, SIGKILL if it lingers), so a server's scheduler and detokenizer go with it. Logs go to files
in the run's log folder; a process that dies during start-up raises with its log's tail.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any

from bench.common import stop_process_group

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STARTUP_TIMEOUT_S = 600
PROBE = {"text": "hi", "sampling_params": {"temperature": 0, "max_new_tokens": 1}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_json(method: str, url: str, body: Any = None, timeout: float = 30) -> tuple[int, Any]:
    """(status, parsed JSON or text); 0 when nothing answered."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            status, text = resp.status, resp.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode(errors="replace")
    except (urllib.error.URLError, OSError):
        return 0, ""
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text


def group_cpu_s(pgid: int) -> float:
    """User + system CPU seconds of the live processes in process group `pgid` (from /proc/PID/stat)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # fields after the name: state ppid pgrp ... utime (12) stime (13)
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


def machine_busy_s() -> float:
    """CPU seconds the whole machine has spent busy since boot (from /proc/stat; idle and iowait excluded)."""
    with open("/proc/stat") as f:
        fields = [float(v) for v in f.readline().split()[1:9]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


class Proc:
    """One process of a deployment, in its own session, its output in `log_dir/name.log`."""

    def __init__(self, name: str, cmd: list[str], log_dir: str) -> None:
        self.name, self.cmd = name, cmd
        self.log_path = os.path.join(log_dir, f"{name}.log")
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.log_path, "w") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(self.cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, chars: int = 3000) -> str:
        try:
            with open(self.log_path) as f:
                return f.read()[-chars:]
        except OSError:
            return ""

    def wait_until(self, ready: Any, what: str, timeout: float = STARTUP_TIMEOUT_S) -> None:
        """Poll `ready()` until it is true; raise if the process exits or the time runs out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                code = self.proc.returncode if self.proc else None
                raise RuntimeError(f"{self.name} exited ({code}) before {what} (log {self.log_path}):\n"
                                   f"{self.log_tail()}")
            if ready():
                return
            time.sleep(0.5)
        raise TimeoutError(f"{self.name}: not {what} after {timeout:.0f} s (log {self.log_path})")

    def cpu_s(self) -> float:
        """CPU seconds used so far by the live processes of this process's group (its session)."""
        if self.proc is None:
            return 0.0
        return group_cpu_s(self.proc.pid)

    def stop(self) -> None:
        """SIGTERM to the process group, SIGKILL after 30 s; nothing is left of it afterwards."""
        if self.proc is None:
            return
        stop_process_group(self.proc, 30)
        self.proc = None


class Server(Proc):
    """`python -m tokenloom.launch_server FLAGS --port P` on a free port."""

    def __init__(self, name: str, flags: list[str], log_dir: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        super().__init__(name, [sys.executable, "-m", "tokenloom.launch_server", *flags, "--host", "127.0.0.1",
                                "--port", str(self.port)], log_dir)

    def wait_healthy(self) -> None:
        self.wait_until(lambda: http_json("GET", self.url + "/health", timeout=10)[0] == 200, "healthy")

    def server_info(self) -> dict[str, Any]:
        status, info = http_json("GET", self.url + "/get_server_info")
        if status != 200 or not isinstance(info, dict):
            raise RuntimeError(f"{self.name}: /get_server_info answered {status}: {str(info)[:300]}")
        return info


class Router(Proc):
    """SGLang's Rust router in PD mode in front of one prefill and one decode server."""

    def __init__(self, prefill: Server, bootstrap_port: int, decode: Server, log_dir: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        super().__init__("router", [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
                                    "--host", "127.0.0.1", "--port", str(self.port), "--prefill", prefill.url,
                                    str(bootstrap_port), "--decode", decode.url, "--policy", "round_robin",
                                    "--prometheus-port", str(free_port()), "--log-level", "warn"], log_dir)

    def wait_ready(self) -> None:
        self.wait_until(lambda: http_json("POST", self.url + "/generate", PROBE, timeout=60)[0] == 200,
                        "serving through the router")


class Deployment:
    """What the benchmark client talks to (`url`) and the servers whose counters explain a run."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.procs: list[Proc] = []
        self.url = ""

    def servers(self) -> dict[str, Server]:
        return {p.name: p for p in self.procs if isinstance(p, Server)}

    def server_info(self) -> dict[str, dict[str, Any]]:
        return {name: s.server_info() for name, s in self.servers().items()}

    def cpu_s(self) -> float:
        return sum(p.cpu_s() for p in self.procs)

    def dead(self) -> list[str]:
        return [p.name for p in self.procs if not p.alive()]

    def stop(self) -> None:
        for p in reversed(self.procs):  # the router first, so it sends nothing to a stopping server
            p.stop()


def unified(flags: list[str], threads: int, log_dir: str) -> Deployment:
    """A started unified server with `flags` and `threads` forward threads."""
    dep = Deployment("unified")
    try:
        server = Server("unified", [*flags, "--num-threads", str(threads)], log_dir)
        dep.procs.append(server)
        server.start()
        server.wait_healthy()
        dep.url = server.url
    except BaseException:
        dep.stop()
        raise
    return dep


def pd_pair(flags: list[str], threads: int, backend: str, log_dir: str) -> Deployment:
    """A started prefill + decode pair (`flags`, `threads` forward threads each, transfer `backend`) behind
    the router; the two servers start side by side."""
    dep = Deployment("pd")
    try:
        bootstrap = free_port()
        common = [*flags, "--num-threads", str(threads), "--disaggregation-transfer-backend", backend]
        prefill = Server("prefill", [*common, "--disaggregation-mode", "prefill",
                                     "--disaggregation-bootstrap-port", str(bootstrap)], log_dir)
        decode = Server("decode", [*common, "--disaggregation-mode", "decode"], log_dir)
        dep.procs += [prefill, decode]
        prefill.start()
        decode.start()
        prefill.wait_healthy()
        decode.wait_healthy()
        router = Router(prefill, bootstrap, decode, log_dir)
        dep.procs.append(router)
        router.start()
        router.wait_ready()
        dep.url = router.url
    except BaseException:
        dep.stop()
        raise
    return dep
