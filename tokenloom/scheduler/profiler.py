"""SGLang's `/start_profile` and `/stop_profile` on a scheduler rank: a torch.profiler trace of the rank's steps.

`start_profile_request` checks the route's body (SGLang's `ProfileReqInput` fields) in the tokenizer manager
and builds the `StartProfileRequest` every rank receives: what a CPU server can record is supported
(`output_dir`, `start_step`, `num_steps`, `activities` CPU, and GPU on CUDA, `with_stack`, `record_shapes`,
`profile_prefix`); the rest (`profile_by_stage`, `merge_profiles`, `profile_stages`, the MEM / RPD /
CUDA_PROFILER activities) is refused with a ValueError naming the field (a 400). The folder defaults to
$TOKENLOOM_TORCH_PROFILER_DIR, else SGLang's $SGLANG_TORCH_PROFILER_DIR, else /tmp.

`TraceProfiler` is one rank's session: idle → armed (a start with a `start_step` still ahead) → recording →
idle. `handle` answers a start or stop with a `ProfileReply` (a second start, or a stop with nothing
started, is refused); the event loop calls `step_done()` after each processed step (loops.py
`_finish_step`, every loop), which begins an armed session once `start_step` steps are done and ends a
recording one after `num_steps` steps, writing the trace then. Each rank writes its own Chrome trace,
SGLang's file name `[{prefix}-]{profile_id}-TP-{tp}[-PP-{pp}].trace.json.gz`. The rank's threads are all
recorded (the forward may run on another thread than the one that starts the profiler, executor/
forward_thread.py). Every rank sees the same messages and steps at the same iteration, so the ranks' windows
cover the same steps; only the entry rank's reply reaches the caller.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

from tokenloom.protocol import ProfileReply, StartProfileRequest, StopProfileRequest

logger = logging.getLogger(__name__)

PROFILER_DIR_ENVS = ("TOKENLOOM_TORCH_PROFILER_DIR", "SGLANG_TORCH_PROFILER_DIR")
# SGLang's ProfileReqInput fields (the body of /start_profile); other body fields are ignored, as SGLang does.
PROFILE_FIELDS = ("output_dir", "start_step", "num_steps", "activities", "with_stack", "record_shapes",
                  "profile_by_stage", "merge_profiles", "profile_prefix", "profile_stages")
UNSUPPORTED_ACTIVITIES = {
    "MEM": "CUDA memory snapshots are not recorded",
    "RPD": "it has no ROCm tracer",
    "CUDA_PROFILER": "it does not drive cudaProfilerStart/Stop",
}


def default_output_dir(environ: dict[str, str] | None = None) -> str:
    env = os.environ if environ is None else environ
    for name in PROFILER_DIR_ENVS:
        if env.get(name):
            return env[name]
    return "/tmp"


def _int_at_least(name: str, value: Any, minimum: int) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum} or null; got {value!r}")
    return value


def _flag(name: str, value: Any, default: bool) -> bool:
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true, false or null; got {value!r}")
    return value


def _activities(value: Any, device: str) -> tuple[str, ...]:
    on_cuda = device.startswith("cuda")
    supported = ("CPU", "GPU") if on_cuda else ("CPU",)
    if value is None:
        return supported  # SGLang's default is CPU and GPU
    if not isinstance(value, list) or not value or not all(isinstance(a, str) for a in value):
        raise ValueError(f"activities must be a non-empty list of {' / '.join(supported)}; got {value!r}")
    for activity in value:
        if activity == "GPU" and not on_cuda:
            raise ValueError(f"activities: 'GPU' needs a CUDA device; this server runs on {device} (use ['CPU'])")
        if activity in UNSUPPORTED_ACTIVITIES:
            raise ValueError(f"activities: {activity!r} is not supported by tokenloom: "
                             f"{UNSUPPORTED_ACTIVITIES[activity]} (supported: {', '.join(supported)})")
        if activity not in supported:
            raise ValueError(f"activities: unknown activity {activity!r} (supported: {', '.join(supported)})")
    return tuple(dict.fromkeys(value))


def start_profile_request(device: str, *, output_dir: Any = None, start_step: Any = None, num_steps: Any = None,
                          activities: Any = None, with_stack: Any = None, record_shapes: Any = None,
                          profile_by_stage: Any = False, merge_profiles: Any = False, profile_prefix: Any = None,
                          profile_stages: Any = None, profile_id: str | None = None) -> StartProfileRequest:
    """The message for a /start_profile body (SGLang's field names and defaults: with_stack on, record_shapes
    off); ValueError naming the first field this server cannot honour."""
    if profile_by_stage not in (None, False):
        raise ValueError("profile_by_stage is not supported by tokenloom: one trace covers prefill and decode steps")
    if merge_profiles not in (None, False):
        raise ValueError("merge_profiles is not supported by tokenloom: each rank writes its own trace file")
    if profile_stages not in (None, []):
        raise ValueError("profile_stages is not supported by tokenloom: every step is recorded")
    if output_dir is not None and (not isinstance(output_dir, str) or not output_dir.strip()):
        raise ValueError(f"output_dir must be a folder path (a non-empty string) or null; got {output_dir!r}")
    if profile_prefix is not None and (not isinstance(profile_prefix, str) or "/" in profile_prefix):
        raise ValueError(f"profile_prefix must be a string without '/' or null; got {profile_prefix!r}")
    folder = os.path.abspath(os.path.expanduser(output_dir if output_dir is not None else default_output_dir()))
    return StartProfileRequest(
        output_dir=folder, profile_id=profile_id or f"{time.time():.6f}",
        num_steps=_int_at_least("num_steps", num_steps, 1),
        start_step=_int_at_least("start_step", start_step, 0) or None,
        activities=_activities(activities, device), with_stack=_flag("with_stack", with_stack, True),
        record_shapes=_flag("record_shapes", record_shapes, False), profile_prefix=profile_prefix or "")


@dataclass
class _Session:
    request: StartProfileRequest
    begin_after: int  # steps done (since the rank started) when recording begins
    end_after: int | None  # steps done when it ends (None: at the stop request)
    profiler: Any = None  # the torch.profiler.profile while recording


class TraceProfiler:
    def __init__(self, tp_rank: int = 0, pp_rank: int = 0, pp_size: int = 1) -> None:
        self.tp_rank, self.pp_rank, self.pp_size = tp_rank, pp_rank, pp_size
        self.steps_done = 0
        self._session: _Session | None = None

    @property
    def active(self) -> bool:
        return self._session is not None

    def trace_name(self, request: StartProfileRequest) -> str:
        parts = [request.profile_id, f"TP-{self.tp_rank}"] + ([f"PP-{self.pp_rank}"] if self.pp_size > 1 else [])
        prefix = f"{request.profile_prefix}-" if request.profile_prefix else ""
        return prefix + "-".join(parts) + ".trace.json.gz"

    def handle(self, msg: StartProfileRequest | StopProfileRequest) -> ProfileReply:
        if isinstance(msg, StartProfileRequest):
            return self._start(msg)
        return self._stop()

    def step_done(self) -> None:
        """After each processed step: begin an armed session, or end a recording one that has its steps."""
        self.steps_done += 1
        session = self._session
        if session is None:
            return
        if session.profiler is None:
            if self.steps_done >= session.begin_after:
                error = self._begin(session)
                if error is not None:
                    logger.error("profiling could not start: %s", error)
                    self._session = None
        elif session.end_after is not None and self.steps_done >= session.end_after:
            self._end(session)

    # --- session ------------------------------------------------------------------------------------
    def _start(self, request: StartProfileRequest) -> ProfileReply:
        if self._session is not None:
            return ProfileReply(False, "Profiling is already in progress. Call /stop_profile first.")
        try:
            os.makedirs(request.output_dir, exist_ok=True)
        except OSError as e:
            return ProfileReply(False, f"output_dir {request.output_dir!r} cannot be created: {e}")
        if not os.access(request.output_dir, os.W_OK):
            return ProfileReply(False, f"output_dir {request.output_dir!r} is not writable")
        begin_after = max(self.steps_done, (request.start_step or 0) - 1)
        end_after = begin_after + request.num_steps if request.num_steps is not None else None
        session = _Session(request, begin_after, end_after)
        if begin_after == self.steps_done:
            error = self._begin(session)
            if error is not None:
                return ProfileReply(False, f"the profiler could not start: {error}")
        self._session = session
        steps = f"the next {request.num_steps} steps" if request.num_steps else "until /stop_profile"
        when = f" from step {begin_after + 1}" if session.profiler is None else ""
        return ProfileReply(True, f"Start profiling ({steps}{when}). Traces go to {request.output_dir} "
                                  f"(profile id {request.profile_id}).")

    def _stop(self) -> ProfileReply:
        session = self._session
        if session is None:
            return ProfileReply(False, "Profiling is not in progress. Call /start_profile first.")
        if session.profiler is None:
            self._session = None
            return ProfileReply(True, "Profiling stopped before its start_step was reached; no trace was written.")
        path = self._end(session)
        if path is None:
            return ProfileReply(False, "Profiling stopped, but the trace could not be written (see the log).")
        return ProfileReply(True, f"Stop profiling. Traces are saved to {session.request.output_dir} "
                                  f"(this rank's: {os.path.basename(path)}).")

    def _begin(self, session: _Session) -> str | None:
        """Start recording; the error text when torch refuses."""
        import torch
        from torch.profiler import ProfilerActivity, profile

        request = session.request
        kinds = [ProfilerActivity.CPU if a == "CPU" else ProfilerActivity.CUDA for a in request.activities]
        options: dict[str, Any] = {"activities": kinds, "with_stack": request.with_stack,
                                   "record_shapes": request.record_shapes}
        try:  # every thread of the rank: the forward may run on another one than this
            options["experimental_config"] = torch.profiler._ExperimentalConfig(profile_all_threads=True)
        except (AttributeError, TypeError):
            logger.warning("this torch cannot profile every thread; the trace holds the scheduling thread only")
        try:
            session.profiler = profile(**options)
            session.profiler.start()
        except RuntimeError as e:
            session.profiler = None
            return str(e)
        logger.info("Profiling starts (profile id %s); the trace goes to %s", request.profile_id, request.output_dir)
        return None

    def _end(self, session: _Session) -> str | None:
        """Stop recording and write this rank's trace; its path, or None when it could not be written."""
        self._session = None
        path = os.path.join(session.request.output_dir, self.trace_name(session.request))
        try:
            session.profiler.stop()
            session.profiler.export_chrome_trace(path)
        except (OSError, RuntimeError) as e:
            logger.error("the profile trace %s could not be written: %s", path, e)
            return None
        logger.info("Profiling done; the trace is saved to %s", path)
        return path
