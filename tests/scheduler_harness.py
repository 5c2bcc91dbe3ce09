"""Runs the real `Scheduler` + its event loop (`--overlap-schedule`, off unless given) in-process over
in-memory channels (no subprocesses), so the
scheduling matrix (radix on/off, chunk sizes, page sizes, retraction, aborts) runs in seconds."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tokenloom.config import ServerArgs
from tokenloom.executor.model_runner import ModelRunner
from tokenloom.executor.worker import ModelWorker
from tokenloom.ipc import LocalChannel
from tokenloom.protocol import AbortRequest, TokenizedRequest
from tokenloom.sampling.sampling_params import SamplingParams
from tokenloom.scheduler.loops import make_event_loop
from tokenloom.scheduler.scheduler import Scheduler


@dataclass
class Result:
    output_ids: list[int] = field(default_factory=list)
    finish_reason: dict | None = None
    meta: dict = field(default_factory=dict)


class Harness:
    def __init__(self, folder: str, tokenizer: Any = None, eos: tuple[int, ...] = (0,), **server_args: Any) -> None:
        defaults = dict(model_path=folder, dtype="float32", max_total_tokens=4096, max_running_requests=32,
                        overlap_schedule="off")
        self.args = ServerArgs(**{**defaults, **server_args})
        self.runner = ModelRunner(self.args)
        self.inbox, self.outbox = LocalChannel(), LocalChannel()
        self.scheduler = Scheduler(self.args, ModelWorker(self.runner, eos), tokenizer, self.outbox.send)
        self.loop = make_event_loop(self.args, self.scheduler, self.inbox)
        self.results: dict[str, Result] = {}
        self.steps = 0

    def submit(self, rid: str, ids: list[int], params: dict[str, Any], **kw: Any) -> None:
        sp = SamplingParams.from_dict(params, self.runner.vocab_size)
        self.inbox.send(TokenizedRequest(rid, None, list(ids), sp, **kw))

    def abort(self, rid: str) -> None:
        self.inbox.send(AbortRequest(rid))

    def run(self, until: Callable[[Harness], bool] | None = None, max_steps: int = 100_000) -> dict[str, Result]:
        """Step until idle (or `until(self)`), collecting outputs; checks pools are full when idle."""
        while self.steps < max_steps:
            busy = self.loop.run_once()
            self.steps += 1
            self._collect()
            if until is not None and until(self):
                return self.results
            if not busy and self.scheduler.is_idle():
                self.scheduler.check_idle_integrity()
                return self.results
        raise AssertionError("scheduler did not go idle")

    def _collect(self) -> None:
        for msg in self.outbox.recv_all():
            for i, rid in enumerate(msg.rids):
                res = self.results.setdefault(rid, Result())
                res.output_ids.extend(msg.new_token_ids[i])
                res.meta = msg.meta[i]
                if msg.finished_reasons[i] is not None:
                    assert res.finish_reason is None, f"{rid} finished twice"
                    res.finish_reason = msg.finished_reasons[i]

    def assert_pools_full(self) -> None:
        sched = self.scheduler
        assert sched.is_idle()
        sched.tree_cache.check_integrity()
        assert self.runner.req_to_token_pool.available_size() == self.runner.req_to_token_pool.size
