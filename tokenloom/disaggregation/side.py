"""`DisaggSide`: what the prefill and decode sides (prefill.py, decode.py) share as a scheduler's request port
(scheduler/request_port.py): which requests are theirs (a real bootstrap room; warm-up, health checks and
SGLang's fake host are served as on a unified server), the checks a request passes before either side takes
it (each refusal a 400), and telling the peer server when the scheduler refused one of ours at its door.

A side holds its requests' PD state itself (prefill.py's `PrefillRoom`, decode.py's `DecodeRoom`), never on
the `Req`, and reaches the scheduler only through its public operations."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenloom.disaggregation.agent import TransferAgent
from tokenloom.scheduler.req import Req

if TYPE_CHECKING:
    from tokenloom.scheduler.scheduler import Scheduler


class DisaggSide:
    role = ""

    def __init__(self, scheduler: Scheduler, agent: TransferAgent) -> None:
        self.scheduler = scheduler
        self.agent = agent

    def owns(self, req: Req) -> bool:
        return req.bootstrap is not None and not req.bootstrap.is_fake

    def take(self, req: Req) -> bool:
        """The port's `take`: a request of ours the scheduler refused at its door (it arrives finished) is
        told to the peer, whose half must end too; any other request of ours goes to the side (`admit`)."""
        if not self.owns(req):
            return False
        if req.finished:
            self._tell_peer_refused(req)
            return False
        return self.admit(req)

    def admit(self, req: Req) -> bool:
        """Take a checked request of ours into the side's queues (or answer it); True."""
        raise NotImplementedError

    def _tell_peer_refused(self, req: Req) -> None:
        reason = req.finished_reason or {}
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
        self.scheduler.emit(req)
        if not room_in_use:  # (a room in use belongs to another request: leave that one alone)
            self._tell_peer_refused(req)
        return True
