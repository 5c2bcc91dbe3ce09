"""Free lists of KV slots: `TokenAllocator` (page size 1) and `PagedAllocator` (page size > 1).

Slot 0 of the KV pool is a dummy that padded tokens may write to; allocators hand out slots 1..size.
A request's slots come from `alloc_extend` (its new prompt/chunk tokens, continuing its last partial page)
and `alloc_decode` (one token each; a new page only when the previous one is full), and go back through
`free`. Freeing a paged request's slots returns whole pages: callers free every slot of each page they
own, and the allocator keys pages by `slot // page_size`.
Invariant: `available_size() + slots in use == size` (checked by the radix cache's integrity check).
"""

from __future__ import annotations

import torch


class TokenAllocator:
    """Page size 1: any free slot serves any token."""

    page_size = 1

    def __init__(self, size: int, device: torch.device) -> None:
        self.size = size
        self.device = device
        self.clear()

    def clear(self) -> None:
        self._free = torch.arange(1, self.size + 1, dtype=torch.int64, device=self.device)

    def available_size(self) -> int:
        return int(self._free.numel())

    def alloc(self, n: int) -> torch.Tensor | None:
        if n > self._free.numel():
            return None
        out, self._free = self._free[:n], self._free[n:]
        return out

    def alloc_extend(self, prefix_lens: torch.Tensor, seq_lens: torch.Tensor,
                     last_slots: torch.Tensor) -> torch.Tensor | None:
        """Slots for tokens prefix_lens[i]..seq_lens[i]-1 of each request, concatenated in request order."""
        return self.alloc(int((seq_lens - prefix_lens).sum()))

    def alloc_decode(self, seq_lens: torch.Tensor, last_slots: torch.Tensor) -> torch.Tensor | None:
        """One slot per request for its token at position seq_lens[i]-1."""
        return self.alloc(int(seq_lens.numel()))

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel():
            self._free = torch.cat((self._free, slots.to(torch.int64)))


class PagedAllocator:
    """Page size > 1: slot s lives in page s // page_size; a request fills its pages in order.

    Pages are numbered 1..num_pages (page 0 holds the dummy slot 0), so slot ids run from page_size to
    (num_pages + 1) * page_size - 1. `size` counts slots in whole pages.
    """

    def __init__(self, size: int, page_size: int, device: torch.device) -> None:
        self.page_size = page_size
        self.num_pages = size // page_size
        self.size = self.num_pages * page_size
        self.device = device
        self.clear()

    def clear(self) -> None:
        self._free_pages = torch.arange(1, self.num_pages + 1, dtype=torch.int64, device=self.device)

    def available_size(self) -> int:
        return int(self._free_pages.numel()) * self.page_size

    def alloc(self, n: int) -> torch.Tensor | None:
        """Whole fresh pages for `n` tokens (used when a request starts on a page boundary)."""
        pages = -(-n // self.page_size)
        if pages > self._free_pages.numel():
            return None
        taken, self._free_pages = self._free_pages[:pages], self._free_pages[pages:]
        slots = (taken[:, None] * self.page_size + torch.arange(self.page_size, device=self.device)).flatten()
        return slots[:n]

    def alloc_extend(self, prefix_lens: torch.Tensor, seq_lens: torch.Tensor,
                     last_slots: torch.Tensor) -> torch.Tensor | None:
        """Slots for positions prefix_lens[i]..seq_lens[i]-1, continuing each request's partial last page.

        `last_slots[i]` is the slot of position prefix_lens[i]-1 (ignored when prefix_lens[i] is a page
        multiple, including 0). Vectorized: every new token either continues the partial page or lands in a
        newly taken page, at offset position % page_size.
        """
        p = self.page_size
        prefix_lens, seq_lens = prefix_lens.to(torch.int64), seq_lens.to(torch.int64)
        extend = seq_lens - prefix_lens
        first_new_page_pos = (prefix_lens + p - 1) // p * p  # first position that needs a fresh page
        new_pages = (seq_lens + p - 1) // p - (prefix_lens + p - 1) // p
        total_pages = int(new_pages.sum())
        if total_pages > self._free_pages.numel():
            return None
        taken, self._free_pages = self._free_pages[:total_pages], self._free_pages[total_pages:]
        req = torch.repeat_interleave(torch.arange(extend.numel(), device=self.device), extend)
        starts = torch.cumsum(extend, 0) - extend
        pos = prefix_lens[req] + torch.arange(int(extend.sum()), device=self.device) - starts[req]
        page_base = torch.cumsum(new_pages, 0) - new_pages  # index into `taken` of each req's first page
        in_new = pos >= first_new_page_pos[req]
        new_page_idx = page_base[req] + (pos - first_new_page_pos[req]).clamp(min=0) // p
        new_slot = taken[new_page_idx.clamp(max=max(total_pages - 1, 0))] * p + pos % p if total_pages else pos
        old_slot = (last_slots.to(torch.int64)[req] // p) * p + pos % p
        return torch.where(in_new, new_slot, old_slot)

    def alloc_decode(self, seq_lens: torch.Tensor, last_slots: torch.Tensor) -> torch.Tensor | None:
        """One slot per request for position seq_lens[i]-1; `last_slots[i]` is the slot of position-1."""
        ones = torch.ones_like(seq_lens)
        return self.alloc_extend(seq_lens - ones, seq_lens, last_slots)

    def free(self, slots: torch.Tensor) -> None:
        """Return the pages that `slots` touch. Callers free all slots of the pages they own at once."""
        if slots.numel():
            pages = torch.unique(slots.to(torch.int64) // self.page_size)
            self._free_pages = torch.cat((self._free_pages, pages))
