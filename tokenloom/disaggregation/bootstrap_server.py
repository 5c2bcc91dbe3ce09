"""The prefill server's bootstrap service: where every prefill rank publishes how to reach it and where a
decode server learns the prefill's parallel shape, wire-compatible with SGLang's bootstrap server
(`CommonKVBootstrapServer` in srt/disaggregation/common/conn.py, used as-is by the Mooncake and NIXL backends).

Routes (errors are plain text, as SGLang's are):
- `PUT /route` — a prefill rank registers a JSON object with SGLang's fields (`attn_tp_size/rank`,
  `attn_dp_size/rank`, `pp_size/rank`, `rank_ip`, `rank_port`, `page_size`; optional `role` ("Prefill"),
  `attn_cp_size/rank` (1/0), `system_dp_size/rank` (1/0), `kv_cache_dtype`, `load_balance_method`,
  `prefill_http_port`) plus any fields of ours, stored and returned unchanged. 200 "OK"; 400 for a malformed
  body; 409 when its sizes disagree with earlier registrations or with the number of ranks this server expects.
  A rank that registers again replaces its entry (a restarted rank).
- `GET /route` — with main's parameters `prefill_dp_rank, prefill_cp_rank, target_tp_rank, target_pp_rank`
  or 0.5.9's `engine_rank` (the TP rank), `target_dp_group, target_pp_rank`. All -1: the parallel info, in the
  shape the caller's SGLang version parses (`ParallelInfo`); otherwise that rank's registration. 503 until
  every expected rank has registered (the text says which are missing), 400 for a missing or non-integer
  parameter, 404 for a rank nobody registered. `include_ranks=1` (ours) adds `"ranks"`, every registration,
  to the parallel info; opt-in because main's decode builds a dataclass from that answer and rejects unknown
  fields.
- `POST /register_dp_rank {bootstrap_room, dp_rank}` → "OK"; `POST /query_dp_ranks {bootstrap_rooms: [...]}` →
  `{"<room>": dp_rank}` for the rooms known. At most `max_rooms` rooms are kept (oldest dropped).
- `GET /health` → 200 "OK" (the decode side's heartbeat).

Lifecycle: `start()` returns once the server listens (or raises `BootstrapServerError`), the app runs on its own
thread and event loop, `stop()` closes the socket and joins the thread. Nothing a client sends stops that
thread: handler errors become 4xx/500 answers. The client helpers at the bottom use only the standard library.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import OrderedDict
from typing import Any

from aiohttp import web

logger = logging.getLogger(__name__)

MAX_ROOMS = 100_000
MAX_BODY_BYTES = 8 << 20  # a registration may carry an engine descriptor (NIXL agent metadata: tens of KiB)
_REQUIRED_INT = ("attn_tp_size", "attn_tp_rank", "attn_dp_size", "attn_dp_rank", "pp_size", "pp_rank",
                 "rank_port", "page_size")
_OPTIONAL_INT = {"attn_cp_size": 1, "attn_cp_rank": 0, "system_dp_size": 1, "system_dp_rank": 0}
_MAIN_PARAMS = ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank")
_LEGACY_PARAMS = ("engine_rank", "target_dp_group", "target_pp_rank")

RankKey = tuple[int, int, int, int]  # (dp group, cp rank, tp rank, pp rank), SGLang's table order


class BootstrapServerError(RuntimeError):
    """The bootstrap server could not start (e.g. its port is taken)."""


class BootstrapError(RuntimeError):
    """A bootstrap request failed: the server is unreachable, not ready by the deadline, or refused it.
    `status` is the HTTP status when the server answered."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class _BadRequest(Exception):
    def __init__(self, text: str, status: int = 400):
        super().__init__(text)
        self.status = status


def _as_int(value: Any, name: str) -> int:
    """SGLang's `int(...)` on a field, without its surprises: bools and floats are refused."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            pass
    raise _BadRequest(f"{name} must be an integer, got {value!r}")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _parse_json(body: bytes) -> Any:
    try:
        return json.loads(body, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise _BadRequest(f"body is not JSON: {e}") from None


def _dp_of(reg: dict[str, Any]) -> tuple[int, int]:
    """(dp size, dp group of this rank) as SGLang derives them: system DP when there is one, else attention DP."""
    if reg["system_dp_size"] == 1:
        return reg["attn_dp_size"], reg["attn_dp_rank"]
    return reg["system_dp_size"], reg["system_dp_rank"]


def normalize_registration(data: Any) -> dict[str, Any]:
    """A PUT /route body checked and completed with SGLang's defaults; our extra fields pass through unchanged.
    Raises `_BadRequest` naming the first problem."""
    if not isinstance(data, dict):
        raise _BadRequest("registration must be a JSON object")
    reg = dict(data)
    role = reg.setdefault("role", "Prefill")
    if role != "Prefill":
        raise _BadRequest(f"only Prefill ranks register here, got role={role!r}")
    missing = [name for name in (*_REQUIRED_INT, "rank_ip") if name not in reg]
    if missing:
        raise _BadRequest(f"registration lacks {', '.join(missing)}")
    for name in _REQUIRED_INT:
        reg[name] = _as_int(reg[name], name)
    for name, default in _OPTIONAL_INT.items():
        reg[name] = _as_int(reg.get(name, default), name)
    if not isinstance(reg["rank_ip"], str) or not reg["rank_ip"]:
        raise _BadRequest(f"rank_ip must be a host name, got {reg['rank_ip']!r}")
    if not 0 < reg["rank_port"] < 65536:
        raise _BadRequest(f"rank_port must be a port number, got {reg['rank_port']}")
    if reg["page_size"] < 1:
        raise _BadRequest(f"page_size must be positive, got {reg['page_size']}")
    kv_dtype = reg.setdefault("kv_cache_dtype", None)
    if kv_dtype is not None and not isinstance(kv_dtype, str):
        raise _BadRequest(f"kv_cache_dtype must be a string, got {kv_dtype!r}")
    if reg.get("prefill_http_port") is not None:
        reg["prefill_http_port"] = _as_int(reg["prefill_http_port"], "prefill_http_port")
    dp_size, dp_rank = _dp_of(reg)
    for size, rank, what in ((reg["attn_tp_size"], reg["attn_tp_rank"], "tp"), (dp_size, dp_rank, "dp"),
                             (reg["attn_cp_size"], reg["attn_cp_rank"], "cp"), (reg["pp_size"], reg["pp_rank"], "pp")):
        if size < 1 or not 0 <= rank < size:
            raise _BadRequest(f"{what} rank {rank} is outside a {what} size of {size}")
    return reg


class RankTable:
    """Thread-safe registrations of the prefill ranks, keyed like SGLang's `prefill_port_table`.

    Invariants: every entry agrees on the parallel shape (tp, cp, dp, pp sizes, page size, KV dtype) fixed by
    the first registration, whose sizes multiply to `expected_ranks`; the table is ready once it holds
    `expected_ranks` distinct ranks, and then it stays ready (re-registration replaces an entry).
    """

    def __init__(self, expected_ranks: int):
        if expected_ranks < 1:
            raise ValueError(f"expected_ranks must be at least 1, got {expected_ranks}")
        self.expected_ranks = expected_ranks
        self._lock = threading.Lock()
        self._entries: dict[RankKey, dict[str, Any]] = {}
        self._shape: dict[str, Any] | None = None
        self._extras: dict[str, Any] = {}  # taken from the first registration that has them, as SGLang does

    @staticmethod
    def _shape_of(reg: dict[str, Any]) -> dict[str, Any]:
        return {"attn_tp_size": reg["attn_tp_size"], "attn_cp_size": reg["attn_cp_size"], "dp_size": _dp_of(reg)[0],
                "pp_size": reg["pp_size"], "page_size": reg["page_size"], "kv_cache_dtype": reg["kv_cache_dtype"]}

    def add(self, reg: dict[str, Any]) -> RankKey:
        """Store a normalized registration; `_BadRequest` (409) when it contradicts the shape."""
        shape = self._shape_of(reg)
        key = (_dp_of(reg)[1], reg["attn_cp_rank"], reg["attn_tp_rank"], reg["pp_rank"])
        with self._lock:
            if self._shape is None:
                implied = shape["attn_tp_size"] * shape["attn_cp_size"] * shape["dp_size"] * shape["pp_size"]
                if implied != self.expected_ranks:
                    raise _BadRequest(f"registration implies {implied} prefill ranks (tp {shape['attn_tp_size']} x cp "
                                      f"{shape['attn_cp_size']} x dp {shape['dp_size']} x pp {shape['pp_size']}) but "
                                      f"this bootstrap server expects {self.expected_ranks}", status=409)
                self._shape = shape
            elif shape != self._shape:
                diff = {k: v for k, v in shape.items() if self._shape[k] != v}
                raise _BadRequest(f"registration {diff} disagrees with earlier ranks {self._shape}", status=409)
            self._entries[key] = reg
            if "prefill_http_port" not in self._extras and reg.get("prefill_http_port") is not None:
                self._extras["prefill_http_port"] = reg["prefill_http_port"]
            if "follow_bootstrap_room" not in self._extras:
                method = reg.get("load_balance_method", "follow_bootstrap_room")
                self._extras["follow_bootstrap_room"] = method == "follow_bootstrap_room"
        return key

    def missing(self) -> list[RankKey] | None:
        """The (dp, cp, tp, pp) keys not registered yet; None while no rank has registered (shape unknown)."""
        with self._lock:
            if self._shape is None:
                return None
            s = self._shape
            return [(d, c, t, p) for d in range(s["dp_size"]) for c in range(s["attn_cp_size"])
                    for t in range(s["attn_tp_size"]) for p in range(s["pp_size"]) if (d, c, t, p) not in self._entries]

    def not_ready_reason(self) -> str | None:
        """None when every expected rank has registered, else the 503 text."""
        missing = self.missing()
        count = len(self)
        if missing == []:
            return None
        text = f"Prefill server not fully registered yet ({count} of {self.expected_ranks} ranks registered"
        if missing:
            names = ", ".join(f"dp_rank={d} cp_rank={c} tp_rank={t} pp_rank={p}" for d, c, t, p in missing[:8])
            more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
            text += f"; missing {names}{more}"
        return text + ")."

    def shape(self) -> dict[str, Any]:
        """The parallel shape plus `follow_bootstrap_room` (and `prefill_http_port` when registered)."""
        with self._lock:
            return {**(self._shape or {}), **self._extras}

    def get(self, key: RankKey) -> dict[str, Any] | None:
        with self._lock:
            entry = self._entries.get(key)
            return copy.deepcopy(entry) if entry is not None else None

    def snapshot(self) -> list[dict[str, Any]]:
        """Copies of every registration, ordered by (dp, cp, tp, pp)."""
        with self._lock:
            return [copy.deepcopy(self._entries[k]) for k in sorted(self._entries)]

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)


class RoomTable:
    """bootstrap_room → prefill dp rank (SGLang's `room_to_dp_rank`), at most `max_rooms` entries: the oldest
    registration is dropped first (SGLang expires by age instead; a count bound keeps memory fixed)."""

    def __init__(self, max_rooms: int = MAX_ROOMS):
        self.max_rooms = max_rooms
        self._lock = threading.Lock()
        self._rooms: OrderedDict[int, int] = OrderedDict()

    def put(self, room: int, dp_rank: int) -> None:
        with self._lock:
            self._rooms[room] = dp_rank
            self._rooms.move_to_end(room)
            while len(self._rooms) > self.max_rooms:
                self._rooms.popitem(last=False)

    def query(self, rooms: list[int]) -> dict[str, int]:
        with self._lock:
            return {str(r): self._rooms[r] for r in rooms if r in self._rooms}

    def __len__(self) -> int:
        with self._lock:
            return len(self._rooms)


class ParallelInfo:
    """The all -1 answer in each SGLang version's field names (main: `PrefillServerInfo`'s fields without
    defaults, plus `prefill_http_port` when a rank registered one; 0.5.9: `prefill_*`)."""

    MAIN_FIELDS = ("attn_tp_size", "attn_cp_size", "dp_size", "pp_size", "page_size", "kv_cache_dtype",
                   "follow_bootstrap_room")

    @classmethod
    def main(cls, shape: dict[str, Any]) -> dict[str, Any]:
        info = {name: shape[name] for name in cls.MAIN_FIELDS}
        if "prefill_http_port" in shape:
            info["prefill_http_port"] = shape["prefill_http_port"]
        return info

    @staticmethod
    def legacy(shape: dict[str, Any]) -> dict[str, Any]:
        return {"prefill_attn_tp_size": shape["attn_tp_size"], "prefill_dp_size": shape["dp_size"],
                "prefill_pp_size": shape["pp_size"], "prefill_page_size": shape["page_size"]}


def _route_query(query: Any) -> tuple[RankKey, bool]:
    """((dp, cp, tp, pp), legacy?) from GET /route's parameters; `_BadRequest` when one is missing or not an int."""
    legacy = ("engine_rank" in query or "target_dp_group" in query) and not any(
        name in query for name in _MAIN_PARAMS[:3])
    names = _LEGACY_PARAMS if legacy else _MAIN_PARAMS
    missing = [name for name in names if not query.get(name)]
    if missing:
        raise _BadRequest(f"Missing inputs for bootstrap server: {', '.join(missing)}.")
    values = {}
    for name in names:
        try:
            values[name] = int(query[name])
        except ValueError:
            raise _BadRequest(f"{name} must be an integer, got {query[name]!r}") from None
    if legacy:
        return (values["target_dp_group"], 0, values["engine_rank"], values["target_pp_rank"]), True
    return tuple(values[name] for name in _MAIN_PARAMS), False  # type: ignore[return-value]


@web.middleware
async def _guard(request: web.Request, handler: Any) -> web.StreamResponse:
    """Client mistakes become their 4xx; anything else a 500 that leaves the server running."""
    try:
        return await handler(request)
    except _BadRequest as e:
        return web.Response(text=str(e), status=e.status)
    except web.HTTPException:
        raise
    except Exception as e:
        logger.exception("bootstrap server: %s %s failed", request.method, request.path)
        return web.Response(text=f"internal error: {type(e).__name__}", status=500)


class BootstrapServer:
    """The HTTP service above on `host:port` (port 0 picks a free one; `port` is the bound one after
    `start()`), for a prefill server of `expected_ranks` ranks."""

    def __init__(self, host: str, port: int, expected_ranks: int, max_rooms: int = MAX_ROOMS):
        self.host = host
        self.port = port
        self.ranks = RankTable(expected_ranks)
        self.rooms = RoomTable(max_rooms)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._start_error: BaseException | None = None

    @property
    def url(self) -> str:
        host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(self.host, self.host)
        return f"http://{_host_for_url(host)}:{self.port}"

    def snapshot(self) -> list[dict[str, Any]]:
        """Every registration so far (copies), ordered by (dp, cp, tp, pp); safe from any thread."""
        return self.ranks.snapshot()

    def is_ready(self) -> bool:
        return self.ranks.not_ready_reason() is None

    # lifecycle

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("BootstrapServer.start() called twice")
        self._thread = threading.Thread(target=self._serve, name=f"bootstrap-server-{self.port}", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._start_error is not None:
            self._thread.join()
            raise BootstrapServerError(f"bootstrap server cannot listen on {self.host}:{self.port}: "
                                       f"{self._start_error}") from self._start_error
        logger.info("bootstrap server listening on %s (expects %d prefill ranks)", self.url, self.ranks.expected_ranks)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Close the listening socket and join the thread; idempotent."""
        thread, loop = self._thread, self._loop
        if thread is None or loop is None or not thread.is_alive():
            return
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout_s)
        if thread.is_alive():
            logger.warning("bootstrap server thread did not stop within %.1fs", timeout_s)

    def __enter__(self) -> BootstrapServer:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _serve(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._open())
        except BaseException as e:  # reported by start() on the caller's thread
            self._start_error = e
        self._started.set()
        try:
            if self._start_error is None:
                loop.run_forever()
        finally:
            if self._runner is not None:
                loop.run_until_complete(self._runner.cleanup())
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    async def _open(self) -> None:
        app = web.Application(middlewares=[_guard], client_max_size=MAX_BODY_BYTES)
        app.router.add_put("/route", self._put_route)
        app.router.add_get("/route", self._get_route)
        app.router.add_post("/register_dp_rank", self._register_dp_rank)
        app.router.add_post("/query_dp_ranks", self._query_dp_ranks)
        app.router.add_get("/health", self._health)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        self._runner = runner
        await web.TCPSite(runner, self.host, self.port).start()
        self.port = runner.addresses[0][1]

    # handlers

    async def _put_route(self, request: web.Request) -> web.Response:
        reg = normalize_registration(_parse_json(await request.read()))
        key = self.ranks.add(reg)
        logger.debug("bootstrap: registered dp %d cp %d tp %d pp %d at %s:%d (%d/%d)", *key, reg["rank_ip"],
                     reg["rank_port"], len(self.ranks), self.ranks.expected_ranks)
        return web.Response(text="OK")

    async def _get_route(self, request: web.Request) -> web.Response:
        key, legacy = _route_query(request.query)
        reason = self.ranks.not_ready_reason()
        if reason is not None:
            return web.Response(text=reason, status=503)
        if key == (-1, -1, -1, -1) or (legacy and key == (-1, 0, -1, -1)):
            shape = self.ranks.shape()
            info = ParallelInfo.legacy(shape) if legacy else ParallelInfo.main(shape)
            if request.query.get("include_ranks") in ("1", "true"):
                info["ranks"] = self.ranks.snapshot()
            return web.json_response(info)
        entry = self.ranks.get(key)
        if entry is None:
            d, c, t, p = key
            return web.Response(text=f"Bootstrap info not found for dp_rank={d} cp_rank={c} tp_rank={t} "
                                     f"pp_rank={p}", status=404)
        return web.json_response(entry)

    async def _register_dp_rank(self, request: web.Request) -> web.Response:
        data = _parse_json(await request.read())
        if not isinstance(data, dict) or "bootstrap_room" not in data or "dp_rank" not in data:
            raise _BadRequest("body must be {\"bootstrap_room\": int, \"dp_rank\": int}")
        self.rooms.put(_as_int(data["bootstrap_room"], "bootstrap_room"), _as_int(data["dp_rank"], "dp_rank"))
        return web.Response(text="OK")

    async def _query_dp_ranks(self, request: web.Request) -> web.Response:
        data = _parse_json(await request.read())
        rooms = data.get("bootstrap_rooms") if isinstance(data, dict) else None
        if not isinstance(rooms, list):
            raise _BadRequest("body must be {\"bootstrap_rooms\": [int, ...]}")
        return web.json_response(self.rooms.query([_as_int(r, "bootstrap_rooms[]") for r in rooms]))

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="OK")


# client helpers (standard library only; proxies are bypassed: bootstrap traffic stays inside the cluster)

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _host_for_url(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _http(method: str, host: str, port: int, path: str, body: Any = None, timeout_s: float = 5.0) -> tuple[int, bytes]:
    """(status, body) of one request; connection failures raise OSError (urllib's URLError is one)."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(f"http://{_host_for_url(host)}:{port}{path}", data=data, method=method,
                                     headers={"Content-Type": "application/json"} if data is not None else {})
    try:
        with _OPENER.open(request, timeout=timeout_s) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _reason(e: BaseException) -> str:
    return str(getattr(e, "reason", e))


def register_rank(host: str, port: int, info: dict[str, Any], timeout_s: float = 30.0) -> None:
    """PUT this rank's registration; retries while the server is not up yet (the ranks may start first), raises
    `BootstrapError` when it refuses the registration or stays unreachable for `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    delay = 0.05
    while True:
        try:
            status, body = _http("PUT", host, port, "/route", info, timeout_s=max(min(5.0, timeout_s), 0.1))
        except OSError as e:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise BootstrapError(f"cannot register with the bootstrap server at {host}:{port} within "
                                     f"{timeout_s:.1f}s: {_reason(e)}") from None
            time.sleep(min(delay, remaining))
            delay = min(delay * 2, 1.0)
            continue
        if status != 200:
            raise BootstrapError(f"bootstrap server {host}:{port} refused the registration ({status}): "
                                 f"{body.decode(errors='replace')}", status)
        return


def fetch_parallel_info(host: str, port: int, deadline_s: float = 30.0) -> dict[str, Any]:
    """The prefill's parallel info (main's field names: attn_tp_size, attn_cp_size, dp_size, pp_size, page_size,
    kv_cache_dtype, follow_bootstrap_room) plus "ranks", every registration. Keeps asking for `deadline_s`
    seconds (0: one attempt) while the server answers 503 or cannot be reached, then raises `BootstrapError`
    naming host:port and what was missing; any other refusal raises at once."""
    query = urllib.parse.urlencode({name: -1 for name in _MAIN_PARAMS} | {"include_ranks": 1})
    deadline = time.monotonic() + deadline_s
    delay = 0.05
    while True:
        remaining = deadline - time.monotonic()
        try:
            status, body = _http("GET", host, port, f"/route?{query}", timeout_s=max(min(5.0, remaining), 0.5))
            last = body.decode(errors="replace")
        except OSError as e:
            status, last = None, f"unreachable ({_reason(e)})"
        if status == 200:
            try:
                return json.loads(body)
            except ValueError as e:
                raise BootstrapError(f"bootstrap server {host}:{port} sent invalid JSON: {e}", status) from None
        if status not in (None, 503):
            raise BootstrapError(f"bootstrap server {host}:{port} answered {status}: {last}", status)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise BootstrapError(f"prefill bootstrap server {host}:{port} not ready after {deadline_s:.1f}s: {last}",
                                 status)
        time.sleep(min(delay, remaining))
        delay = min(delay * 2, 0.5)


def fetch_rank(host: str, port: int, tp_rank: int, pp_rank: int, dp_rank: int = 0, cp_rank: int = 0,
               timeout_s: float = 5.0) -> dict[str, Any]:
    """One prefill rank's registration (rank_ip, rank_port and everything it registered); `BootstrapError`
    (with `status`: 503 not ready, 404 unknown rank) otherwise."""
    query = urllib.parse.urlencode({"prefill_dp_rank": dp_rank, "prefill_cp_rank": cp_rank,
                                    "target_tp_rank": tp_rank, "target_pp_rank": pp_rank})
    try:
        status, body = _http("GET", host, port, f"/route?{query}", timeout_s=timeout_s)
    except OSError as e:
        raise BootstrapError(f"cannot reach the bootstrap server at {host}:{port}: {_reason(e)}") from None
    if status != 200:
        raise BootstrapError(f"bootstrap server {host}:{port} has no dp {dp_rank} cp {cp_rank} tp {tp_rank} "
                             f"pp {pp_rank} ({status}): {body.decode(errors='replace')}", status)
    return json.loads(body)


def check_health(host: str, port: int, timeout_s: float = 3.0) -> bool:
    """True when GET /health answers 200 within `timeout_s`."""
    try:
        return _http("GET", host, port, "/health", timeout_s=timeout_s)[0] == 200
    except OSError:
        return False
