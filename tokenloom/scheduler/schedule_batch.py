"""`ScheduleBatch`: the scheduler's plan for one step (a list of `Req`s and a mode), and the memory
bookkeeping that turns it into a `ForwardBatch`.

`prepare_for_extend` gives admitted requests a row, writes their cached prefix into it and allocates KV
slots for their new tokens; `prepare_for_decode` allocates one slot per running request; `reserve` gives one
request a row and slots outside any batch (KV that arrives from elsewhere), `free` gives them back uncached.
All evict from the prefix cache first when the allocator is short. Per-request tensors are built in request
order.

Both advance `req.kv_len` when the batch is planned, not when its results arrive: with the overlap
scheduler the next batch is planned while this one runs, and must already see these tokens as placed.
A decode batch carries no input ids: the worker reads each request's newest sampled token from its token
table by request row on the forward side (executor/token_table.py), known there even when the step that
sampled it is not processed yet (the overlap scheduler).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenloom.cache.prefix_cache import PrefixCache
from tokenloom.cache.req_to_token import ReqToTokenPool
from tokenloom.forward_batch import ForwardBatch, ForwardMode
from tokenloom.scheduler.req import Req


class KVCacheOOM(RuntimeError):
    """The KV pool cannot hold what the scheduler admitted (a budgeting bug, never expected)."""


@dataclass
class ScheduleBatch:
    reqs: list[Req]
    forward_mode: ForwardMode
    input_ids: torch.Tensor | None = None
    req_pool_indices: torch.Tensor | None = None
    prefix_lens: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    out_cache_loc: torch.Tensor | None = None
    # Launched (prepared for the forward) by the scheduler.
    launched: bool = False
    # Decode batch of exactly the previous (launched) step's decode requests, in order: the vectorized path.
    same_reqs_as_last_decode: bool = False
    # Decode batches: the requests' prompt lengths (carried from one step of the same requests to the next) and
    # the longest `kv_len` after this step, so `to_forward_batch` builds no tensor it can reuse.
    prompt_lens: torch.Tensor | None = None
    max_seq_len: int = 0
    kv_total: int = 0  # decode batches: the sum of the requests' `kv_len` after this step

    @property
    def batch_size(self) -> int:
        return len(self.reqs)

    def is_empty(self) -> bool:
        return not self.reqs

    def to_forward_batch(self, return_all_logits: bool = False) -> ForwardBatch:
        if self.forward_mode.is_decode() and self.prompt_lens is not None and not return_all_logits:
            return ForwardBatch.build_decode(self.input_ids, self.req_pool_indices, self.prefix_lens, self.seq_lens,
                                             self.out_cache_loc, self.max_seq_len, self.prompt_lens, self.kv_total)
        prompt_lens = torch.tensor([len(r.origin_input_ids) for r in self.reqs], dtype=torch.int64)
        return ForwardBatch.build(self.forward_mode, self.input_ids, self.req_pool_indices, self.prefix_lens,
                                  self.seq_lens, self.out_cache_loc, return_all_logits, prompt_lens)


class BatchMemory:
    """Allocates request rows and KV slots for batches, evicting from the prefix cache when short."""

    def __init__(self, req_to_token_pool: ReqToTokenPool, allocator, tree_cache: PrefixCache,
                 device: torch.device) -> None:
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.tree_cache = tree_cache
        self.device = device

    def available_tokens(self) -> int:
        return self.allocator.available_size() + self.tree_cache.evictable_size()

    def _ensure(self, tokens: int) -> None:
        short = tokens - self.allocator.available_size()
        if short > 0:
            self.tree_cache.evict(short)

    def prepare_for_extend(self, reqs: list[Req]) -> ScheduleBatch:
        need_rows = [r for r in reqs if r.req_pool_idx is None]
        rows = self.req_to_token_pool.alloc(len(need_rows))
        if rows is None:
            raise KVCacheOOM("no free request rows for an admitted batch")
        for req, row in zip(need_rows, rows, strict=True):
            req.req_pool_idx = row
            if req.prefix_len:  # a fresh match: point the row at the tree's slots
                self.req_to_token_pool.req_to_token[row, : req.prefix_len] = req.prefix_indices.to(torch.int32)
        return self._extend_batch(reqs, [r.prefix_len for r in reqs], "an admitted prefill")

    def prepare_for_jump(self, reqs: list[Req]) -> ScheduleBatch:
        """An extend of requests that hold their row and the KV of their first `kv_len` tokens by the rest of
        their tokens (jump-forward, scheduler/jump_forward.py: the forced tokens, after the last sampled token
        when no decode step computed it), over their own KV as prefix (not a cache match)."""
        for req in reqs:
            req.fill_ids = req.all_ids()
            req.extend_input_len = len(req.fill_ids) - req.kv_len
        return self._extend_batch(list(reqs), [r.kv_len for r in reqs], "a jump-forward extend")

    def _extend_batch(self, reqs: list[Req], prefix_lens: list[int], what: str) -> ScheduleBatch:
        """The extend of `reqs` (each holding its row) by `fill_ids[prefix_len:]` over the KV of its first
        `prefix_len` tokens: slots allocated for the new tokens, `kv_len` advanced to the whole of `fill_ids`."""
        device = self.device
        prefix = torch.tensor(prefix_lens, dtype=torch.int64, device=device)
        seq = torch.tensor([len(r.fill_ids) for r in reqs], dtype=torch.int64, device=device)
        row_t = torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64, device=device)
        slots = self._alloc_extend(row_t, prefix, seq)
        if slots is None:
            raise KVCacheOOM(f"KV pool cannot hold {what} of {int((seq - prefix).sum())} tokens")
        ids = [t for r, n in zip(reqs, prefix_lens, strict=True) for t in r.fill_ids[n:]]
        for req in reqs:
            req.kv_len = len(req.fill_ids)
        return ScheduleBatch(reqs=reqs, forward_mode=ForwardMode.EXTEND,
                             input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
                             req_pool_indices=row_t, prefix_lens=prefix, seq_lens=seq, out_cache_loc=slots)

    def _alloc_extend(self, rows: torch.Tensor, prefix: torch.Tensor, seq: torch.Tensor) -> torch.Tensor | None:
        """Slots for positions prefix[i]..seq[i]-1 of each row, evicting from the prefix cache first when the
        allocator is short (None: the pool cannot hold them even then)."""
        page = self.allocator.page_size
        self._ensure(int((seq - prefix).sum()) + int(rows.numel()) * (page - 1))
        return self.allocator.alloc_extend(prefix, seq, self._last_slots(rows, prefix))

    def reserve(self, req: Req, tokens: int, swa_tail: int | None = None) -> torch.Tensor:
        """A row and KV slots for `tokens` tokens of `req` (none cached), without a batch: for KV that
        arrives from elsewhere or comes back from host memory. Sets the row, its slots and `kv_len`; returns
        the slots (int64, in token order). The caller checked that they fit (`available_tokens`, a free row).
        `swa_tail` (a sliding-window pool): only the last that many tokens get sliding-layer slots."""
        rows = self.req_to_token_pool.alloc(1)
        if rows is None:
            raise KVCacheOOM("no free request row for a KV reservation")
        row_t = torch.tensor(rows, dtype=torch.int64, device=self.device)
        zero = torch.zeros(1, dtype=torch.int64, device=self.device)
        if swa_tail is not None and hasattr(self.allocator, "alloc_tail"):
            self._ensure(tokens)
            slots = self.allocator.alloc_tail(tokens, swa_tail)
        else:
            slots = self._alloc_extend(row_t, zero, torch.tensor([tokens], dtype=torch.int64, device=self.device))
        if slots is None:
            self.req_to_token_pool.free(rows[0])
            raise KVCacheOOM(f"KV pool cannot hold a reservation of {tokens} tokens")
        self.req_to_token_pool.req_to_token[rows[0], :tokens] = slots.to(torch.int32)
        req.req_pool_idx = rows[0]
        req.kv_len = tokens
        return slots

    def slots(self, req: Req, start: int = 0, end: int | None = None) -> torch.Tensor:
        """The KV slots (int64) of `req`'s tokens [start, end) (end: its `kv_len`)."""
        return self.req_to_token_pool.req_to_token[req.req_pool_idx, start: req.kv_len if end is None else end] \
            .to(torch.int64)

    def free(self, req: Req) -> None:
        """Give back `req`'s row and KV slots without caching them (KV nobody will match: never decoded here,
        or copied elsewhere); `req` then holds no KV (`kv_len` 0)."""
        if req.req_pool_idx is None:
            return
        if req.kv_len:
            self.allocator.free(self.slots(req))
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx = None
        req.kv_len = 0

    def decode_tokens_needed(self, reqs: list[Req]) -> int:
        """Free slots a decode step of `reqs` needs (a new page only where the last one is full)."""
        page = self.allocator.page_size
        if page == 1:
            return len(reqs)
        return sum(page for r in reqs if r.kv_len % page == 0)

    def prepare_for_decode(self, reqs: list[Req], last: ScheduleBatch | None = None) -> ScheduleBatch:
        """One new slot per request. When the requests are exactly those of `last` (the lane's previous decode
        batch, launched: the steady state), rows, lengths, prompt lengths and the input-id placeholder are its
        tensors (lengths advanced by one), and the slot each request's new one follows is the one `last`
        allocated: no Python loop or table read builds them. The input ids are not built here at all (the
        worker gathers them from its token table); `input_ids` is a placeholder of the right shape.

        Why so few tensor ops: this runs right after a decode step has streamed the weights through every cache
        level, when each small torch op costs 10-40x its warm time (dispatch code and data come back from
        memory); the per-step bookkeeping was ~10% of a batch-1 served token."""
        device = self.device
        self._ensure(self.decode_tokens_needed(reqs))
        same = last is not None and last.launched and last.reqs == reqs and last.prompt_lens is not None
        if same:
            row_t, kv, prompt_lens, ids = last.req_pool_indices, last.seq_lens, last.prompt_lens, last.input_ids
            last_slots = last.out_cache_loc  # the slot of position kv - 1: what `last` allocated
        else:
            row_t = torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64, device=device)
            kv = torch.tensor([r.kv_len for r in reqs], dtype=torch.int64, device=device)
            prompt_lens = torch.tensor([len(r.origin_input_ids) for r in reqs], dtype=torch.int64, device=device)
            ids = torch.zeros(len(reqs), dtype=torch.int64, device=device)  # read from the token table later
            last_slots = self._last_slots(row_t, kv)
        seq = kv + 1
        slots = self.allocator.alloc_decode(seq, last_slots)
        if slots is None:
            raise KVCacheOOM("KV pool cannot hold a decode step (retraction should have prevented this)")
        longest = total = 0
        for req in reqs:
            req.kv_len += 1
            longest = max(longest, req.kv_len)
            total += req.kv_len
        batch = ScheduleBatch(reqs=list(reqs), forward_mode=ForwardMode.DECODE, input_ids=ids,
                              req_pool_indices=row_t, prefix_lens=kv, seq_lens=seq, out_cache_loc=slots,
                              same_reqs_as_last_decode=same, prompt_lens=prompt_lens, max_seq_len=longest,
                              kv_total=total)
        return batch

    def _last_slots(self, rows: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        """Slot of position len-1 of each row (0 where len is 0): where a partial page continues."""
        pos = (lens - 1).clamp(min=0)
        return self.req_to_token_pool.req_to_token[rows, pos].to(torch.int64)
