"""How many bytes the KV pool may take: `--mem-fraction-static` with SGLang's meaning, and the CPU default.

`--mem-fraction-static f` is the share of the memory available when the server starts (free GPU memory on
CUDA, MemAvailable RAM on the CPU, read before the weights load) that the static memory, the weights plus the
KV pool, may take; the rest is left for activations and everything else:

    KV bytes = f * memory_at_start - weight bytes      (an error when the weights alone exceed f * memory)

Weight bytes are what the model holds: parameters, buffers, the load-time packed copies of the linear
weights (`layers.cpu_gemm`), which on the CPU can take twice the parameters again, and quantized weights
(`QuantMatrix` bytes, held in dataclasses and lists of them in the layers' attributes).

With the flag unset on the CPU, whose RAM is shared with the OS and other processes, the KV pool takes
`CPU_KV_SHARE_OF_FREE` of the memory the weights left (`device.default_mem_fraction_static` is None there;
on CUDA it is SGLang's 0.85). `--max-total-tokens` bypasses all of this. These are pure functions of their
arguments, so tests give them memory sizes instead of reading the machine.
"""

from __future__ import annotations

import dataclasses

import torch

CPU_KV_SHARE_OF_FREE = 0.25
_GIB = 2**30


class MemoryBudgetError(RuntimeError):
    """`--mem-fraction-static` leaves no room for a KV pool beside the weights."""


def kv_pool_bytes(memory_at_start: int, weight_bytes: int, mem_fraction_static: float | None) -> int:
    """Bytes the KV pool may take (see the module docstring); `mem_fraction_static` None = the CPU default."""
    if mem_fraction_static is None:
        return max(0, int((memory_at_start - weight_bytes) * CPU_KV_SHARE_OF_FREE))
    static = mem_fraction_static * memory_at_start
    if weight_bytes >= static:
        raise MemoryBudgetError(
            f"--mem-fraction-static {mem_fraction_static} allows {static / _GIB:.2f} GiB of the "
            f"{memory_at_start / _GIB:.2f} GiB available at start for weights + KV cache, but the weights alone "
            f"take {weight_bytes / _GIB:.2f} GiB; raise --mem-fraction-static or set --max-total-tokens")
    return int(static - weight_bytes)


def model_nbytes(model: torch.nn.Module) -> int:
    """Bytes of the tensors `model` holds: parameters, buffers, and tensors kept in module attributes (the
    packed weight copies, directly, in a dataclass, or in a list of them: a MoE layer's per-expert weights).
    Shared storage (tied embeddings, views) counts once."""
    seen: set[int] = set()
    total = 0

    def add(t: torch.Tensor) -> None:
        nonlocal total
        try:
            storage = t.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
        except (RuntimeError, NotImplementedError):  # opaque layouts (oneDNN's packed weights) have no storage
            key, size = id(t), t.numel() * t.element_size()
        if key not in seen:
            seen.add(key)
            total += size

    def walk(value: object, depth: int) -> None:
        """Tensors in `value`: itself, or inside dataclasses and lists/tuples of them (a few levels deep)."""
        if isinstance(value, torch.Tensor):
            add(value)
        elif depth and dataclasses.is_dataclass(value) and not isinstance(value, type):
            for f in dataclasses.fields(value):
                walk(getattr(value, f.name), depth - 1)
        elif depth and isinstance(value, list | tuple):
            for item in value:
                walk(item, depth - 1)

    for t in (*model.parameters(), *model.buffers()):
        add(t)
    for module in model.modules():
        for value in vars(module).values():
            walk(value, 6)  # list -> QuantWeight -> segments -> segment -> matrix -> tensor
    return total
