"""`Lane`: one micro-batch slot of the scheduler — the in-flight state that is per batch, not global.

The normal and overlap loops drive one lane; the pipeline loop (scheduler/pipeline_loop.py) drives
pp_size + pp_async_batch_depth lanes round-robin, each lane's batch at its own pipeline stage. What is global
stays on the `Scheduler`: the waiting queue, the one chunked request (its chunks may sit in several lanes),
the KV memory, the prefix cache, the new-token ratio.

A lane owns:
- `running`: its decoding requests (a request is in at most one lane's `running`; a request whose prefill
  finished joins the lane that processed the batch);
- `last_decode`: its previous decode batch, so a decode of exactly the same requests reuses its row and
  length tensors (`BatchMemory.prepare_for_decode`);
- `sampling`: the worker's sampling state for the lane's batches (`ModelWorker.new_lane_state`, a
  `SamplingRows`; None on a pipeline stage that does not sample), which carries penalty counts from one step
  of the lane to its next;
- `jumping`: its requests whose output ends with forced tokens (jump-forward, scheduler/jump_forward.py)
  that wait for the extend step computing them; they hold their row and KV and count as admitted;
- `launched`: the batches it launched whose results are not processed yet, oldest first. Results are
  processed in launch order (`Scheduler.process_batch_result` checks it).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from tokenloom.scheduler.req import Req
from tokenloom.scheduler.schedule_batch import ScheduleBatch


@dataclass(eq=False)
class Lane:
    index: int
    cap: int  # most requests the lane may hold: running + admitted by its launched prefills
    sampling: Any = None
    running: list[Req] = field(default_factory=list)
    last_decode: ScheduleBatch | None = None
    launched: deque[ScheduleBatch] = field(default_factory=deque)
    jumping: list[Req] = field(default_factory=list)

    def admitted(self) -> int:
        """Requests counted against the caps: running ones and those its launched prefills will add (a
        request in a non-final chunk counts too, conservatively)."""
        joining = sum(1 for b in self.launched if b.forward_mode.is_extend() for r in b.reqs if not r.finished)
        return len(self.running) + len(self.jumping) + joining

    def requests(self) -> Iterator[Req]:
        """Every request the lane holds: running, jumping, then those of its launched batches (deduplicated)."""
        seen: set[int] = set()
        for req in (*self.running, *self.jumping, *(r for b in self.launched for r in b.reqs)):
            if id(req) not in seen:
                seen.add(id(req))
                yield req

    def is_empty(self) -> bool:
        return not self.running and not self.jumping and not self.launched
