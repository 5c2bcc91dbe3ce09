"""Typed point-to-point messages between neighbouring pipeline stages over a gloo group.

A message is a type tag (a str: "requests", "proxy", "output", ...) and a payload dict whose values are CPU
tensors (any dtype, bfloat16 included, any shape, empty or 0-dim) or picklable objects. Tensors nested inside
other values are pickled with them (correct, but without the zero-copy path). A `PPChannel` sends to one peer
and receives from one peer (a stage's next and previous ranks; the same rank at pp_size 2) on the gloo tag
`wire_tag` of its group: `world_cpu_group`, or any gloo group holding this rank and both peers.

Wire format of one message, every piece on `wire_tag`, in this order (gloo matches the sends and receives of
one (peer, tag) pair in posting order):
1. header: int64 [MAGIC, n]: n is the metadata's length; MAGIC catches a stream out of step;
2. metadata: uint8 [n]: the pickle of (tag, entries); entries follow the payload's key order, with the value
   itself for an object and (dtype, shape) for a tensor;
3. each non-empty tensor's bytes, viewed as uint8 (so every dtype travels the same way, whatever gloo
   supports natively; gloo only copies bytes here, it reduces nothing).
The receiver sizes the metadata from the header and every tensor from the metadata, and receives each tensor
into a freshly allocated buffer: a payload it returned is never overwritten by a later message (sglang#15527
gave wrong outputs when proxy tensors were freed and reused while still in use). The sender's handle keeps
every buffer it sent (contiguous copies included) alive until the send completes; callers must not modify a
sent tensor in place before then.

Sending and receiving. `isend` posts every piece with `dist.isend` and returns a `SendHandle`. At most one
message is in flight per channel: `isend` first waits for the channel's previous message (`wait_send` waits
for the last). `recv(tag)` blocks until a message with that tag arrives; a message with another tag is parked
in a per-tag inbox, and a later `recv` of a parked tag returns at once (FIFO per tag). Nothing is reordered
within a tag. One thread per channel, and one channel per (group, direction, wire_tag): two channels on the
same pieces would split each other's messages.

Why the ring cannot deadlock. On gloo `dist.isend` never blocks its caller: it queues the buffer, and the
bytes move once the receiver posts the matching receive (gloo's rendezvous; even 8 bytes wait for it). So a
channel blocks in two places only: (a) `isend` waiting for the previous message, which completes once the
receiver's `recv` has taken it (for any tag: a parked message was taken too), and that `recv` needs nothing
more from the sender, since every piece was posted at once; (b) `recv`, which completes once the sender has
posted the message. In the ring every stage s, in iteration k, sends message k to s + 1 and receives message
k from s - 1 (`exchange`, send first). By induction on k: every stage finished iteration k - 1, so every
message k - 1 was received and every wait (a) of iteration k returns; posting message k does not block; so
every stage posts it and every `recv` of iteration k finds its message. Stages need not run in lock step:
each wait of iteration k depends on events of earlier iterations or on another stage *posting* (never
completing) in iteration k, so the waits form no cycle.
The rule this relies on: one message per channel per exchange. If every stage of a ring sent two messages
on one channel before receiving, each second `isend` would wait for a peer waiting in its own second `isend`
— a cycle. Send several message types per iteration on separate channels (distinct `wire_tag`s: gloo matches
each tag on its own) or bundle them into one payload.
Backends whose isend blocks until the receiver posts (`blocking_send=True` emulates one): send-first on every
stage deadlocks. `exchange(..., recv_first=recv_first_for_stage(pp_rank))` makes odd stages receive first.
A receive-first stage waits for its predecessor, which is even, so sends first and is already posting. A
send-first stage s waits for s + 1 to post its receive: at once if s + 1 is odd; otherwise s + 1 is stage 0
(s = pp_size - 1, even, for an odd pp_size), which itself waits only for stage 1, odd. Every chain of waits
ends at a stage that is not waiting on anyone: no cycle. Both orders are tested around a 3-stage ring, and
the blocking send-first ring is tested to deadlock.

Timeouts and failures. `recv(tag, timeout_s)` bounds the wait for the wanted message, parked ones included;
without it the group's own timeout (`init_distributed`'s `op_timeout_s`, torch's default otherwise) bounds
every piece, sends included. A timeout is fatal: gloo closes every connection this rank has on the group, to
all peers, not only the one waited on, so `PPChannelTimeout` is raised and every later call raises
`PPChannelError` (other users of the group on this rank fail too, and so does a peer's pending operation with
this rank: it sees "connection closed", a `PPChannelError`, rather than a timeout of its own). A failure
that is not a timeout closes only the connection it happened on. A peer that dies closes its sockets and the
pending operation fails at once with `PPChannelError`, instead of hanging.
"""

from __future__ import annotations

import pickle
import time
from collections import deque
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

MAGIC = 0x544C5050  # "TLPP"
_HEADER_WORDS = 2


class PPChannelError(RuntimeError):
    """The channel can no longer be used: a peer died, a stream came out of step, or a wait timed out."""


class PPChannelTimeout(PPChannelError, TimeoutError):
    """A receive (or send) did not complete within its bound; the channel is unusable afterwards."""


def recv_first_for_stage(pp_rank: int) -> bool:
    """The `exchange` order for backends whose isend blocks: odd stages receive first (see the module doc)."""
    return pp_rank % 2 == 1


class SendHandle:
    """One message's pieces in flight. Holds every buffer it sends until `wait` has seen them complete."""

    def __init__(self, works: list[Any], buffers: list[torch.Tensor], what: str) -> None:
        self._works = works
        self._buffers = buffers
        self._what = what
        self.error: PPChannelError | None = None

    @property
    def completed(self) -> bool:
        """True once `wait` returned (gloo reports completion only through a wait)."""
        return not self._works and self.error is None

    def wait(self, timeout_s: float | None = None) -> None:
        """Wait until every piece is sent, then release the buffers. Idempotent; re-raises a failure."""
        if self.error is not None:
            raise self.error
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self._works:
            try:
                _wait(self._works[0], deadline)
            except PPChannelError as e:
                self.error = type(e)(f"send of {self._what}: {e}")
                raise self.error from None
            self._works.pop(0)
        self._buffers = []


class PPChannel:
    """Typed messages to `peer_rank_send` and from `peer_rank_recv` (global ranks) over gloo `group`.

    `group` None means the default group. Either peer may be None for a one-way channel. `wire_tag` is the
    gloo tag every piece travels on: give each channel between the same ranks of one group its own.
    `blocking_send` makes `isend` wait for its own completion, as on a backend whose isend blocks (the tests
    run the alternating ring order with it).
    """

    def __init__(self, group: Any, peer_rank_send: int | None, peer_rank_recv: int | None, *,
                 wire_tag: int = 0, blocking_send: bool = False) -> None:
        group = dist.group.WORLD if group is None else group
        backend = dist.get_backend(group)
        if backend != "gloo":
            raise ValueError(f"PPChannel needs a gloo group (CPU tensors, pickled metadata); got {backend}")
        self._rank = dist.get_rank()
        members = dist.get_process_group_ranks(group)
        for name, peer in (("peer_rank_send", peer_rank_send), ("peer_rank_recv", peer_rank_recv)):
            if peer is None:
                continue
            if peer == self._rank:
                raise ValueError(f"{name} {peer} is this rank: a channel joins two different ranks")
            if peer not in members:
                raise ValueError(f"{name} {peer} is not in the group (ranks {members})")
        if self._rank not in members:
            raise ValueError(f"rank {self._rank} is not in the group (ranks {members})")
        self._group = group
        self._send_to = peer_rank_send
        self._recv_from = peer_rank_recv
        self._wire_tag = wire_tag
        self._blocking_send = blocking_send
        self._in_flight: SendHandle | None = None
        self._inbox: dict[str, deque[dict[Any, Any]]] = {}
        self._broken: PPChannelError | None = None

    # --- sending ---------------------------------------------------------------------------------------------

    def isend(self, tag: str, payload: Mapping[Any, Any]) -> SendHandle:
        """Post `payload` under `tag` to the send peer and return without waiting for it to be received.

        Waits first for the channel's previous message (at most one in flight). Raises ValueError/TypeError
        for a payload that cannot travel, before anything is sent.
        """
        self._check_usable()
        if self._send_to is None:
            raise ValueError("this channel has no send peer")
        pieces = _encode(tag, payload)  # encode while the previous message may still be moving
        self.wait_send()
        what = f"{tag!r} to rank {self._send_to}"
        try:
            works = [dist.isend(p, self._send_to, group=self._group, tag=self._wire_tag) for p in pieces]
        except RuntimeError as e:
            raise self._fail(PPChannelError(f"rank {self._rank}: posting {what} failed: {e}")) from None
        handle = SendHandle(works, pieces, what)
        self._in_flight = handle
        if self._blocking_send:
            self.wait_send()
        return handle

    def wait_send(self, timeout_s: float | None = None) -> None:
        """Wait until the last message sent on this channel has completed (a no-op when none is in flight)."""
        if self._in_flight is None:
            return
        try:
            self._in_flight.wait(timeout_s)
        except PPChannelError as e:
            raise self._fail(e) from None
        self._in_flight = None

    # --- receiving -------------------------------------------------------------------------------------------

    def recv(self, tag: str, timeout_s: float | None = None) -> dict[Any, Any]:
        """The next payload sent under `tag` (FIFO), blocking until it arrives.

        Messages of other tags arriving first are parked for later `recv`s. `timeout_s` bounds the whole
        wait; None leaves the group's timeout as the only bound. Raises PPChannelTimeout on a timeout and
        PPChannelError when the peer failed; the channel is unusable after either.
        """
        self._check_usable()
        if self._recv_from is None:
            raise ValueError("this channel has no receive peer")
        parked = self._inbox.get(tag)
        if parked:
            return parked.popleft()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            try:
                got_tag, payload = self._recv_message(deadline)
            except PPChannelError as e:
                raise self._fail(type(e)(f"rank {self._rank} waiting for {tag!r} from rank {self._recv_from}: "
                                         f"{e}")) from None
            if got_tag == tag:
                return payload
            self._inbox.setdefault(got_tag, deque()).append(payload)

    def parked(self, tag: str) -> int:
        """How many messages of `tag` wait in the inbox."""
        return len(self._inbox.get(tag, ()))

    def exchange(self, send_tag: str, payload: Mapping[Any, Any], recv_tag: str, *, recv_first: bool = False,
                 timeout_s: float | None = None) -> dict[Any, Any]:
        """Send `payload` to the next stage and receive `recv_tag` from the previous one, in the order that
        cannot deadlock around a ring (module doc): send first on gloo; on backends whose isend blocks,
        `recv_first=recv_first_for_stage(pp_rank)`. The send stays in flight when this returns."""
        if recv_first:
            received = self.recv(recv_tag, timeout_s)
            self.isend(send_tag, payload)
            return received
        self.isend(send_tag, payload)
        return self.recv(recv_tag, timeout_s)

    # --- internals -------------------------------------------------------------------------------------------

    def _recv_message(self, deadline: float | None) -> tuple[str, dict[Any, Any]]:
        header = torch.empty(_HEADER_WORDS, dtype=torch.int64)
        self._recv_piece(header, deadline)
        magic, size = (int(v) for v in header.tolist())
        if magic != MAGIC or size <= 0:
            raise PPChannelError(f"header {[magic, size]} is not a message header: the stream is out of step "
                                 f"(another user of wire_tag {self._wire_tag} on this group?)")
        meta = torch.empty(size, dtype=torch.uint8)
        self._recv_piece(meta, deadline)
        try:
            tag, entries = pickle.loads(meta.numpy().tobytes())
        except Exception as e:  # noqa: BLE001 - the rest of this message stays unread: the stream is lost
            raise PPChannelError(f"a message's metadata cannot be unpickled here: {type(e).__name__}: {e}") from None
        payload: dict[Any, Any] = {}
        wires = []
        for key, is_tensor, value in entries:
            if is_tensor:
                dtype, shape = value
                tensor = torch.empty(shape, dtype=dtype)  # fresh: never a buffer a caller still holds
                payload[key] = tensor
                if tensor.numel():
                    wires.append(tensor.view(-1).view(torch.uint8))
            else:
                payload[key] = value
        works = [dist.irecv(w, self._recv_from, group=self._group, tag=self._wire_tag) for w in wires]
        for work in works:
            _wait(work, deadline)
        return tag, payload

    def _recv_piece(self, buffer: torch.Tensor, deadline: float | None) -> None:
        try:
            work = dist.irecv(buffer, self._recv_from, group=self._group, tag=self._wire_tag)
        except RuntimeError as e:
            raise PPChannelError(str(e).splitlines()[0]) from None
        _wait(work, deadline)

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise PPChannelError(f"the channel failed earlier: {self._broken}")

    def _fail(self, error: PPChannelError) -> PPChannelError:
        self._broken = error
        return error


def _encode(tag: str, payload: Mapping[Any, Any]) -> list[torch.Tensor]:
    """The message's pieces (header, metadata, tensor bytes), ready for `dist.isend`."""
    if not isinstance(tag, str):
        raise TypeError(f"a message tag is a str, not {type(tag).__name__}")
    if not isinstance(payload, Mapping):
        raise TypeError(f"a payload is a dict, not {type(payload).__name__}")
    entries: list[tuple[Any, bool, Any]] = []
    wires: list[torch.Tensor] = []
    for key, value in payload.items():
        if not isinstance(value, torch.Tensor):
            entries.append((key, False, value))
            continue
        if value.device.type != "cpu" or value.layout != torch.strided:
            raise ValueError(f"payload[{key!r}]: only dense CPU tensors travel on a gloo channel "
                             f"(got {value.device.type}, {value.layout})")
        tensor = value.detach().resolve_conj().resolve_neg().contiguous()
        entries.append((key, True, (tensor.dtype, tuple(tensor.shape))))
        if tensor.numel():
            wires.append(tensor.view(-1).view(torch.uint8))
    try:
        meta = pickle.dumps((tag, entries), protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, TypeError, AttributeError) as e:
        raise TypeError(f"payload of {tag!r} cannot be pickled: {e}") from None
    header = torch.tensor([MAGIC, len(meta)], dtype=torch.int64)
    return [header, torch.frombuffer(bytearray(meta), dtype=torch.uint8), *wires]


def _wait(work: Any, deadline: float | None) -> None:
    """Wait for one gloo work item, up to `deadline` (monotonic; None: the group's timeout)."""
    try:
        if deadline is None:
            work.wait()
        else:
            remaining = deadline - time.monotonic()
            work.wait(timeout=timedelta(seconds=max(remaining, 0.001)))
    except RuntimeError as e:
        text = str(e).splitlines()[0] if str(e) else type(e).__name__
        if "timed out" in text.lower() or "timeout" in text.lower():
            raise PPChannelTimeout(text) from None
        raise PPChannelError(text) from None
