"""Jump-forward decoding for grammar requests (`--enable-jump-forward`, issue 32): where a request's grammar
admits exactly one continuation (a JSON schema's keys, '":', closing braces), its tokens are emitted without
sampling and computed by ONE extend step over the request's KV, instead of one decode step each
(SGLang's original design: https://lmsys.org/blog/2024-02-05-compressed-fsm/; SGLang removed it in
sgl-project/sglang#4032, so the flag is opt-in under this name).

Who decides what, in step order:
1. Forward side (executor/worker.py `sample`): after a constrained row accepts its sampled token t, its matcher
   lists the forced tokens F (the backend's tokenization, the last token held back when a longer token could
   extend it: grammar/backends.py), at most what max_new_tokens leaves; the matcher accepts F at once and
   is `jump_pending`. The step reports F (`ForwardOutput.forced`).
2. Scheduler, processing that step (scheduler/output_processor.py): t then F are output tokens (stop checks on
   each; a stop inside F ends the request there). A request that goes on is `forced_pending` and moves from
   its lane's `running` to `jumping`.
3. With the overlap scheduler the request's next decode step was launched before step 2: that row is void
   (the forward side neither masks nor accepts it; the scheduler discards its token). Its KV write is kept:
   it computed t at its position, so the extend then covers F alone.
4. `next_batch` (below): once none of a jumping request's steps is in flight (`inflight == 0`), the lane's
   next batch is an extend of every such request by its tokens without KV (`BatchMemory.prepare_for_jump`:
   [t, F] or F); it samples the token after F under the grammar (the forward side ends `jump_pending`), and
   its result puts the request back in `running` (or in `jumping` again, if forced tokens follow).
When to extend: a jump batch is a step in which the lane's other requests do not decode, so a lone jumper
beside many decoding requests would cost the lane a step for the few tokens it saves. Jumpers therefore wait
to be extended together: the batch runs once the ready jumpers are at least `GATHER_SHARE` of the lane's
requests, or nothing else runs, or the oldest has waited `MAX_WAIT_STEPS` of the lane's batches (a jumper
beside long unconstrained requests is not held back for long).
A jumping request that does not fit in the KV pool is re-queued as a retracted one (its KV freed, the prompt
and outputs recomputed later); its matcher already follows every output token.

Logprobs: requests with `return_logprob` are never jumped (forced tokens were not sampled and would have no
logprob of their own), so their outputs and logprobs are those of plain decoding.
"""

from __future__ import annotations

from collections.abc import Callable

from tokenloom.scheduler.lane import Lane
from tokenloom.scheduler.req import Req
from tokenloom.scheduler.schedule_batch import BatchMemory, ScheduleBatch

GATHER_SHARE = 0.5  # ready jumpers / (running + ready jumpers) at which they are extended together
MAX_WAIT_STEPS = 4  # lane batches the oldest ready jumper may wait


class JumpForward:
    def __init__(self, memory: BatchMemory) -> None:
        self.memory = memory
        self.batches = 0  # jump-forward extend steps planned
        self.extended_tokens = 0  # tokens those steps computed
        self.requeued = 0  # jumping requests re-queued for want of KV
        self._waited: dict[int, int] = {}  # id(ready jumper) -> lane batches it waited

    def next_batch(self, lane: Lane, requeue: Callable[[Req], None]) -> ScheduleBatch | None:
        """The extend of `lane`'s jumping requests that no launched batch holds, or None. Those that do not
        fit in the KV pool are passed to `requeue` (the scheduler re-queues them as retracted)."""
        ready = [r for r in lane.jumping if r.inflight == 0]
        if not ready:
            return None
        waited = {id(r): self._waited.get(id(r), -1) + 1 for r in ready}
        if lane.running and len(ready) < GATHER_SHARE * (len(ready) + len(lane.running)) \
                and max(waited.values()) < MAX_WAIT_STEPS:
            self._waited = waited  # they wait for more jumpers while the others decode
            return None
        self._waited = {}
        lane.jumping = [r for r in lane.jumping if r.inflight]
        page = self.memory.allocator.page_size
        room = self.memory.available_tokens()
        taken: list[Req] = []
        for req in ready:
            need = len(req.origin_input_ids) + len(req.output_ids) - req.kv_len + page - 1
            if need <= room:
                room -= need
                taken.append(req)
            else:
                self.requeued += 1
                req.forced_pending = False
                requeue(req)
        if not taken:
            return None
        for req in taken:
            req.forced_pending = False
        batch = self.memory.prepare_for_jump(taken)
        self.batches += 1
        self.extended_tokens += int((batch.seq_lens - batch.prefix_lens).sum())
        return batch

    def info(self, forced_tokens: int, void_rows: int) -> dict[str, int]:
        return {"num_jump_forward_tokens": forced_tokens, "num_jump_forward_batches": self.batches,
                "num_jump_forward_void_rows": void_rows,
                "num_jump_forward_extended_tokens": self.extended_tokens,
                "num_jump_forward_requeued": self.requeued}
