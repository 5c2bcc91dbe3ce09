"""A TP group's shared-memory collectives on one host (csrc/shm_allreduce.c): all-reduce and all-gather
through a segment in /dev/shm instead of gloo over loopback, which costs ~1 ms a call even for a few KB.

Lifecycle: `ShmCommunicator.create(ctx)` is collective over `ctx.tp_cpu_group` (every TP rank calls it, in
the same order as its other collectives on that group). TP rank 0 creates a zero-filled file under /dev/shm
with a unique name, broadcasts the name, every rank maps it, the ranks agree (a MIN-reduce that is also the
barrier) that every one of them mapped it, and rank 0 unlinks the name: from then on the segment lives
exactly as long as the last process mapping it, so nothing is left in /dev/shm even after kill -9 (only a
rank 0 killed inside `create` can leave a file). When the native library is unavailable on any rank, or
any rank cannot map the segment, every rank gets None (the same decision everywhere, so none waits on a
collective the others skipped) and callers keep gloo.

Invariants: every TP rank calls the collectives in the same order with tensors of the same size and dtype
(the protocol pairs the ranks' calls by their count); one thread per communicator. Results are bit-identical
on every rank: contributions are summed in rank order in float32 and rounded once to bf16. A peer that does
not arrive within `timeout_s` raises `CollectiveTimeout` naming it; the communicator is then unusable.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import secrets

import torch
import torch.distributed as dist

from tokenloom.distributed.comm import broadcast_pyobj
from tokenloom.distributed.parallel_state import ParallelContext
from tokenloom.kernels.cpu_build import load_library

logger = logging.getLogger(__name__)

# How long a collective waits for its peers before raising CollectiveTimeout. It must cover the longest
# legitimate skew between ranks inside a forward pass (one rank descheduled or swapping), and it bounds how
# long a surviving rank hangs when a peer died.
DEFAULT_TIMEOUT_S = 60.0
DEFAULT_SLOT_BYTES = 4 << 20  # per rank and parity; larger tensors go in pieces of this size
SHM_DIR = "/dev/shm"
NAME_PREFIX = "tokenloom-shm-"

_TIMEOUT = -1  # the C functions' status for a peer that did not arrive (-2: bad arguments)
_DTYPES = (torch.bfloat16, torch.float32)


class CollectiveTimeout(RuntimeError):
    """A peer did not arrive at a shared-memory collective within the timeout (it died, hung, or took a
    different path); the message names its global rank."""


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Declare the prototypes of csrc/shm_allreduce.c's entry points (pointers must not be truncated to int)."""
    vp, i64, cint = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.shm_comm_bytes.argtypes, lib.shm_comm_bytes.restype = [cint, i64], i64
    lib.shm_comm_open.argtypes, lib.shm_comm_open.restype = [vp, cint, cint, i64, ctypes.c_double], vp
    lib.shm_comm_close.argtypes, lib.shm_comm_close.restype = [vp], None
    lib.shm_comm_missing_rank.argtypes, lib.shm_comm_missing_rank.restype = [vp], cint
    for name in ("shm_allreduce_bf16", "shm_allreduce_f32"):
        getattr(lib, name).argtypes, getattr(lib, name).restype = [vp, vp, i64, cint], cint
    lib.shm_allgather.argtypes, lib.shm_allgather.restype = [vp, vp, i64, vp, cint], cint
    return lib


def _all_ranks_ok(ok: bool, ctx: ParallelContext) -> bool:
    """MIN of every TP rank's `ok` over tp_cpu_group: the same answer everywhere, and a barrier."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=ctx.tp_cpu_group)
    return bool(flag.item())


class ShmCommunicator:
    """A TP group's shared-memory collectives on one host. Build with `create`; `close` when done."""

    def __init__(self, ctx: ParallelContext, lib: ctypes.CDLL, mapping: mmap.mmap, path: str,
                 slot_bytes: int, timeout_s: float) -> None:
        self._ctx, self._lib, self._mmap, self.path = ctx, lib, mapping, path
        self.slot_bytes, self.timeout_s = slot_bytes, timeout_s
        # The buffer export pins the mapping; it is released in close() before the mapping is closed.
        self._base = ctypes.c_char.from_buffer(mapping)
        handle = lib.shm_comm_open(ctypes.addressof(self._base), ctx.tp_rank, ctx.tp_size, slot_bytes, timeout_s)
        if not handle:
            del self._base
            mapping.close()
            raise ValueError(f"shm_comm_open rejected rank {ctx.tp_rank} of {ctx.tp_size}, "
                             f"slot_bytes={slot_bytes}, timeout_s={timeout_s}")
        self._handle: int | None = handle

    @classmethod
    def create(cls, ctx: ParallelContext, *, slot_bytes: int = DEFAULT_SLOT_BYTES,
               timeout_s: float = DEFAULT_TIMEOUT_S) -> ShmCommunicator | None:
        """Collective over ctx.tp_cpu_group: the group's communicator, or None on every rank (reason logged)
        when the native library or the segment is unavailable anywhere. `slot_bytes`: a positive multiple
        of 64; the segment holds 2 * tp_size slots."""
        if ctx.tp_size == 1:
            raise ValueError("a shared-memory communicator needs tp_size > 1")
        if slot_bytes <= 0 or slot_bytes % 64 or not timeout_s > 0:  # checked on every rank, before any collective
            raise ValueError(f"slot_bytes must be a positive multiple of 64 (got {slot_bytes}) and timeout_s "
                             f"positive (got {timeout_s})")
        lib = load_library("kernels")
        path: str | None = None
        if ctx.tp_rank == 0:
            if lib is None:
                logger.warning("native kernels unavailable; tensor-parallel collectives stay on gloo")
            else:
                path = cls._create_segment(_bind(lib), ctx.tp_size, slot_bytes)
        try:
            path = broadcast_pyobj(path, ctx)
            comm, reason = None, "rank 0 could not create the segment"
            if path is not None and lib is None:
                reason = f"native kernels unavailable on tp rank {ctx.tp_rank}"
            elif path is not None:
                try:
                    comm = cls._attach(ctx, _bind(lib), path, slot_bytes, timeout_s)
                except (OSError, ValueError) as e:
                    reason = f"tp rank {ctx.tp_rank} cannot map {path}: {e}"
            agreed = _all_ranks_ok(comm is not None, ctx)
        finally:
            if ctx.tp_rank == 0 and path is not None:
                os.unlink(path)
        if not agreed:
            if comm is not None:
                comm.close()
                reason = "another tp rank failed to map the segment"
            logger.warning("shared-memory collectives unavailable (%s); tensor-parallel collectives stay on gloo",
                           reason)
            return None
        comm._first_round()
        return comm

    def _first_round(self) -> None:
        """Gather every rank's TP rank through the segment: proof that all ranks share the same memory, and the
        barrier that makes `create` return only after rank 0 unlinked the name (it unlinks before arriving)."""
        ranks = self.all_gather_last_dim(torch.tensor([self._ctx.tp_rank], dtype=torch.int32))
        if ranks.tolist() != list(range(self._ctx.tp_size)):
            self.close()
            raise RuntimeError(f"shared-memory segment is not shared: the ranks wrote {ranks.tolist()}")

    @staticmethod
    def _create_segment(lib: ctypes.CDLL, world: int, slot_bytes: int) -> str | None:
        """Rank 0: a new zero-filled file of the segment's size under /dev/shm; its path, or None (logged)."""
        size = lib.shm_comm_bytes(world, slot_bytes)
        if size < 0:
            logger.warning("no segment for %d ranks of %d-byte slots", world, slot_bytes)
            return None
        path = os.path.join(SHM_DIR, f"{NAME_PREFIX}{os.getpid()}-{secrets.token_hex(8)}")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as e:
            logger.warning("cannot create %s: %s", path, e)
            return None
        try:
            os.ftruncate(fd, size)  # tmpfs: reads as zeros until written
        except OSError as e:
            logger.warning("cannot size %s to %d bytes: %s", path, size, e)
            os.unlink(path)
            return None
        finally:
            os.close(fd)
        return path

    @classmethod
    def _attach(cls, ctx: ParallelContext, lib: ctypes.CDLL, path: str, slot_bytes: int,
                timeout_s: float) -> ShmCommunicator:
        size = lib.shm_comm_bytes(ctx.tp_size, slot_bytes)
        fd = os.open(path, os.O_RDWR)
        try:
            if os.fstat(fd).st_size != size:
                raise ValueError(f"segment is {os.fstat(fd).st_size} bytes, expected {size}")
            # MAP_POPULATE: fault the pages in now rather than in the first collectives
            mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        finally:
            os.close(fd)
        return cls(ctx, lib, mapping, path, slot_bytes, timeout_s)

    # --- collectives --------------------------------------------------------------------------------------

    @property
    def handle(self) -> int:
        """The C `tl_shm_comm *`, for passing to other functions of the same native library."""
        if self._handle is None:
            raise RuntimeError("the shared-memory communicator is closed")
        return self._handle

    def handles(self, x: torch.Tensor) -> bool:
        """Whether `all_reduce_` and `all_gather_last_dim` take `x` (an open communicator; a contiguous CPU
        bf16 or float32 tensor of at least one dimension); otherwise callers use torch.distributed. Depends on
        the tensor's properties only, so ranks running the same code on same-shaped tensors decide alike (a
        rank on shm and its peer on gloo would both wait forever)."""
        return (self._handle is not None and x.device.type == "cpu" and x.dtype in _DTYPES and x.dim() > 0
                and x.is_contiguous())

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the TP group in place (contiguous CPU bf16 or float32) and return it."""
        if x.dtype == torch.bfloat16:
            fn = self._lib.shm_allreduce_bf16
        elif x.dtype == torch.float32:
            fn = self._lib.shm_allreduce_f32
        else:
            raise TypeError(f"shared-memory all-reduce takes bfloat16 or float32, not {x.dtype}")
        self._check_layout(x)
        self._raise_on(fn(self.handle, x.data_ptr(), x.numel(), torch.get_num_threads()), "all-reduce")
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate each rank's shard along the last dimension (as ParallelContext.all_gather_last_dim)."""
        if x.device.type != "cpu" or x.dim() == 0:
            raise ValueError(f"shared-memory all-gather takes CPU tensors of at least one dimension "
                             f"(got {x.dim()} dims on {x.device})")
        x = x.contiguous()
        world = self._ctx.tp_size
        out = torch.empty((world, *x.shape), dtype=x.dtype)
        nbytes = x.numel() * x.element_size()
        self._raise_on(self._lib.shm_allgather(self.handle, x.data_ptr(), nbytes, out.data_ptr(),
                                               torch.get_num_threads()), "all-gather")
        # out[w, ..., j] -> result[..., w * d + j]; a view when the leading dims hold one row
        return out.movedim(0, -2).reshape(*x.shape[:-1], world * x.shape[-1])

    def raise_timeout(self, what: str) -> None:
        """Raise the `CollectiveTimeout` of a collective that another native function of the library (the
        native decode step) called through `handle` and that timed out."""
        self._raise_on(_TIMEOUT, what)

    def close(self) -> None:
        """Free the handle and unmap the segment (idempotent). The segment's memory goes with the last rank."""
        if self._handle is None:
            return
        self._lib.shm_comm_close(self._handle)
        self._handle = None
        del self._base
        self._mmap.close()

    # --- helpers ------------------------------------------------------------------------------------------

    @staticmethod
    def _check_layout(x: torch.Tensor) -> None:
        if x.device.type != "cpu" or not x.is_contiguous():
            raise ValueError(f"shared-memory all-reduce takes contiguous CPU tensors "
                             f"(got device {x.device}, contiguous={x.is_contiguous()})")

    def _raise_on(self, status: int, what: str) -> None:
        if status == 0:
            return
        if status == _TIMEOUT:
            tp = self._lib.shm_comm_missing_rank(self.handle)  # >= 0 once a wait timed out
            raise CollectiveTimeout(f"tensor-parallel {what}: rank {self._ctx.tp_ranks[tp]} (tp {tp}) did not "
                                    f"arrive within {self.timeout_s:g} s")
        raise ValueError(f"shm {what} rejected its arguments (status {status})")
