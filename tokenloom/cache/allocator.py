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

# Decode slots a request takes at once as one contiguous run (page size 1; `--decode-slot-run`): its next
# DECODE_RUN - 1 tokens' slots are reserved right after the one it uses now.
DECODE_RUN = 16
# Decode steps of up to this many requests allocate with Python ints (`TokenAllocator._alloc_decode_few`).
FEW_DECODE_REQUESTS = 8


class TokenAllocator:
    """Page size 1: any free slot serves any token.

    Decode locality: handing each running request the next free slot at every step would interleave the
    requests' decode KV (a request's consecutive tokens a batch size apart), and the paged attention kernel
    reads scattered rows at a fraction of the speed of contiguous ones (bench/attention_layout.py). So a
    decode token whose predecessor's next slot is reserved takes it; otherwise the request takes a run of up
    to `decode_run` free slots, uses the first and reserves the contiguous rest for its following tokens.

    Reservations are only a hint: reserved slots count as available, `alloc` takes them back when the
    unreserved ones run short, and freeing a slot releases the reservations chained after it.
    Invariant: `available_size() + slots in use == size`; a slot is never both reserved and in `_free`.
    """

    page_size = 1

    def __init__(self, size: int, device: torch.device, decode_run: int = DECODE_RUN) -> None:
        self.size = size
        self.device = device
        self.decode_run = max(1, decode_run)
        self.clear()

    def clear(self) -> None:
        self._free = torch.arange(1, self.size + 1, dtype=torch.int64, device=self.device)
        self._reserved = torch.zeros(self.size + 2, dtype=torch.bool, device=self.device)  # by slot id
        # the same flags as a NumPy view (CPU): `alloc_decode`'s few-request path reads and clears them by index
        self._reserved_flags = self._reserved.numpy() if self._reserved.device.type == "cpu" else None
        self._num_reserved = 0

    def available_size(self) -> int:
        return int(self._free.numel()) + self._num_reserved

    def full_available_size(self) -> int:
        """Free slots of the pool the prefix-cache accounting counts (the same here; see cache/swa_pool.py)."""
        return self.available_size()

    def free_slot_ids(self) -> torch.Tensor:
        """Every slot not in use, reserved ones included (for checks and tests)."""
        return torch.cat((self._free, self._reserved.nonzero().flatten()))

    def alloc(self, n: int) -> torch.Tensor | None:
        if n > self.available_size():
            return None
        if n > self._free.numel():
            self._release_all_reservations()
        out, self._free = self._free[:n], self._free[n:]
        return out

    def alloc_extend(self, prefix_lens: torch.Tensor, seq_lens: torch.Tensor,
                     last_slots: torch.Tensor) -> torch.Tensor | None:
        """Slots for tokens prefix_lens[i]..seq_lens[i]-1 of each request, concatenated in request order."""
        return self.alloc(int((seq_lens - prefix_lens).sum()))

    def alloc_decode(self, seq_lens: torch.Tensor, last_slots: torch.Tensor) -> torch.Tensor | None:
        """One slot per request for its token at position seq_lens[i]-1; `last_slots[i]` is the slot of
        position seq_lens[i]-2 (0 when there is none): its reserved successor is taken when there is one."""
        n = int(seq_lens.numel())
        if n > self.available_size():
            return None
        if n <= FEW_DECODE_REQUESTS and self._reserved_flags is not None:
            return self._alloc_decode_few(last_slots.tolist())
        nxt = last_slots.to(torch.int64) + 1
        hit = (last_slots > 0) & self._reserved[nxt.clamp(max=self.size + 1)]
        taken = nxt[hit]
        if taken.numel() > 1 and torch.unique(taken).numel() != taken.numel():
            # requests whose rows end at one shared cached slot: only the first takes its successor
            seen: set[int] = set()
            for i in hit.nonzero().flatten().tolist():
                slot = int(nxt[i])
                hit[i] = slot not in seen
                seen.add(slot)
            taken = nxt[hit]
        self._reserved[taken] = False
        self._num_reserved -= int(taken.numel())
        miss = int(n - taken.numel())
        out = torch.empty(n, dtype=torch.int64, device=self.device)
        out[hit] = taken
        if miss:
            out[~hit] = self._take_runs(miss)
        return out

    def _alloc_decode_few(self, last_slots: list[int]) -> torch.Tensor:
        """`alloc_decode` for a few requests on the CPU, with Python ints (the same choices as the tensor path:
        a reserved successor goes to the first request that follows it). A decode step's bookkeeping runs right
        after the step has streamed the weights through every cache level, when each small torch op costs
        10-40x its warm time; this path makes one tensor."""
        flags, end = self._reserved_flags, self.size + 1
        out: list[int] = []
        missing = 0
        for last in last_slots:
            nxt = last + 1
            if last > 0 and flags[min(nxt, end)]:
                flags[nxt] = False  # taken: a later request following the same slot misses
                self._num_reserved -= 1
                out.append(nxt)
            else:
                out.append(0)
                missing += 1
        if missing:
            fresh = iter(self._take_runs(missing).tolist())
            out = [slot or next(fresh) for slot in out]
        return torch.tensor(out, dtype=torch.int64, device=self.device)

    def _take_runs(self, count: int) -> torch.Tensor:
        """First slots of `count` fresh runs; the contiguous rest of each run is reserved."""
        run = min(self.decode_run, self._free.numel() // count)
        if run <= 1:
            return self.alloc(count)
        runs, self._free = self._free[: count * run].view(count, run), self._free[count * run:]
        follows = (runs[:, 1:] == runs[:, :-1] + 1).cumprod(1).bool()  # contiguous from each run's start
        rest = runs[:, 1:]
        keep = rest[follows]
        self._reserved[keep] = True
        self._num_reserved += int(keep.numel())
        self._free = torch.cat((rest[~follows], self._free))
        return runs[:, 0].clone()

    def _release_all_reservations(self) -> None:
        if self._num_reserved:
            self._free = torch.cat((self._free, self._reserved.nonzero().flatten()))
            self._reserved.zero_()
            self._num_reserved = 0

    def free(self, slots: torch.Tensor) -> None:
        if not slots.numel():
            return
        slots = slots.to(torch.int64)
        self._free = torch.cat((self._free, slots))
        # release the reservations chained after each freed slot (a run holds at most decode_run - 1)
        nxt = slots + 1
        for _ in range(self.decode_run - 1):
            if not self._num_reserved:
                break
            nxt = nxt[self._reserved[nxt.clamp(max=self.size + 1)]]
            if not nxt.numel():
                break
            self._reserved[nxt] = False
            self._num_reserved -= int(nxt.numel())
            self._free = torch.cat((self._free, nxt))
            nxt = nxt + 1


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

    def full_available_size(self) -> int:
        return self.available_size()

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
