"""Which decoder layers each pipeline stage owns: pure functions, no torch.distributed.

SGLang's split (`get_pp_indices`): every stage gets `num_layers // pp_size` layers and the LAST
`num_layers % pp_size` stages one more each. An explicit partition — a list of per-stage layer counts, or
`TOKENLOOM_PP_LAYER_PARTITION` ("a,b,c", read by `partition_from_env`, like SGLang's
`SGLANG_PP_LAYER_PARTITION`) — overrides the split.
Invariants of every result: `pp_size` half-open ranges `[start, end)`, contiguous (each starts where the
previous ended), the first starting at 0 and the last ending at `num_layers`, none empty (a stage without
layers is a configuration error here, not a placeholder). Every rank computes the same ranges from the same
arguments, so stages agree on the split by construction.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

PARTITION_ENV = "TOKENLOOM_PP_LAYER_PARTITION"


def partition_from_env(environ: Mapping[str, str] | None = None) -> list[int] | None:
    """The per-stage layer counts in `TOKENLOOM_PP_LAYER_PARTITION` ("a,b,c"), or None when unset or blank.

    Only the syntax is checked here (comma-separated integers); `stage_layer_ranges` checks the counts
    against the model and the stage count.
    """
    text = (os.environ if environ is None else environ).get(PARTITION_ENV)
    if text is None or not text.strip():
        return None
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"{PARTITION_ENV}={text!r}: expected comma-separated layer counts such as "
                         f"'10,11,11'") from None


def stage_layer_ranges(num_layers: int, pp_size: int,
                       partition: Sequence[int] | None = None) -> list[tuple[int, int]]:
    """Every stage's `[start, end)` layer range, stage 0 first.

    Without `partition`: the even split, the last `num_layers % pp_size` stages taking one extra layer.
    With it: `partition[i]` layers for stage i; it must have `pp_size` entries, each at least 1, summing to
    `num_layers`. Raises ValueError naming the offending values otherwise, or when `pp_size > num_layers`.
    """
    if num_layers < 1:
        raise ValueError(f"num_layers ({num_layers}) must be at least 1")
    if pp_size < 1:
        raise ValueError(f"pp_size ({pp_size}) must be at least 1")
    if partition is None:
        if pp_size > num_layers:
            raise ValueError(f"pp_size ({pp_size}) exceeds the model's {num_layers} layers: every pipeline stage "
                             f"needs at least one layer")
        base, extra = divmod(num_layers, pp_size)
        counts = [base + (stage >= pp_size - extra) for stage in range(pp_size)]
    else:
        counts = [int(c) for c in partition]
        _check_partition(counts, num_layers, pp_size)
    ranges = []
    start = 0
    for count in counts:
        ranges.append((start, start + count))
        start += count
    return ranges


def stage_layers(num_layers: int, pp_rank: int, pp_size: int,
                 partition: Sequence[int] | None = None) -> tuple[int, int]:
    """Stage `pp_rank`'s `[start, end)` layer range (see `stage_layer_ranges`)."""
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank {pp_rank} outside pp_size {pp_size}")
    return stage_layer_ranges(num_layers, pp_size, partition)[pp_rank]


def _check_partition(counts: list[int], num_layers: int, pp_size: int) -> None:
    where = f"layer partition {','.join(map(str, counts))}"
    if len(counts) != pp_size:
        raise ValueError(f"{where} has {len(counts)} entries, but pp_size is {pp_size} (one count per stage)")
    small = [f"stage {i}: {c}" for i, c in enumerate(counts) if c < 1]
    if small:
        raise ValueError(f"{where}: every stage needs at least one layer ({'; '.join(small)})")
    if sum(counts) != num_layers:
        raise ValueError(f"{where} sums to {sum(counts)}, but the model has {num_layers} layers")
