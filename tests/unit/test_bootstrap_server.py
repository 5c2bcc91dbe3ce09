"""The prefill bootstrap server over real HTTP on loopback (free ports), checked against SGLang's wire contract
written out independently here: the JSON field names its decode parses (main's `PrefillServerInfo`, built with
`**json`, and 0.5.9's `prefill_*` keys), its query parameters and status codes. Raw requests go through
urllib / a bare socket, not through the module's client helpers, which get their own tests."""

from __future__ import annotations

import dataclasses
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import pytest

from tokenloom.disaggregation.bootstrap_server import (
    BootstrapError,
    BootstrapServer,
    BootstrapServerError,
    check_health,
    fetch_parallel_info,
    fetch_rank,
    register_rank,
)

HOST = "127.0.0.1"
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@dataclasses.dataclass
class SGLangMainPrefillServerInfo:
    """SGLang main's decode-side view of the all -1 answer (common/conn.py): `PrefillServerInfo(**data)`, so an
    unknown key or a missing field without default fails there."""

    attn_tp_size: int
    attn_cp_size: int
    dp_size: int
    pp_size: int
    page_size: int | None
    kv_cache_dtype: str | None
    follow_bootstrap_room: bool
    enable_dsa_cache_layer_split: bool = False
    prefill_http_port: int | None = None


def _raw(method: str, url: str, body: bytes | None = None, timeout: float = 5.0) -> tuple[int, str]:
    request = urllib.request.Request(url, data=body, method=method)
    try:
        with _OPENER.open(request, timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _json(method: str, url: str, obj: Any) -> tuple[int, str]:
    return _raw(method, url, json.dumps(obj).encode())


def _rank(tp: int, pp: int, tp_size: int = 2, pp_size: int = 2, dp: int = 0, dp_size: int = 1, **extra: Any) -> dict:
    return {"role": "Prefill", "attn_tp_size": tp_size, "attn_tp_rank": tp, "attn_dp_size": dp_size,
            "attn_dp_rank": dp, "pp_size": pp_size, "pp_rank": pp, "system_dp_size": 1, "system_dp_rank": 0,
            "rank_ip": "10.0.0.1", "rank_port": 17000 + 10 * dp + 2 * tp + pp, "page_size": 16,
            "kv_cache_dtype": "auto", **extra}


def _filled(reg: dict) -> dict:
    """What the server stores: the body with SGLang's optional fields defaulted."""
    return {"attn_cp_size": 1, "attn_cp_rank": 0, **reg}


ALL_MINUS_ONE = "prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"
LEGACY_ALL_MINUS_ONE = "engine_rank=-1&target_dp_group=-1&target_pp_rank=-1"


@pytest.fixture
def server():
    srv = BootstrapServer(HOST, 0, expected_ranks=4)
    srv.start()
    yield srv
    srv.stop()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def test_503_until_every_rank_then_parallel_info(server):
    regs = [_rank(tp, pp, layer_range=[pp * 12, pp * 12 + 12], engine={"agent": f"a{tp}{pp}", "blob": "x" * 3000})
            for tp in range(2) for pp in range(2)]
    status, text = _raw("GET", f"{server.url}/route?{ALL_MINUS_ONE}")
    assert (status, "0 of 4" in text) == (503, True)
    for reg in regs[:3]:
        assert _json("PUT", f"{server.url}/route", reg) == (200, "OK")
    for query in (ALL_MINUS_ONE, LEGACY_ALL_MINUS_ONE, "prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=0&"
                  "target_pp_rank=0"):
        status, text = _raw("GET", f"{server.url}/route?{query}")
        assert status == 503 and "3 of 4" in text and "tp_rank=1 pp_rank=1" in text, text
    assert not server.is_ready()
    assert _json("PUT", f"{server.url}/route", regs[3]) == (200, "OK")
    assert server.is_ready()

    status, text = _raw("GET", f"{server.url}/route?{ALL_MINUS_ONE}")
    info = json.loads(text)
    assert status == 200
    assert info == {"attn_tp_size": 2, "attn_cp_size": 1, "dp_size": 1, "pp_size": 2, "page_size": 16,
                    "kv_cache_dtype": "auto", "follow_bootstrap_room": True}
    SGLangMainPrefillServerInfo(**info)  # main's decode accepts it as is

    status, text = _raw("GET", f"{server.url}/route?{LEGACY_ALL_MINUS_ONE}")
    assert (status, json.loads(text)) == (200, {"prefill_attn_tp_size": 2, "prefill_dp_size": 1,
                                               "prefill_pp_size": 2, "prefill_page_size": 16})

    status, text = _raw("GET", f"{server.url}/route?{ALL_MINUS_ONE}&include_ranks=1")
    with_ranks = json.loads(text)
    assert with_ranks.pop("ranks") == [_filled(r) for r in regs]  # (dp, cp, tp, pp) order, extras as sent
    assert with_ranks == info
    assert server.snapshot() == [_filled(r) for r in regs]


@pytest.fixture
def ready(server):
    regs = {(tp, pp): _rank(tp, pp, heads=[tp * 4, tp * 4 + 4]) for tp in range(2) for pp in range(2)}
    for reg in regs.values():
        assert _json("PUT", f"{server.url}/route", reg)[0] == 200
    return server, regs


def test_per_rank_lookup_both_parameter_sets(ready):
    server, regs = ready
    for (tp, pp), reg in regs.items():
        main = _raw("GET", f"{server.url}/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank={tp}"
                           f"&target_pp_rank={pp}")
        legacy = _raw("GET", f"{server.url}/route?engine_rank={tp}&target_dp_group=0&target_pp_rank={pp}")
        assert main[0] == legacy[0] == 200
        assert json.loads(main[1]) == json.loads(legacy[1]) == _filled(reg)
        assert json.loads(main[1])["rank_port"] == 17000 + 2 * tp + pp
        assert fetch_rank(HOST, server.port, tp_rank=tp, pp_rank=pp) == _filled(reg)


def test_bad_queries_answer_400_404_405(ready):
    server, _ = ready
    url = f"{server.url}/route"
    cases = {
        "": 400,
        "prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=0": 400,  # target_pp_rank missing
        "prefill_dp_rank=0&prefill_cp_rank=&target_tp_rank=0&target_pp_rank=0": 400,  # empty counts as missing
        "engine_rank=0&target_pp_rank=0": 400,  # legacy without target_dp_group
        "prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=x&target_pp_rank=0": 400,
        "prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=1.5&target_pp_rank=0": 400,
        "engine_rank=zero&target_dp_group=0&target_pp_rank=0": 400,
        "prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=2&target_pp_rank=0": 404,  # tp 2 of 2
        "prefill_dp_rank=1&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0": 404,
        "prefill_dp_rank=0&prefill_cp_rank=1&target_tp_rank=0&target_pp_rank=0": 404,
        "prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=0": 404,  # not all -1
        "engine_rank=0&target_dp_group=0&target_pp_rank=7": 404,
    }
    for query, expected in cases.items():
        status, text = _raw("GET", f"{url}?{query}")
        assert status == expected, (query, status, text)
    assert "target_pp_rank" in _raw("GET", f"{url}?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=0")[1]
    assert _raw("POST", url, b"{}")[0] == 405
    with pytest.raises(BootstrapError) as err:
        fetch_rank(HOST, server.port, tp_rank=3, pp_rank=0)
    assert err.value.status == 404


def test_malformed_registrations_are_refused_and_harmless(server):
    url = f"{server.url}/route"
    good = _rank(0, 0)
    bodies = [b"", b"not json", b"\xff\xfe", b"[1, 2]", b"null", b"42", b'{"attn_tp_size": NaN}',
              b"[" * 100_000 + b"]" * 100_000]
    bodies += [json.dumps(b).encode() for b in (
        {k: v for k, v in good.items() if k != "rank_port"},
        {k: v for k, v in good.items() if k != "rank_ip"},
        good | {"attn_tp_rank": True},
        good | {"attn_tp_rank": 0.5},
        good | {"attn_tp_rank": "one"},
        good | {"attn_tp_rank": 2},  # outside tp size 2
        good | {"pp_rank": -1},
        good | {"attn_tp_size": 0},
        good | {"rank_port": 70000},
        good | {"rank_ip": ""},
        good | {"page_size": 0},
        good | {"kv_cache_dtype": 8},
        good | {"role": "Decode"},
    )]
    for body in bodies:
        status, text = _raw("PUT", url, body)
        assert status == 400, (body[:80], status, text)
    # well-formed but inconsistent: 409
    assert _json("PUT", url, _rank(0, 0, tp_size=4))[0] == 409  # 4 x 2 ranks, the server expects 4
    assert _json("PUT", url, good)[0] == 200
    for bad in (_rank(1, 0, tp_size=4, pp_size=1), good | {"page_size": 32}, _rank(1, 1) | {"kv_cache_dtype": "fp8"}):
        assert _json("PUT", url, bad)[0] == 409
    # a bare socket sending garbage, then a half-sent request
    for payload in (b"\x00\x01garbage\r\n\r\n", b"PUT /route HTTP/1.1\r\nContent-Length: 100\r\n\r\n{"):
        with socket.create_connection((HOST, server.port), timeout=2) as s:
            s.sendall(payload)
            s.shutdown(socket.SHUT_WR)
            s.recv(4096)
    assert check_health(HOST, server.port, 2.0)
    assert server.snapshot() == [_filled(good)]
    status, text = _raw("GET", f"{url}?{ALL_MINUS_ONE}")
    assert status == 503 and "1 of 4" in text


def test_reregistration_replaces_the_entry():
    with BootstrapServer(HOST, 0, expected_ranks=2) as srv:
        url = f"{srv.url}/route"
        assert _json("PUT", url, _rank(0, 0, tp_size=2, pp_size=1))[0] == 200
        assert _json("PUT", url, _rank(0, 0, tp_size=2, pp_size=1) | {"rank_port": 19999})[0] == 200
        assert "1 of 2" in _raw("GET", f"{url}?{ALL_MINUS_ONE}")[1]  # a restarted rank is not a second rank
        assert _json("PUT", url, _rank(1, 0, tp_size=2, pp_size=1))[0] == 200
        assert fetch_rank(HOST, srv.port, tp_rank=0, pp_rank=0)["rank_port"] == 19999


def test_system_dp_keys_ranks_by_system_dp_rank():
    with BootstrapServer(HOST, 0, expected_ranks=2) as srv:
        for dp in range(2):
            reg = _rank(0, 0, tp_size=1, pp_size=1) | {"system_dp_size": 2, "system_dp_rank": dp,
                                                       "rank_port": 18000 + dp}
            assert _json("PUT", f"{srv.url}/route", reg)[0] == 200
        info = fetch_parallel_info(HOST, srv.port, deadline_s=0)
        assert (info["dp_size"], len(info["ranks"])) == (2, 2)
        assert fetch_rank(HOST, srv.port, tp_rank=0, pp_rank=0, dp_rank=1)["rank_port"] == 18001


def test_dp_rank_routes():
    with BootstrapServer(HOST, 0, expected_ranks=1, max_rooms=3) as srv:
        reg_url, query_url = f"{srv.url}/register_dp_rank", f"{srv.url}/query_dp_ranks"
        big_room = 2**63 - 1
        for room, dp in ((big_room, 1), (5, 0), (6, 3)):
            assert _json("POST", reg_url, {"bootstrap_room": room, "dp_rank": dp}) == (200, "OK")
        status, text = _json("POST", query_url, {"bootstrap_rooms": [big_room, 5, 6, 7]})
        assert (status, json.loads(text)) == (200, {str(big_room): 1, "5": 0, "6": 3})  # 7 unknown: left out
        assert _json("POST", reg_url, {"bootstrap_room": 8, "dp_rank": 2})[0] == 200  # drops the oldest
        assert json.loads(_json("POST", query_url, {"bootstrap_rooms": [big_room, 5, 6, 8]})[1]) == {
            "5": 0, "6": 3, "8": 2}
        assert len(srv.rooms) == 3
        for body in (b"x", b"[]", b"{}", b'{"bootstrap_room": 1}', b'{"bootstrap_room": "a", "dp_rank": 0}',
                     b'{"bootstrap_room": 1, "dp_rank": null}'):
            assert _raw("POST", reg_url, body)[0] == 400, body
        for body in (b"x", b"{}", b'{"bootstrap_rooms": 5}', b'{"bootstrap_rooms": [1, "b"]}',
                     b'{"bootstrap_rooms": [[1]]}'):
            assert _raw("POST", query_url, body)[0] == 400, body
        assert _raw("GET", reg_url)[0] == 405
        assert json.loads(_json("POST", query_url, {"bootstrap_rooms": []})[1]) == {}


def test_health():
    with BootstrapServer(HOST, 0, expected_ranks=1) as srv:
        assert _raw("GET", f"{srv.url}/health") == (200, "OK")
        assert check_health(HOST, srv.port, 1.0)
    assert not check_health(HOST, srv.port, 1.0)


def test_two_servers_are_independent():
    with BootstrapServer(HOST, 0, expected_ranks=1) as a, BootstrapServer(HOST, 0, expected_ranks=1) as b:
        assert a.port != b.port
        register_rank(HOST, a.port, _rank(0, 0, tp_size=1, pp_size=1), timeout_s=2)
        assert fetch_parallel_info(HOST, a.port, deadline_s=0)["ranks"][0]["rank_port"] == 17000
        assert _raw("GET", f"{b.url}/route?{ALL_MINUS_ONE}")[0] == 503
        register_rank(HOST, b.port, _rank(0, 0, tp_size=1, pp_size=1) | {"rank_port": 9}, timeout_s=2)
        assert fetch_rank(HOST, b.port, 0, 0)["rank_port"] == 9
        assert fetch_rank(HOST, a.port, 0, 0)["rank_port"] == 17000


def test_stop_frees_the_port_and_a_taken_port_is_reported():
    first = BootstrapServer(HOST, 0, expected_ranks=1)
    first.start()
    port = first.port
    with pytest.raises(BootstrapServerError, match=str(port)):
        BootstrapServer(HOST, port, expected_ranks=1).start()
    first.stop()
    first.stop()  # idempotent
    assert not first._thread.is_alive()
    with BootstrapServer(HOST, port, expected_ranks=1) as again:
        assert check_health(HOST, again.port, 1.0)


def test_fetch_parallel_info_waits_for_registration_then_times_out_clearly():
    with BootstrapServer(HOST, 0, expected_ranks=2) as srv:
        register_rank(HOST, srv.port, _rank(0, 0, tp_size=2, pp_size=1), timeout_s=2)
        start = time.monotonic()
        with pytest.raises(BootstrapError) as err:
            fetch_parallel_info(HOST, srv.port, deadline_s=0.3)
        assert 0.2 < time.monotonic() - start < 2.0
        assert f"{HOST}:{srv.port}" in str(err.value) and "tp_rank=1" in str(err.value)
        assert err.value.status == 503
        late = threading.Timer(0.3, register_rank, (HOST, srv.port, _rank(1, 0, tp_size=2, pp_size=1), 2.0))
        late.start()
        info = fetch_parallel_info(HOST, srv.port, deadline_s=3.0)
        late.join()
        assert [r["attn_tp_rank"] for r in info["ranks"]] == [0, 1]
        with pytest.raises(BootstrapError) as refused:
            register_rank(HOST, srv.port, {"rank_ip": "x"}, timeout_s=1)
        assert refused.value.status == 400 and "lacks" in str(refused.value)
    port = _closed_port()
    with pytest.raises(BootstrapError, match=f"{HOST}:{port}.*unreachable"):
        fetch_parallel_info(HOST, port, deadline_s=0.2)
    with pytest.raises(BootstrapError, match=f"{HOST}:{port}"):
        register_rank(HOST, port, _rank(0, 0), timeout_s=0.2)
    with pytest.raises(BootstrapError, match=f"{HOST}:{port}"):
        fetch_rank(HOST, port, 0, 0, timeout_s=0.5)


def test_register_rank_retries_until_the_server_listens():
    port = _closed_port()
    srv = BootstrapServer(HOST, port, expected_ranks=1)
    starter = threading.Timer(0.3, srv.start)
    starter.start()
    try:
        register_rank(HOST, port, _rank(0, 0, tp_size=1, pp_size=1), timeout_s=3.0)
        starter.join()
        assert srv.is_ready()
    finally:
        starter.join()
        srv.stop()


def test_concurrent_registrations_and_snapshots():
    size = 8
    with BootstrapServer(HOST, 0, expected_ranks=size) as srv:
        regs = [_rank(tp, 0, tp_size=size, pp_size=1) for tp in range(size)]
        seen: list[int] = []
        done = threading.Event()

        def watch() -> None:
            while not done.is_set():
                seen.append(len(srv.snapshot()))

        watcher = threading.Thread(target=watch)
        watcher.start()
        workers = [threading.Thread(target=register_rank, args=(HOST, srv.port, r, 2.0)) for r in regs]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        done.set()
        watcher.join()
        assert srv.snapshot() == [_filled(r) for r in regs]
        assert seen == sorted(seen) and seen[-1] <= size
        assert fetch_parallel_info(HOST, srv.port, deadline_s=0)["attn_tp_size"] == size


def test_an_internal_error_answers_500_and_the_server_keeps_serving(monkeypatch):
    with BootstrapServer(HOST, 0, expected_ranks=1) as srv:
        def boom(reg: dict) -> None:
            raise RuntimeError("table broke")

        monkeypatch.setattr(srv.ranks, "add", boom)
        status, text = _json("PUT", f"{srv.url}/route", _rank(0, 0, tp_size=1, pp_size=1))
        assert (status, "RuntimeError" in text) == (500, True)
        monkeypatch.undo()
        assert _json("PUT", f"{srv.url}/route", _rank(0, 0, tp_size=1, pp_size=1)) == (200, "OK")
        assert srv.is_ready() and srv._thread.is_alive()
        # the client retries only while the server is not ready; other answers are final
        monkeypatch.setattr(srv.ranks, "shape", boom)
        start = time.monotonic()
        with pytest.raises(BootstrapError) as err:
            fetch_parallel_info(HOST, srv.port, deadline_s=5.0)
        assert err.value.status == 500 and time.monotonic() - start < 1.0
        monkeypatch.undo()
        assert fetch_parallel_info(HOST, srv.port, deadline_s=0)["attn_tp_size"] == 1
