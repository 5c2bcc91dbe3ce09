"""SGLang's /start_profile and /stop_profile on the shared tiny server: a profile of `num_steps` steps writes the
rank's trace by itself once the steps have run (a gzipped Chrome trace whose events include the model's ops,
which run on another thread than the one that handles the request); an open-ended one is written at
/stop_profile; a stop with nothing started, a second start, and options a CPU server cannot honour are 400s
that say why."""

from __future__ import annotations

import gzip
import json
import os
import time

from tests.e2e.server_process import http

GENERATE = {"text": "Profile me", "sampling_params": {"max_new_tokens": 8, "ignore_eos": True, "temperature": 0}}


def _traces(folder: str) -> list[str]:
    return sorted(name for name in os.listdir(folder) if name.endswith(".trace.json.gz"))


def _op_names(path: str) -> set[str]:
    with gzip.open(path, "rt") as f:
        trace = json.load(f)
    return {event.get("name") for event in trace["traceEvents"]}


def test_profile_routes(tiny_server, tmp_path):
    url = tiny_server.url
    status, body = http("POST", url + "/stop_profile")
    assert status == 400 and "not in progress" in body["message"], body

    for bad, field in (({"activities": ["GPU"]}, "activities"), ({"profile_by_stage": True}, "profile_by_stage"),
                       ({"num_steps": 0}, "num_steps")):
        status, body = http("POST", url + "/start_profile", dict(bad, output_dir=str(tmp_path)))
        assert status == 400 and field in body["message"], (bad, body)

    auto = tmp_path / "auto"
    status, text = http("POST", url + "/start_profile", {"output_dir": str(auto), "num_steps": 3,
                                                         "activities": ["CPU"], "with_stack": False,
                                                         "some_future_field": 1})
    try:
        assert status == 200 and text.startswith("Start profiling"), text
        status, body = http("POST", url + "/start_profile", {"output_dir": str(auto)})
        assert status == 400 and "already in progress" in body["message"], body
        assert http("POST", url + "/generate", GENERATE)[0] == 200  # 8 tokens: more than 3 steps
        deadline = time.monotonic() + 30
        while not _traces(str(auto)) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        http("POST", url + "/stop_profile")  # leaves the shared server unprofiled whatever happened
    traces = _traces(str(auto))
    assert len(traces) == 1 and traces[0].endswith("-TP-0.trace.json.gz"), traces
    assert any(name.startswith("aten::") for name in _op_names(str(auto / traces[0])))
    status, body = http("POST", url + "/stop_profile")  # it already ended by itself
    assert status == 400 and "not in progress" in body["message"], body

    manual = tmp_path / "manual"
    status, text = http("GET", url + "/start_profile?unused=1", raw=json.dumps(
        {"output_dir": str(manual), "with_stack": False, "profile_prefix": "run"}).encode())
    assert status == 200, text
    try:
        assert http("POST", url + "/generate", GENERATE)[0] == 200
        assert _traces(str(manual)) == []  # open-ended: nothing written until the stop
    finally:
        status, text = http("POST", url + "/stop_profile")
    assert status == 200 and str(manual) in text, text
    traces = _traces(str(manual))
    assert len(traces) == 1 and traces[0].startswith("run-") and traces[0] in text, (traces, text)
    assert any(name.startswith("aten::") for name in _op_names(str(manual / traces[0])))
