"""`ReqState`: what the tokenizer manager keeps for one request while it runs (the caller's loop and queue,
its logprobs so far), and how one of the runtime's text outputs becomes that request's response in SGLang's
shape (`response`).

Invariant: a `ReqState` is touched only by whoever reads the runtime's outputs (the receiver thread, or the
loop that took the socket over) once registered; its queue only through its own loop.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from tokenloom.frontend.logprob_accumulator import LogprobAccumulator
from tokenloom.protocol import BatchStrOutput


@dataclass
class ReqState:
    rid: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    created: float = field(default_factory=time.perf_counter)
    finished: bool = False
    aborted_by_client: bool = False
    logprobs: LogprobAccumulator = field(default_factory=LogprobAccumulator)

    def response(self, msg: BatchStrOutput, i: int) -> dict[str, Any]:
        """The response for output `i` of `msg` (this request's): text, output ids and meta_info with every
        logprob so far; an abort the client asked for finishes without a status code (not an error)."""
        meta = dict(msg.meta[i])
        finish = msg.finished_reasons[i]
        if finish is not None and finish.get("type") == "abort" and self.aborted_by_client:
            finish = {"type": "abort", "message": finish.get("message")}
        meta["finish_reason"] = finish
        if finish is not None:
            meta["e2e_latency"] = time.perf_counter() - self.created
        self.logprobs.apply(meta)
        return {"text": msg.texts[i], "output_ids": msg.output_ids[i], "meta_info": meta}
