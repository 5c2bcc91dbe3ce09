"""`AuxBuffer`: the metadata ("aux") slots of a disaggregated request, in one tensor a transfer engine registers.

A decode rank pre-allocates one slot per request with its KV; the prefill rank that samples (the aux writer)
writes the slot after the request's last KV chunk: the first output token, its logprob, top logprobs and
requested token-id logprobs, the cached-token count and the bootstrap room. The decode rank trusts the first
token only when the slot's room is the request's (a slot left over from another request, or never written,
fails validation instead of producing a wrong token).

Slot layout (SLOT_BYTES bytes): room (int64, little-endian), payload length (int32), payload (UTF-8 JSON).
A freed slot is zeroed (room 0: "not written"). Rooms are the router's 63-bit ids; room 0 is never valid
for a real request because the slot then reads as unwritten (SGLang's convention).
"""

from __future__ import annotations

import json
import struct
from typing import Any

import torch

SLOT_BYTES = 16384
_HEADER = struct.Struct("<qi")


class AuxSlotError(ValueError):
    """A slot that does not hold the expected request's metadata."""


def encode_aux(room: int, payload: dict[str, Any]) -> bytes:
    """The bytes of one slot (header and JSON payload); raises ValueError when the payload does not fit."""
    body = json.dumps(payload, separators=(",", ":")).encode()
    if _HEADER.size + len(body) > SLOT_BYTES:
        raise ValueError(f"aux metadata of {len(body)} bytes does not fit a {SLOT_BYTES}-byte slot "
                         "(too many top logprobs?)")
    return _HEADER.pack(room, len(body)) + body


class AuxBuffer:
    """`num_slots` metadata slots; `alloc`/`free` hand out slot indices (the scheduler's thread only)."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.tensor = torch.zeros(num_slots, SLOT_BYTES, dtype=torch.uint8)
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def base_addr(self) -> int:
        return self.tensor.data_ptr()

    @property
    def nbytes(self) -> int:
        return self.tensor.numel()

    def slot_addr(self, index: int) -> int:
        return self.base_addr + index * SLOT_BYTES

    def available(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, index: int) -> None:
        self.tensor[index].zero_()
        self._free.append(index)

    def write(self, index: int, data: bytes) -> None:
        """Place encoded slot bytes locally (the writer stages them here before the transfer)."""
        self.tensor[index, : len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)

    def read(self, index: int, room: int) -> dict[str, Any]:
        """The payload of slot `index`, checked to belong to `room`; raises AuxSlotError otherwise."""
        raw = self.tensor[index].numpy().tobytes()
        found, length = _HEADER.unpack_from(raw)
        if found != room:
            what = "was never written" if found == 0 else f"holds room {found}"
            raise AuxSlotError(f"metadata slot {index} {what}, expected room {room} (context corruption)")
        if not 0 < length <= SLOT_BYTES - _HEADER.size:
            raise AuxSlotError(f"metadata slot {index} has a bad payload length {length}")
        return json.loads(raw[_HEADER.size: _HEADER.size + length])
