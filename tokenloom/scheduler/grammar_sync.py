"""Grammar admission on a TP/PP server: the entry rank decides, the other ranks follow (issue 32).

Every rank compiles each request's grammar itself, from the request's arrival (its own `GrammarQueue`, fed by
the same messages in the same order), and every rank must let the request in, or refuse it, at the same
iteration: otherwise their batches differ (the TP all-reduces, the PP proxies no longer pair up) or their
pools do. Each rank polling its own compiles would admit at its own moment; waiting every round for every
pending compile (as tokenloom did) froze the decoding of every running request for as long as a compile took.

(SGLang's scheduler all-reduces, every round while requests wait for their grammar, the count of ready ones at
the head of each TP rank's queue, MAX, and the ranks behind block on those compiles.) Here, with no collective
per round:
- the entry rank (tp 0, pp 0) polls its queue without blocking, as a single rank does (`GrammarQueue.decide`),
  and `DecidingInbox` puts its decisions, a `GrammarDecision` (ready rids; failed rids with the reason,
  --grammar-compile-timeout included), at the head of the message list it is about to share: `BroadcastInbox`
  (rank_sync.py) broadcasts that list to the TP group, and under PP stage 0 passes it down the stages with its
  requests (pipeline_loop.py `_pass_requests_on`). Only messages of earlier iterations put a request in the
  queue, so every rank holds the requests a decision names (or none of them: an abort ends one alike);
- every rank, the entry included, handles the decision where it handles that list (`Scheduler.handle` →
  `GrammarQueue.follow`): a failed request ends with the entry's reason (400, it holds nothing yet); a ready
  one is admitted with the rank's own matcher: a non-entry rank first waits for its own compile of that
  grammar (started when the request arrived there, so done by then or nearly; bounded by the compile timeout).
  Ranks that are not the entry never decide anything: they only wait in the broadcast or the stage channel.

A rank whose own compile failed or did not finish where the entry's succeeded (grammars compile
deterministically, so that means a sick rank: out of memory, a stuck compile thread) can neither admit the
request (it would sample without the mask, so other tokens than the other ranks) nor end it alone (its batches
would differ from theirs). So on every decision that admits requests each rank contributes the rids it has no
matcher for to one all-gather over the world (`all_gather_pyobj`; every rank reaches it at the same point),
and every rank ends those requests with a 500 naming the rank and its reason: the ranks stay identical and the
server keeps serving. The cost is one small collective per decision that admits requests (not per step);
under PP it also waits for the last stage to reach that iteration, as a state report does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tokenloom.scheduler.grammar_queue import GrammarQueue
from tokenloom.scheduler.loop_base import Inbox
from tokenloom.scheduler.scheduler import Scheduler


class DecidingInbox:
    """The entry rank's inbox, with its grammar decisions put at the head of each list it returns."""

    def __init__(self, inbox: Inbox, queue: GrammarQueue, nothing_to_run: Callable[[], bool]) -> None:
        self.inbox = inbox
        self.queue = queue
        self.nothing_to_run = nothing_to_run

    def recv_all(self, timeout_ms: int = 0) -> list[Any]:
        if not self.queue.has_undecided():
            return self.inbox.recv_all(timeout_ms)
        # A compile is pending: no long wait on the socket; with nothing else to do, a short one on the compile.
        messages = self.inbox.recv_all(0)
        decision = self.queue.decide(idle=not messages and self.nothing_to_run())
        return messages if decision is None else [decision, *messages]


def lockstep_grammar(scheduler: Scheduler, inbox: Inbox | None, is_entry: bool,
                     gather: Callable[[Any], list[Any]]) -> Inbox | None:
    """Make `scheduler` (one rank of a TP/PP server) admit requests with a grammar by the entry rank's
    decisions, and return the inbox its loop reads: on the entry rank `inbox` wrapped in a `DecidingInbox`
    (to be shared with the other ranks as before), elsewhere `inbox` unchanged (None on a rank that reads
    none itself). `gather(obj)`: every rank's obj on every rank (`comm.all_gather_pyobj`)."""
    queue = scheduler.grammar_queue
    queue.lockstep, queue.gather = True, gather
    if not is_entry:
        return inbox
    if inbox is None:
        raise ValueError("the entry rank reads an inbox")
    return DecidingInbox(inbox, queue, scheduler.has_nothing_to_run)
