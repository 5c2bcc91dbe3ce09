"""The only module that touches `torch.cuda`: device resolution, synchronisation, memory information.

Everything else asks this module, so the same code runs on the CPU (where streams and synchronisation are
no-ops) and on CUDA.
"""

from __future__ import annotations

import os

import torch


def resolve_device(name: str) -> torch.device:
    """Turn a `--device` value into a torch.device, failing clearly when CUDA is asked for but absent."""
    device = torch.device(name)
    reason = device_unavailable_reason(name)
    if reason is not None:
        raise RuntimeError(f"--device {name}: {reason}")
    return device


def device_unavailable_reason(name: str) -> str | None:
    """Why `--device name` cannot run on this machine, or None when it can."""
    device = torch.device(name)
    if device.type != "cuda":
        return None
    if not torch.cuda.is_available():
        build = "this torch build has no CUDA support" if torch.version.cuda is None else \
            "torch finds no usable CUDA device"
        return f"no CUDA device ({build}); run on the CPU with --device cpu"
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        return f"there is no CUDA device {device.index} (this machine has {count})"
    return None


def distributed_backend(device: torch.device | str) -> str:
    """The torch.distributed backend of the compute group for `device`: gloo on the CPU, NCCL on CUDA.
    (Control groups are gloo everywhere: they carry CPU tensors.)"""
    device = torch.device(device)
    if device.type == "cpu":
        return "gloo"
    if device.type == "cuda":
        return "nccl"
    raise ValueError(f"no torch.distributed backend for device {device} (tokenloom supports cpu and cuda)")


def set_process_device(device: torch.device) -> None:
    """Make `device` this process's current device before its groups are built (NCCL binds a communicator to
    the current CUDA device; each rank must own its own); a no-op on the CPU."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def synchronize(device: torch.device) -> None:
    """Wait for queued device work (timing, hand-offs); a no-op on the CPU where ops run eagerly."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def available_memory_bytes(device: torch.device) -> int:
    """Memory this process may take now: free GPU memory on CUDA, available RAM (MemAvailable) on the CPU."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


def default_mem_fraction_static(device: torch.device) -> float | None:
    """`--mem-fraction-static` when it is not set: 0.85 on CUDA (SGLang's range), None on the CPU, whose RAM
    is shared with the OS and other processes, so the KV pool takes a share of what the weights left
    (`executor.memory_budget`)."""
    return 0.85 if device.type == "cuda" else None


def configure_threads(num_threads: int | None) -> None:
    """Set torch's intra-op thread count for this process (CPU forward); None leaves torch's default."""
    if num_threads is not None:
        torch.set_num_threads(max(1, num_threads))


class ForwardStream:
    """Where forward steps run when they overlap with scheduling: a dedicated CUDA stream that waits for
    the scheduler's preparation through an event, or, on the CPU, simply the forward thread (ops run
    eagerly there, so there is nothing to wait for).

    Usage: `mark = stream.handoff()` on the scheduler thread after preparing a step, then
    `with stream.context(mark): ...` on the forward thread.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def handoff(self) -> object | None:
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def context(self, mark: object | None):
        import contextlib

        if self.stream is None:
            return contextlib.nullcontext()
        self.stream.wait_event(mark)
        return torch.cuda.stream(self.stream)

    def finish(self) -> None:
        """Wait for the forward stream (on the forward thread, before handing results back)."""
        if self.stream is not None:
            self.stream.synchronize()


def keep_this_thread_single_threaded() -> None:
    """Make torch ops issued from the calling thread run on that thread alone (CPU).

    Each thread that runs a parallel torch op starts its own OpenMP team; with more OpenMP threads than
    cores, libgomp throttles its spin-waits and every parallel region of the forward gets slower. Threads
    that only do bookkeeping (the overlap scheduler's) call this so the forward's team stays the only one.
    libgomp keeps the thread count per thread, so this does not touch the forward's setting (unlike
    `torch.set_num_threads`, which also changes torch's process-wide default). A no-op without libgomp.
    """
    import ctypes
    import glob

    setter = getattr(ctypes.CDLL(None), "omp_set_num_threads", None)
    if setter is None:
        libs = glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp*"))
        setter = getattr(ctypes.CDLL(libs[0]), "omp_set_num_threads", None) if libs else None
    if setter is not None:
        # torch sets a thread's OpenMP team size on that thread's first parallel op (its lazy per-thread init,
        # also run by get_num_threads); without running it first, that init would undo the setting below.
        torch.get_num_threads()
        setter(1)
