"""The weight-bandwidth bound of a decode step on a GGUF file: the bytes of weights every step reads, the
machine's read bandwidth measured now, and bytes / bandwidth; also the memory a server reports holding for
its weights, set against the file's size.

Why: at batch 1 a decode step streams every weight matrix once, so its time cannot beat (weight bytes read)
/ (read bandwidth). Setting the measured ITL next to that bound says how far from the memory wall each
server is, on the same file, in the same run (this VM's bandwidth drifts: always measure it in the run).

Invariants:
- `step_weight_bytes` counts the bytes of every tensor of the repeating blocks (`blk.N.*`: the projections,
  the norms) plus the final norm and the LM head. The LM head is `output.weight`; a file without one ties it
  to `token_embd.weight`, which then counts once, as the head (a full matmul per step). A file with its own
  `output.weight` does not count `token_embd.weight`: the embedding is a row lookup per token, not a stream.
  Other tensors (`rope_freqs`, ...) are not weights a step streams and do not count.
- Bytes are the file's own (quantized) tensor bytes: a server that keeps the file's types reads exactly
  these; one that dequantizes reads more, which the bound does not excuse.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

GB = 1e9
_BLOCK = re.compile(r"^blk\.\d+\.")
_HEAD_NORM = "output_norm.weight"
_HEAD = "output.weight"
_EMBED = "token_embd.weight"


def step_weight_bytes(tensors: Iterable[tuple[str, int]]) -> int:
    """Bytes a decode step reads of the weights named in `tensors` ((GGUF tensor name, bytes) pairs), by the
    rule of the module docstring. Raises when there is no LM head at all (neither output nor token_embd)."""
    sizes = dict(tensors)
    total = sum(n for name, n in sizes.items() if _BLOCK.match(name))
    total += sizes.get(_HEAD_NORM, 0)
    if _HEAD in sizes:
        total += sizes[_HEAD]
    elif _EMBED in sizes:
        total += sizes[_EMBED]  # tied: the embedding is the LM head's matrix
    else:
        raise ValueError(f"no {_HEAD} or {_EMBED} among the tensors: no LM head to count")
    return total


def gguf_tensor_bytes(path: str) -> list[tuple[str, int]]:
    """(name, bytes as stored) for every tensor of the GGUF file at `path`, read with the gguf package."""
    from gguf import GGUFReader

    return [(t.name, int(t.n_bytes)) for t in GGUFReader(path).tensors]


def gguf_step_bytes(path: str) -> int:
    return step_weight_bytes(gguf_tensor_bytes(path))


def bound_ms(step_bytes: int, read_gbps: float) -> float:
    """Milliseconds to read `step_bytes` at `read_gbps` GB/s (10^9 bytes per second)."""
    if read_gbps <= 0:
        raise ValueError(f"read bandwidth must be positive, got {read_gbps}")
    return step_bytes / (read_gbps * GB) * 1e3


def measure_read_gbps(reads: int = 8, threads: int = 2) -> float:
    """Median GB/s of `reads` streaming reads of 256 MiB each, walking a 1 GiB buffer (far beyond the L3, so
    no read finds the last one cached), on `threads` torch threads: what a 2-thread server's decode step can
    stream. Median, not best: the bound should be what the machine gives now, not in its best second."""
    import statistics

    import torch

    from bench.roofline_probes import ReadProbe

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        probe = ReadProbe()
        for _ in range(reads + 1):
            probe.read(256 << 20)
        return statistics.median(probe.rates[1:])  # the first read pays page faults
    finally:
        torch.set_num_threads(before)


def llama_server_weight_bytes(log_text: str) -> int | None:
    """The bytes llama-server's log says its model buffers hold (the sum of its `model buffer size = X MiB`
    lines: the mapped file and any repacked copy); None when the log has none."""
    sizes = [float(m) for m in re.findall(r"model buffer size\s*=\s*([\d.]+)\s*MiB", log_text)]
    return round(sum(sizes) * (1 << 20)) if sizes else None
