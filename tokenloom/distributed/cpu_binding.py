"""Which CPU cores each scheduler rank of this node runs on (`TOKENLOOM_CPU_OMP_THREADS_BIND`), and binding a
process to them. The shape of vLLM's `VLLM_CPU_OMP_THREADS_BIND` / SGLang's `SGLANG_CPU_OMP_THREADS_BIND`:

- `auto` (the default): on the CPU, when several ranks share this machine and each gets whole cores, local
  rank i runs on the i-th contiguous block of cores / local ranks cores of the launcher's affinity mask (the
  cores it inherited: `taskset`, a container's cpuset), never of the whole host; one rank alone, a CUDA
  device, more ranks than cores, an unreadable mask, or `--num-threads` above a block: no binding;
- `nobind` (or `all`): no binding, the kernel places every thread;
- `0-3|4-7|8,9`: the cores of local rank 0, 1, ... (one `|`-separated group per local rank of this node).

Threads: a rank bound to cores runs one intra-op thread per core of its set (the launcher makes that its
`--num-threads`) unless `--num-threads` is given; a `--num-threads` above an explicit group's size is refused
at launch, since its threads would share cores (`auto` declines to bind instead).

Several servers on one host (a prefill and a decode server, nodes of a multi-node run simulated on one
machine): each server's `auto` cuts its blocks from its own affinity mask and knows nothing of the others,
so servers started with the same mask bind their rank i to the same block and share those cores. Start each
under its own cores (`taskset -c 0-7 ...`, `taskset -c 8-15 ...`, or a container cpuset) and their blocks are
disjoint; or give each server explicit groups. Binding depends on nothing but this process's own mask and
settings: no state is shared between servers (a host-wide registry would make one server's binding depend
on unrelated processes that happen to run).

Binding keeps a rank's forward, scheduling and communication threads on its own cores, so one rank's
wake-ups never wait behind another rank's forward (with as many compute threads as cores, the kernel
otherwise moves threads between cores and a woken thread waits for a busy one). Invariant: the groups of one
node never overlap, and every core of a group is in the launcher's mask (when it can be read); a rank whose
cores are no longer all allowed when it binds (a cpuset narrowed meanwhile) fails its start-up with
`CoreBindingError` rather than run on whatever part of its set is left.
"""

from __future__ import annotations

import os

ENV = "TOKENLOOM_CPU_OMP_THREADS_BIND"
NO_BINDING = ("nobind", "all")


def parse_core_list(text: str) -> list[int]:
    """`0-3,8` → [0, 1, 2, 3, 8] (ValueError with the offending part otherwise)."""
    cores: list[int] = []
    for part in text.split(","):
        part = part.strip()
        low, dash, high = part.partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise ValueError(f"{ENV}: {part!r} is not a core number or a range like 0-3")
        first, last = int(low), int(high) if dash else int(low)
        if last < first:
            raise ValueError(f"{ENV}: the range {part!r} runs backwards")
        cores.extend(range(first, last + 1))
    return cores


class CoreBindingError(RuntimeError):
    """A rank could not be bound to its cores (some are outside the cores this process may run on)."""


def allowed_cores() -> list[int] | None:
    """The cores this process may run on, sorted (its affinity mask, as taskset or a cpuset narrowed it), or
    None where the mask cannot be read (no `sched_getaffinity` on this platform, or the call failed)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def rank_cores(spec: str | None, local_ranks: int, cores: list[int] | None, num_threads: int | None = None,
               device_type: str = "cpu") -> list[list[int]] | None:
    """Each local rank's cores under `spec` (None or "" → `auto`), or None for no binding. `cores`: the
    launcher's allowed cores (`allowed_cores()`; None: unknown, so `auto` does not bind and explicit groups are
    checked only when each rank binds); `num_threads`: `--num-threads` (None: not given, each bound rank then
    runs one thread per core of its set). Explicit groups come back sorted, without repeated cores."""
    spec = (spec or "auto").strip()
    if spec in NO_BINDING:
        return None
    if spec == "auto":
        if cores is None or device_type != "cpu" or local_ranks < 2:
            return None
        per_rank = len(cores) // local_ranks
        if per_rank < 1 or (num_threads is not None and num_threads > per_rank):
            return None
        ordered = sorted(cores)
        return [ordered[i * per_rank:(i + 1) * per_rank] for i in range(local_ranks)]
    groups = [sorted(set(parse_core_list(group))) for group in spec.split("|")]
    if len(groups) != local_ranks:
        raise ValueError(f"{ENV}={spec!r} names {len(groups)} core groups; this node runs {local_ranks} ranks "
                         f"(one group per local rank, separated by |)")
    seen: set[int] = set()
    for index, group in enumerate(groups):
        outside = set(group) - set(cores) if cores is not None else set()
        if outside:
            raise ValueError(f"{ENV}: cores {sorted(outside)} are not available to this process "
                             f"(allowed: {sorted(cores)})")
        if seen & set(group):
            raise ValueError(f"{ENV}: cores {sorted(seen & set(group))} are in two ranks' groups")
        seen |= set(group)
        if num_threads is not None and num_threads > len(group):
            raise ValueError(f"{ENV}: --num-threads {num_threads} is more than the {len(group)} cores of local "
                             f"rank {index}'s group {group}, so its threads would share cores; give "
                             f"--num-threads {min(len(g) for g in groups)} or less, larger groups, or leave "
                             f"--num-threads out (each rank then runs one thread per core of its group)")
    return groups


def bind_this_process(cores: list[int]) -> None:
    """Run every thread of this process, and the threads it starts later, on `cores` only.

    Raises CoreBindingError, naming the cores, when some of them are outside this process's affinity mask
    (the kernel would otherwise bind to what is left of the set, or refuse it), or when the kernel refuses."""
    wanted = set(cores)
    allowed = allowed_cores()
    if allowed is not None and not wanted <= set(allowed):
        raise CoreBindingError(f"{ENV}: cores {sorted(wanted - set(allowed))} of this rank's set {sorted(wanted)} "
                               f"are outside the cores this process may run on ({allowed})")
    try:
        for task in os.listdir("/proc/self/task"):
            try:
                os.sched_setaffinity(int(task), wanted)
            except (ProcessLookupError, PermissionError):  # a thread that ended meanwhile
                continue
        os.sched_setaffinity(0, wanted)
    except OSError as e:
        raise CoreBindingError(f"{ENV}: binding this rank to cores {sorted(wanted)} failed: "
                               f"{e.strerror or e}") from None
