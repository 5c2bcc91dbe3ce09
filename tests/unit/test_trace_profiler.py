"""/start_profile on one rank (scheduler/profiler.py): the body's checks (SGLang's fields; what a CPU server
cannot record is refused naming the field), the default folder, and `TraceProfiler`'s session: the trace is
written after exactly `num_steps` processed steps (or at the stop), from `start_step`, as a gzipped Chrome
trace named with the rank, holding the ops of every thread; a second start and a stop with nothing started
are refused. The HTTP path on a real server is tests/e2e/test_profile_routes.py."""

from __future__ import annotations

import gzip
import json
import os
import threading

import pytest
import torch

from tokenloom.protocol import StartProfileRequest, StopProfileRequest
from tokenloom.scheduler.profiler import TraceProfiler, default_output_dir, start_profile_request


@pytest.mark.parametrize("options, field", [
    ({"num_steps": 0}, "num_steps"),
    ({"num_steps": -3}, "num_steps"),
    ({"num_steps": "5"}, "num_steps"),
    ({"num_steps": True}, "num_steps"),
    ({"start_step": -1}, "start_step"),
    ({"activities": ["GPU"]}, "activities"),
    ({"activities": ["CPU", "MEM"]}, "activities"),
    ({"activities": ["RPD"]}, "activities"),
    ({"activities": ["TPU"]}, "activities"),
    ({"activities": []}, "activities"),
    ({"activities": "CPU"}, "activities"),
    ({"with_stack": "yes"}, "with_stack"),
    ({"record_shapes": 1}, "record_shapes"),
    ({"profile_by_stage": True}, "profile_by_stage"),
    ({"merge_profiles": True}, "merge_profiles"),
    ({"profile_stages": ["prefill"]}, "profile_stages"),
    ({"output_dir": ""}, "output_dir"),
    ({"output_dir": 7}, "output_dir"),
    ({"profile_prefix": "a/b"}, "profile_prefix"),
])
def test_bad_options_are_refused_naming_the_field(options, field):
    with pytest.raises(ValueError, match=field):
        start_profile_request("cpu", **options)


def test_defaults_follow_sglang_and_the_device(monkeypatch, tmp_path):
    monkeypatch.delenv("TOKENLOOM_TORCH_PROFILER_DIR", raising=False)
    monkeypatch.delenv("SGLANG_TORCH_PROFILER_DIR", raising=False)
    req = start_profile_request("cpu")
    assert (req.output_dir, req.activities, req.with_stack, req.record_shapes) == ("/tmp", ("CPU",), True, False)
    assert (req.num_steps, req.start_step, req.profile_prefix) == (None, None, "")
    assert start_profile_request("cuda:0").activities == ("CPU", "GPU")
    assert start_profile_request("cuda", activities=["GPU"]).activities == ("GPU",)
    # null means the default, as in SGLang's optional fields
    assert start_profile_request("cpu", with_stack=None, profile_by_stage=None, profile_stages=[]).with_stack
    assert start_profile_request("cpu", start_step=0).start_step is None
    assert default_output_dir({"SGLANG_TORCH_PROFILER_DIR": "/s"}) == "/s"
    assert default_output_dir({"SGLANG_TORCH_PROFILER_DIR": "/s", "TOKENLOOM_TORCH_PROFILER_DIR": "/t"}) == "/t"
    monkeypatch.setenv("SGLANG_TORCH_PROFILER_DIR", str(tmp_path / "traces"))
    assert start_profile_request("cpu").output_dir == str(tmp_path / "traces")


def test_trace_names_carry_the_rank():
    req = StartProfileRequest(output_dir="/x", profile_id="123.5", profile_prefix="exp")
    assert TraceProfiler(1, 0, 1).trace_name(req) == "exp-123.5-TP-1.trace.json.gz"
    assert TraceProfiler(0, 2, 3).trace_name(StartProfileRequest("/x", "9")) == "9-TP-0-PP-2.trace.json.gz"


def _events(path: str) -> list[dict]:
    with gzip.open(path, "rt") as f:
        return json.load(f)["traceEvents"]


def _step_on_another_thread(profiler: TraceProfiler) -> None:
    """One step whose ops run on another thread than the one that started the profiler (as the forward of
    the overlap loop does), then the loop's step_done."""
    worker = threading.Thread(target=lambda: torch.mm(torch.ones(8, 8), torch.ones(8, 8)))
    worker.start()
    worker.join()
    profiler.step_done()


def test_num_steps_ends_the_trace_after_that_many_steps(tmp_path):
    profiler = TraceProfiler()
    profiler.step_done()  # steps before the start do not count
    req = start_profile_request("cpu", output_dir=str(tmp_path), num_steps=2, with_stack=False, profile_id="p1")
    reply = profiler.handle(req)
    assert reply.success, reply.message
    assert str(tmp_path) in reply.message
    again = profiler.handle(req)
    assert not again.success and "already in progress" in again.message
    path = tmp_path / "p1-TP-0.trace.json.gz"
    _step_on_another_thread(profiler)
    assert not path.exists() and profiler.active
    _step_on_another_thread(profiler)
    assert path.exists() and not profiler.active
    names = {e.get("name") for e in _events(str(path))}
    assert "aten::mm" in names  # recorded on the other thread
    stop = profiler.handle(StopProfileRequest())
    assert not stop.success and "not in progress" in stop.message


def test_start_step_delays_the_window_and_stop_writes_an_open_trace(tmp_path):
    profiler = TraceProfiler()
    req = start_profile_request("cpu", output_dir=str(tmp_path), start_step=3, num_steps=1, with_stack=False,
                                profile_id="p2")
    assert profiler.handle(req).success
    path = tmp_path / "p2-TP-0.trace.json.gz"
    for _ in range(2):  # steps 1 and 2: armed, not recording
        profiler.step_done()
    assert profiler.active and not path.exists()
    _step_on_another_thread(profiler)  # step 3 is the window
    assert path.exists() and not profiler.active

    open_ended = start_profile_request("cpu", output_dir=str(tmp_path), with_stack=False, profile_id="p3")
    assert profiler.handle(open_ended).success
    for _ in range(5):
        _step_on_another_thread(profiler)
    assert profiler.active
    stop = profiler.handle(StopProfileRequest())
    assert stop.success and "p3-TP-0.trace.json.gz" in stop.message
    assert "aten::mm" in {e.get("name") for e in _events(str(tmp_path / "p3-TP-0.trace.json.gz"))}


def test_a_stop_before_start_step_writes_nothing(tmp_path):
    profiler = TraceProfiler()
    req = start_profile_request("cpu", output_dir=str(tmp_path), start_step=100, profile_id="p4")
    assert profiler.handle(req).success
    profiler.step_done()
    reply = profiler.handle(StopProfileRequest())
    assert reply.success and "no trace" in reply.message
    assert os.listdir(tmp_path) == [] and not profiler.active


def test_an_unusable_folder_is_refused(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    reply = TraceProfiler().handle(start_profile_request("cpu", output_dir=str(blocker / "sub")))
    assert not reply.success and "output_dir" in reply.message
