"""bench/disagg.py part (1): the runs of one request (checked against addresses computed by hand from the
pool shape), the argument rules, and a `--quick` run end to end with the fake engine (two processes)."""

from __future__ import annotations

import json

import pytest

from bench.disagg import bytes_per_token, main, parse_args, pool_layout, request_runs

ROW = 64 * 2  # bytes of one token slot of one (layer, K/V, head)


def test_one_run_per_layer_kv_head_at_hand_computed_addresses():
    rows, tokens = 100, 37
    src, dst = pool_layout(10_000_000, rows), pool_layout(90_000_000, rows)
    runs = request_runs(src, dst, tokens)
    expected = [(10_000_000 + piece * rows * ROW + 1 * ROW, 90_000_000 + piece * rows * ROW + 7 * ROW, tokens * ROW)
                for piece in range(30 * 2 * 3)]  # piece = (layer * 2 + kv) * 3 + head
    assert runs == expected
    assert bytes_per_token() == 23040 and sum(n for _, _, n in runs) == tokens * 23040


def test_arguments():
    ns = parse_args([])
    assert ns.backends == ["mooncake", "nixl"] and ns.tokens == [1024, 4096, 16384, 32768] and ns.repeats == 3
    ns = parse_args(["--quick"])
    assert ns.tokens == [256] and ns.repeats == 1
    ns = parse_args(["--backends", "nixl,fake", "--tokens", "8,16", "--repeats", "5"])
    assert ns.backends == ["nixl", "fake"] and ns.tokens == [8, 16] and ns.repeats == 5
    for bad in (["--repeats", "2"], ["--backends", "rdma"], ["--tokens", "0"], ["--tokens", "a,b"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_quick_fake_run_writes_its_json(tmp_path, capsys):
    out = tmp_path / "disagg.json"
    report = main(["--quick", "--backends", "fake", "--json-out", str(out)])
    assert json.loads(out.read_text()) == report
    (row,) = report["rows"]
    assert row["backend"] == "fake" and row["tokens"] == 256 and row["runs"] == 180
    assert row["bytes"] == 256 * 23040 and row["verified"] is None and row["memcpy_gbps"] > 0
    assert "fake" in capsys.readouterr().out
