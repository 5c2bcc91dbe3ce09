"""`DisaggSide`: what the prefill and decode sides (prefill.py, decode.py) share inside a `Scheduler`: which
requests are theirs (a real bootstrap room; warm-up, health checks and SGLang's fake host are served as on a
unified server) and the checks a request passes before either side queues it, each refusal a 400."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenloom.scheduler.req import Req

if TYPE_CHECKING:
    from tokenloom.scheduler.scheduler import Scheduler


class DisaggSide:
    role = ""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def owns(self, req: Req) -> bool:
        return req.bootstrap is not None and not req.bootstrap.is_fake

    def num_queued(self) -> int:
        """Requests of this side waiting to be admitted (they count against --max-queued-requests)."""
        raise NotImplementedError

    def refused_at_door(self, req: Req) -> None:
        """The scheduler refused `req` (of ours) before queueing it: its peer half must end too."""
        if self.owns(req):
            reason = req.finished_reason
            self.agent.refuse(req.bootstrap.room, req.bootstrap, reason.get("message", "refused"),
                              reason.get("status_code") or 400)

    def refused(self, req: Req, room_in_use: bool) -> bool:
        """Answer `req` with a 400 and return True if it cannot be taken: prompt scoring (no token to hand
        over), or a room another request of this server holds."""
        if req.sampling_params.max_new_tokens == 0:
            message = ("max_new_tokens 0 (prompt scoring) is not supported on a disaggregated server: send it to a "
                       "unified one")
        elif room_in_use:
            message = f"bootstrap_room {req.bootstrap.room} is already in use on this {self.role} server"
        else:
            return False
        req.abort(message, 400)
        self.scheduler.output.emit([req])
        if not room_in_use:  # (a room in use belongs to another request: leave that one alone)
            self.refused_at_door(req)
        return True
