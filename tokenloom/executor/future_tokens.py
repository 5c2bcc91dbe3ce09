"""`FutureTokenBuffer`: where sampled tokens wait for batches scheduled before they were known.

With the overlap scheduler, batch k+1 is built while batch k still runs, so a request's next input token is
not known yet. Its input id is written as a placeholder `-(slot + 1)`; batch k's sampler stores its tokens
at `slot`s reserved when k was launched, and batch k+1 resolves its placeholders when it starts on the
forward thread (or stream). Forward steps run one after another, so k's store always precedes k+1's read.

Invariant: slots are handed out round-robin from a ring larger than two batches, so the slots of the two
batches that can be in flight at once never overlap.
"""

from __future__ import annotations

import torch


def placeholder(slot: int) -> int:
    """The input id that stands for the token stored at `slot`."""
    return -(slot + 1)


class FutureTokenBuffer:
    def __init__(self, max_batch_size: int, device: torch.device) -> None:
        self.size = 2 * max_batch_size + 2
        self.max_batch_size = max_batch_size
        self.tokens = torch.zeros(self.size, dtype=torch.int64, device=device)
        self.device = device
        self._next = 0

    def reserve(self, n: int) -> torch.Tensor:
        """Slots for one batch's `n` sampled tokens (scheduler side)."""
        if n > self.max_batch_size:
            raise ValueError(f"batch of {n} exceeds the future-token buffer's {self.max_batch_size}")
        slots = (torch.arange(n, dtype=torch.int64) + self._next) % self.size
        self._next = (self._next + n) % self.size
        return slots.to(self.device)

    def resolve(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Replace placeholders by the tokens stored for them (forward side)."""
        slots = (-input_ids - 1).clamp(min=0)
        return torch.where(input_ids < 0, self.tokens[slots], input_ids)

    def lookup(self, slots: torch.Tensor) -> torch.Tensor:
        return self.tokens[slots]

    def store(self, slots: torch.Tensor, token_ids: torch.Tensor) -> None:
        self.tokens[slots] = token_ids
