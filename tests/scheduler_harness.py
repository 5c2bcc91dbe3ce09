"""Runs the real `Scheduler` + its event loop (`--overlap-schedule`, off unless given) in-process over
in-memory channels (no subprocesses), so the
scheduling matrix (radix on/off, chunk sizes, page sizes, retraction, aborts) runs in seconds.

`LoopHarness` drives any worker over a given `KVMemory` (tests/unit/test_scheduler_fake_runner.py gives it a
fake one); `Harness` builds the real one as the scheduler process does: the weights, one `KVMemory` handed
to both the model runner and the scheduler, the `ModelWorker`. `generate_in_process` generates with an
existing `ModelRunner` through the scheduler and a worker over the runner's own memory: the tests' one way
to generate without starting processes (the serving path, its stop rule included)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenloom.cache.kv_memory import KVMemory
from tokenloom.config import ServerArgs
from tokenloom.executor.model_runner import LoadedModel, ModelRunner
from tokenloom.executor.worker import ModelWorker
from tokenloom.ipc import LocalChannel
from tokenloom.protocol import AbortRequest, RequestAccepted, TokenizedRequest
from tokenloom.sampling.sampling_params import SamplingParams
from tokenloom.scheduler.loops import make_event_loop
from tokenloom.scheduler.scheduler import Scheduler, SchedulerWorker


@dataclass
class Result:
    output_ids: list[int] = field(default_factory=list)
    finish_reason: dict | None = None
    meta: dict = field(default_factory=dict)


class LoopHarness:
    def __init__(self, args: ServerArgs, worker: SchedulerWorker, memory: KVMemory, vocab_size: int,
                 tokenizer: Any = None, num_lanes: int = 1, lane_cap: int | None = None,
                 make_loop: Callable[[Scheduler, LocalChannel], Any] | None = None) -> None:
        """`num_lanes`/`lane_cap`: the scheduler's micro-batch lanes; `make_loop(scheduler, inbox)`: the loop
        driving it (default: the one `make_event_loop` picks for `args`)."""
        self.args = args
        self.memory = memory
        self.vocab_size = vocab_size
        self.inbox, self.outbox = LocalChannel(), LocalChannel()
        self.scheduler = Scheduler(args, worker, tokenizer, self.outbox.send, memory, num_lanes=num_lanes,
                                   lane_cap=lane_cap)
        self.loop = (make_loop or (lambda sched, inbox: make_event_loop(args, sched, inbox)))(self.scheduler,
                                                                                            self.inbox)
        self.results: dict[str, Result] = {}
        self.accepted: list[str] = []  # rids of the RequestAccepted notices, in order
        self.steps = 0

    def submit(self, rid: str, ids: list[int], params: dict[str, Any], **kw: Any) -> None:
        sp = SamplingParams.from_dict(params, self.vocab_size)
        self.inbox.send(TokenizedRequest(rid, None, list(ids), sp, **kw))

    def abort(self, rid: str) -> None:
        self.inbox.send(AbortRequest(rid))

    def run(self, until: Callable[[LoopHarness], bool] | None = None, max_steps: int = 100_000) -> dict[str, Result]:
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
            if isinstance(msg, RequestAccepted):  # a streaming request's admission notice
                self.accepted.append(msg.rid)
                continue
            for i, rid in enumerate(msg.rids):
                res = self.results.setdefault(rid, Result())
                res.output_ids.extend(msg.new_token_ids[i])
                res.meta = msg.meta[i]
                if msg.finished_reasons[i] is not None:
                    assert res.finish_reason is None, f"{rid} finished twice"
                    res.finish_reason = msg.finished_reasons[i]

    def assert_pools_full(self) -> None:
        assert self.scheduler.is_idle()
        self.memory.check_idle_integrity()


class Harness(LoopHarness):
    def __init__(self, folder: str, tokenizer: Any = None, eos: tuple[int, ...] = (0,), **server_args: Any) -> None:
        defaults = dict(model_path=folder, dtype="float32", max_total_tokens=4096, max_running_requests=32,
                        overlap_schedule="off")
        args = ServerArgs(**{**defaults, **server_args})
        loaded = LoadedModel.load(args)  # as the scheduler process does: one KVMemory for runner and scheduler
        memory = loaded.kv_memory(args)
        self.runner = ModelRunner(args, loaded=loaded, memory=memory)
        super().__init__(args, ModelWorker(self.runner, eos), memory, self.runner.vocab_size, tokenizer)


def generate_in_process(runner: ModelRunner, prompts: Sequence[Sequence[int]], params: Sequence[dict[str, Any]],
                        eos_token_ids: Sequence[int] = (), worker: SchedulerWorker | None = None) -> list[list[int]]:
    """Generate for `prompts` (one sampling dict each) together, through a `Scheduler` with the normal loop over
    `runner`'s memory and `worker` (default: a `ModelWorker` of `runner` with `eos_token_ids`); returns each
    prompt's output ids. The prefix cache is emptied before and after (nothing is matched from another run)
    and the pools are checked full when it goes idle."""
    args = dataclasses.replace(runner.args, overlap_schedule="off")
    worker = worker or ModelWorker(runner, tuple(eos_token_ids))
    h = LoopHarness(args, worker, runner.memory, runner.vocab_size)
    assert h.scheduler.flush_cache().success
    for i, (ids, p) in enumerate(zip(prompts, params, strict=True)):
        h.submit(f"gen{i}", ids, p)
    results = [h.run()[f"gen{i}"] for i in range(len(prompts))]
    assert h.scheduler.flush_cache().success
    refused = [r.finish_reason for r in results if r.finish_reason["type"] == "abort"]
    assert not refused, refused
    return [r.output_ids for r in results]
