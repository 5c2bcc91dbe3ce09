"""Pipeline stages' layer ranges: SGLang's split checked against two independent formulations (dealing layers
out from the last stage backwards, and a brute-force search over every composition), and the partition
override's validation."""

from __future__ import annotations

import itertools

import pytest

from tokenloom.distributed.pp_partition import (
    PARTITION_ENV,
    partition_from_env,
    stage_layer_ranges,
    stage_layers,
)


def _dealt_counts(num_layers: int, pp_size: int) -> list[int]:
    """Deal layers one at a time to stages last, last-1, ..., 0, last, ...: the last stages end up with the
    extra ones, and no two counts differ by more than one."""
    counts = [0] * pp_size
    for i in range(num_layers):
        counts[pp_size - 1 - i % pp_size] += 1
    return counts


def _counts(ranges: list[tuple[int, int]]) -> list[int]:
    return [end - start for start, end in ranges]


@pytest.mark.parametrize("pp_size", range(1, 9))
def test_split_matches_dealing_and_its_invariants(pp_size):
    for num_layers in range(pp_size, 41):
        ranges = stage_layer_ranges(num_layers, pp_size)
        counts = _counts(ranges)
        assert counts == _dealt_counts(num_layers, pp_size), (num_layers, pp_size)
        assert ranges[0][0] == 0 and ranges[-1][1] == num_layers
        assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges)), ranges  # contiguous
        assert min(counts) >= 1 and max(counts) - min(counts) <= 1
        assert counts == sorted(counts)  # the larger stages are the last ones
        assert sum(c > num_layers // pp_size for c in counts) == num_layers % pp_size
        assert [stage_layers(num_layers, r, pp_size) for r in range(pp_size)] == ranges


def test_split_is_the_only_composition_with_its_properties():
    """Brute force for small sizes: among all ways to cut num_layers into pp_size non-empty contiguous
    ranges, exactly one is balanced (counts differ by at most one) with the larger ranges last."""
    for num_layers in range(1, 13):
        for pp_size in range(1, min(num_layers, 6) + 1):
            found = []
            for cuts in itertools.combinations(range(1, num_layers), pp_size - 1):
                bounds = (0, *cuts, num_layers)
                counts = [b - a for a, b in itertools.pairwise(bounds)]
                if max(counts) - min(counts) <= 1 and counts == sorted(counts):
                    found.append(list(itertools.pairwise(bounds)))
            assert found == [stage_layer_ranges(num_layers, pp_size)], (num_layers, pp_size, found)


def test_known_values():
    assert stage_layer_ranges(10, 4) == [(0, 2), (2, 4), (4, 7), (7, 10)]
    assert stage_layer_ranges(32, 3) == [(0, 10), (10, 21), (21, 32)]
    assert stage_layer_ranges(5, 1) == [(0, 5)]
    assert stage_layer_ranges(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert stage_layers(32, 1, 3) == (10, 21)


def test_partition_overrides_the_split():
    assert stage_layer_ranges(10, 3, [5, 1, 4]) == [(0, 5), (5, 6), (6, 10)]
    assert stage_layers(10, 2, 3, partition=[5, 1, 4]) == (6, 10)
    assert stage_layer_ranges(3, 1, [3]) == [(0, 3)]


@pytest.mark.parametrize(("partition", "names"), [
    ([5, 5], ["5,5", "2 entries", "pp_size is 3"]),
    ([5, 0, 5], ["5,0,5", "stage 1: 0", "at least one layer"]),
    ([12, -1, -1], ["12,-1,-1", "stage 1: -1", "stage 2: -1"]),
    ([3, 3, 3], ["3,3,3", "sums to 9", "10 layers"]),
    ([4, 4, 4, 4], ["4,4,4,4", "4 entries"]),
])
def test_bad_partition_is_rejected_naming_its_values(partition, names):
    with pytest.raises(ValueError) as info:
        stage_layer_ranges(10, 3, partition)
    for name in names:
        assert name in str(info.value), (name, str(info.value))


def test_more_stages_than_layers_and_bad_sizes():
    with pytest.raises(ValueError, match=r"pp_size \(5\) exceeds the model's 4 layers"):
        stage_layer_ranges(4, 5)
    with pytest.raises(ValueError, match="pp_size"):
        stage_layer_ranges(4, 0)
    with pytest.raises(ValueError, match="num_layers"):
        stage_layer_ranges(0, 1)
    with pytest.raises(ValueError, match="pp_rank 3 outside pp_size 3"):
        stage_layers(9, 3, 3)
    with pytest.raises(ValueError, match="pp_rank -1"):
        stage_layers(9, -1, 3)


def test_partition_from_env(monkeypatch):
    assert partition_from_env({}) is None
    assert partition_from_env({PARTITION_ENV: "  "}) is None
    assert partition_from_env({PARTITION_ENV: "10,11, 11"}) == [10, 11, 11]
    with pytest.raises(ValueError, match=r"TOKENLOOM_PP_LAYER_PARTITION='10,x,11'"):
        partition_from_env({PARTITION_ENV: "10,x,11"})
    with pytest.raises(ValueError, match="TOKENLOOM_PP_LAYER_PARTITION"):
        partition_from_env({PARTITION_ENV: "10,,11"})
    monkeypatch.setenv(PARTITION_ENV, "2,6")
    assert partition_from_env() == [2, 6]
    assert stage_layer_ranges(8, 2, partition_from_env()) == [(0, 2), (2, 8)]
    monkeypatch.delenv(PARTITION_ENV)
    assert partition_from_env() is None
