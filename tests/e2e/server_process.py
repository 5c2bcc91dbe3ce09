"""A tokenloom HTTP server run as a real subprocess on a free port, for the end-to-end tests, plus small
stdlib HTTP helpers (so the tests need no client beyond aiohttp and openai)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STARTUP_TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(method: str, url: str, body: Any = None, headers: dict[str, str] | None = None,
         raw: bytes | None = None, timeout: float = 60) -> tuple[int, Any]:
    """(status, parsed JSON body or text). `body` is sent as JSON; `raw` as given."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    hdrs = {"Content-Type": "application/json"} if body is not None else {}
    hdrs.update(headers or {})
    request = urllib.request.Request(url, data=data, method=method, headers=hdrs)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            status, text = resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text


POOL_FLAGS = {"--max-total-tokens", "--mem-fraction-static"}
TEST_POOL_TOKENS = "65536"  # a tiny model's pool for any test: ~16 MiB
PORT_RETRIES = 3  # restarts of a server whose free port was taken before it bound it (by another process's bind)


class ServerProcess:
    def __init__(self, *flags: str, module: str = "tokenloom.launch_server", env: dict[str, str] | None = None) -> None:
        """`env`: variables added to this process's environment for the server (test hooks)."""
        self.flags, self.module, self.env = flags, module, env
        self.port_retries = PORT_RETRIES
        self._start()

    def _start(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - lives as long as the server
            "w+", prefix="tokenloom-server-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", self.module, *self.flags, "--port", str(self.port)]
        if self.module == "tokenloom.launch_server" and not POOL_FLAGS.intersection(self.flags):
            # the default pool is a quarter of free memory (GiBs to zero at each start, and several servers at
            # once here); tests that are about the pool's size say so with their own flag
            cmd += ["--max-total-tokens", TEST_POOL_TOKENS]
        if "--log-level" not in self.flags:
            cmd += ["--log-level", "warning"]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **self.env} if self.env else None)

    def _lost_its_port(self) -> bool:
        """The server exited because its HTTP port, free when picked, was bound by someone else meanwhile (many
        servers and their engines bind random ports at once here)."""
        logs = self.logs()
        return f"could not start on 127.0.0.1:{self.port}" in logs and "address already in use" in logs

    def wait_healthy(self, timeout: float = STARTUP_TIMEOUT_S) -> ServerProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                if self.port_retries > 0 and self._lost_its_port():
                    self.port_retries -= 1
                    self._start()
                    continue
                raise RuntimeError(f"server exited with {self.proc.returncode} during startup:\n{self.logs()}")
            try:
                if http("GET", self.url + "/health", timeout=30)[0] == 200:
                    return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not healthy after {timeout} s:\n{self.logs()}")

    def logs(self) -> str:
        with open(self.log.name) as f:
            return f.read()

    def children(self) -> list[int]:
        """Live processes whose parent is the server (scheduler, detokenizer, resource tracker)."""
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == self.proc.pid and fields[0] != "Z":
                found.append(int(entry))
        return found

    def wait_exit(self, timeout: float = 60) -> int:
        return self.proc.wait(timeout=timeout)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def server_info(self, headers: dict[str, str] | None = None) -> dict[str, Any]:
        status, info = http("GET", self.url + "/get_server_info", headers=headers)
        assert status == 200, info
        return info

    def wait_idle_and_pool_full(self, headers: dict[str, str] | None = None, timeout: float = 30) -> dict[str, Any]:
        """Poll /get_server_info until no request runs or waits; then the KV pool must be back to full."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.server_info(headers)
            if info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0:
                break
            assert time.monotonic() < deadline, f"requests still running: {info}"
            time.sleep(0.05)
        assert info["kv_tokens_in_use"] == 0, info
        assert info["available_kv_tokens"] + info["evictable_kv_tokens"] == info["max_total_num_tokens"], info
        return info


def start_pending_request(server: ServerProcess, max_new_tokens: int = 6000) -> tuple[threading.Thread, dict]:
    """A long /generate on its own thread, returned once the server runs it; the thread leaves the
    (status, body) reply in the dict under "reply"."""
    result: dict = {}

    def pending() -> None:
        result["reply"] = http("POST", server.url + "/generate",
                               {"text": "A", "sampling_params": {"max_new_tokens": max_new_tokens,
                                                                 "ignore_eos": True}})

    thread = threading.Thread(target=pending)
    thread.start()
    deadline = time.monotonic() + 30
    while server.server_info()["num_running_reqs"] < 1:
        assert time.monotonic() < deadline, "the request did not start running within 30 s"
        time.sleep(0.05)
    return thread, result


def assert_a_hung_rank_is_named(server: ServerProcess, pid: int, label: str, timeout_s: float) -> None:
    """SIGSTOP `pid` (a rank of `server` started with --dist-timeout `timeout_s`) while a request runs: the
    request answers 503 naming `label` as stopped responding, the server exits 1 within a bound, and no child
    is left (the rank is continued and the server stopped in any case)."""
    try:
        thread, result = start_pending_request(server)
        start = time.monotonic()
        os.kill(pid, signal.SIGSTOP)
        thread.join(timeout=60)
        answered_s = time.monotonic() - start
        status, body = result["reply"]
        assert status == 503, body
        assert f"{label} stopped responding" in body["error"]["message"], body
        # answered once the timeout named the rank, not after the launcher's grace period for stopping it
        assert answered_s < 2 * timeout_s + 5, answered_s
        assert server.wait_exit(timeout=60) == 1
        assert time.monotonic() - start < 4 * timeout_s + 10
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
        server.stop()
    assert not server.children()


def assert_same_answers(url: str, reference_url: str, bodies: list[dict], texts: bool = False) -> None:
    """Every /generate body gets the same output ids (and with `texts`, the same texts) from both servers."""
    for body in bodies:
        status1, ref = http("POST", reference_url + "/generate", body)
        status2, out = http("POST", url + "/generate", body)
        assert status1 == status2 == 200, (ref, out)
        assert [o["output_ids"] for o in out] == [o["output_ids"] for o in ref]
        if texts:
            assert [o["text"] for o in out] == [o["text"] for o in ref]
