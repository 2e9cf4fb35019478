"""Partitioners: sizes, determinism, skew as a function of alpha, fixed proportions, groups, errors."""

from __future__ import annotations

import numpy as np
import pytest
from rich.table import Table

from fedpeft.config import ConfigError, PartitionConfig
from fedpeft.data.partition import (
    class_ids,
    describe_partition,
    format_partition_table,
    partition_indices,
)

LABELS = [index % 4 for index in range(400)]  # 4 balanced classes
KINDS = ["iid", "dirichlet", "quantity_skew"]


def _entropy(counts: np.ndarray) -> float:
    probabilities = counts[counts > 0] / counts.sum()
    return float(-(probabilities * np.log(probabilities)).sum())


def _mean_client_entropy(labels: list[int], alpha: float, seed: int) -> float:
    cfg = PartitionConfig(kind="dirichlet", num_clients=10, alpha=alpha)
    shards = partition_indices(labels, cfg, seed)
    classes = np.asarray(labels)
    return float(np.mean([_entropy(np.bincount(classes[shard], minlength=4)) for shard in shards]))


@pytest.mark.parametrize("kind", KINDS)
def test_every_example_in_exactly_one_shard(kind: str) -> None:
    shards = partition_indices(LABELS, PartitionConfig(kind=kind, num_clients=7, alpha=0.3), seed=0)
    assert len(shards) == 7
    assert all(len(shard) >= 1 for shard in shards)
    everything = np.concatenate(shards)
    assert len(everything) == len(LABELS)
    assert sorted(everything.tolist()) == list(range(len(LABELS)))
    assert all(np.all(np.diff(shard) > 0) for shard in shards)  # sorted, no duplicates


def test_iid_sizes_differ_by_at_most_one() -> None:
    shards = partition_indices(LABELS, PartitionConfig(kind="iid", num_clients=7), seed=0)
    sizes = [len(shard) for shard in shards]
    assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("kind", KINDS)
def test_same_seed_same_shards_other_seed_other_shards(kind: str) -> None:
    cfg = PartitionConfig(kind=kind, num_clients=5, alpha=0.5)
    first = partition_indices(LABELS, cfg, seed=3)
    again = partition_indices(LABELS, cfg, seed=3)
    other = partition_indices(LABELS, cfg, seed=4)
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    assert any(not np.array_equal(a, b) for a, b in zip(first, other))


def test_config_seed_overrides_experiment_seed() -> None:
    cfg = PartitionConfig(kind="iid", num_clients=5, seed=11)
    first = partition_indices(LABELS, cfg, seed=0)
    second = partition_indices(LABELS, cfg, seed=1)
    assert all(np.array_equal(a, b) for a, b in zip(first, second))


def test_label_skew_grows_as_alpha_falls() -> None:
    seeds = range(5)
    entropy = {
        alpha: np.mean([_mean_client_entropy(LABELS, alpha, seed) for seed in seeds])
        for alpha in (0.1, 1.0, 100.0)
    }
    assert entropy[0.1] < entropy[1.0] < entropy[100.0]
    assert entropy[100.0] > 0.95 * np.log(4)  # nearly uniform at large alpha


def test_dirichlet_respects_min_examples_per_client() -> None:
    cfg = PartitionConfig(kind="dirichlet", num_clients=10, alpha=0.1, min_examples_per_client=10)
    shards = partition_indices(LABELS, cfg, seed=0)
    assert min(len(shard) for shard in shards) >= 10


def test_dirichlet_gives_up_with_advice() -> None:
    labels = [0] * 40 + [1] * 40
    cfg = PartitionConfig(kind="dirichlet", num_clients=8, alpha=0.001, min_examples_per_client=10)
    with pytest.raises(ConfigError, match="larger alpha") as caught:
        partition_indices(labels, cfg, seed=0)
    assert caught.value.field == "partition.alpha"


def test_dirichlet_bins_regression_targets() -> None:
    rng = np.random.default_rng(0)
    targets = [float(value) for value in rng.uniform(0, 5, size=300)]
    bins = class_ids(targets)
    assert sorted(set(bins.tolist())) == [0, 1, 2, 3, 4]
    assert np.bincount(bins).min() >= 55  # quantile bins: about 60 each
    shards = partition_indices(targets, PartitionConfig(kind="dirichlet", num_clients=4, alpha=0.5), seed=0)
    assert sum(len(shard) for shard in shards) == 300


def test_quantity_skew_sizes_vary_labels_do_not() -> None:
    labels = [index % 2 for index in range(2000)]
    cfg = PartitionConfig(kind="quantity_skew", num_clients=5, alpha=0.5, min_examples_per_client=20)
    shards = partition_indices(labels, cfg, seed=0)
    sizes = [len(shard) for shard in shards]
    assert min(sizes) >= 20 and max(sizes) > 2 * min(sizes)
    for shard in shards:
        if len(shard) >= 200:
            assert abs(np.mean(np.asarray(labels)[shard]) - 0.5) < 0.1


def test_label_proportions_follow_rows() -> None:
    labels = [0] * 600 + [1] * 600
    rows = [[0.05, 0.95], [0.95, 0.05], [0.5, 0.5]]
    cfg = PartitionConfig(kind="label_proportions", num_clients=3, label_proportions=rows)
    shards = partition_indices(labels, cfg, seed=0)
    classes = np.asarray(labels)
    for shard, row in zip(shards, rows):
        share_of_ones = classes[shard].mean()
        assert share_of_ones == pytest.approx(row[1], abs=0.01)
    sizes = [len(shard) for shard in shards]
    assert max(sizes) - min(sizes) <= 2  # as equal as the data allows: 400 each
    assert len(np.unique(np.concatenate(shards))) == sum(sizes)  # without replacement


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([[0.5, 0.5], [0.5, 0.5]], "one row per client"),
        ([[1.0], [1.0], [1.0]], "one per label"),
        ([[0.5, 0.6], [0.5, 0.5], [0.5, 0.5]], "sum to 1"),
        ([[-0.5, 1.5], [0.5, 0.5], [0.5, 0.5]], "non-negative"),
        (None, "required"),
    ],
)
def test_bad_label_proportions_are_config_errors(rows: list[list[float]] | None, message: str) -> None:
    cfg = PartitionConfig(kind="label_proportions", num_clients=3, label_proportions=rows)
    with pytest.raises(ConfigError, match=message) as caught:
        partition_indices([0, 1] * 50, cfg, seed=0)
    assert caught.value.field == "partition.label_proportions"


def test_natural_uses_groups() -> None:
    groups = ["bob", "alice", "carol", "alice", "bob", "alice"]
    shards = partition_indices([0, 1, 0, 1, 0, 1], PartitionConfig(kind="natural", num_clients=3), 0, groups)
    assert [shard.tolist() for shard in shards] == [[1, 3, 5], [0, 4], [2]]  # alice, bob, carol


def test_natural_needs_one_client_per_group() -> None:
    groups = ["a", "b", "a", "b"]
    with pytest.raises(ConfigError, match="2 distinct groups") as caught:
        partition_indices([0, 1, 0, 1], PartitionConfig(kind="natural", num_clients=3), 0, groups)
    assert caught.value.field == "partition.num_clients"
    with pytest.raises(ConfigError, match="group_column"):
        partition_indices([0, 1, 0, 1], PartitionConfig(kind="natural", num_clients=2), 0, None)


@pytest.mark.parametrize("kind", [*KINDS, "label_proportions"])
def test_more_clients_than_examples(kind: str) -> None:
    cfg = PartitionConfig(kind=kind, num_clients=11, label_proportions=[[0.5, 0.5]] * 11)
    with pytest.raises(ConfigError, match="only 10 training examples") as caught:
        partition_indices([0, 1] * 5, cfg, seed=0)
    assert caught.value.field == "partition.num_clients"


def test_describe_and_table() -> None:
    labels = [0, 0, 1, 1, 1]
    shards = [np.array([0, 2]), np.array([1, 3, 4])]
    rows = describe_partition(shards, labels, ["neg", "pos"])
    assert rows == [
        {"client": 0, "size": 2, "labels": {"neg": 1, "pos": 1}},
        {"client": 1, "size": 3, "labels": {"neg": 1, "pos": 2}},
    ]
    table = format_partition_table(rows, ["neg", "pos"], title="sst2")
    assert isinstance(table, Table)
    assert [column.header for column in table.columns] == ["client", "size", "neg", "pos"]
    assert table.row_count == 2


def test_describe_regression_reports_bins_and_mean() -> None:
    targets = [0.5, 1.5, 2.5, 3.5, 4.5]
    rows = describe_partition([np.array([0, 1]), np.array([2, 3, 4])], targets, [])
    assert rows[0]["mean"] == pytest.approx(1.0)
    assert sum(rows[1]["labels"].values()) == 3
    table = format_partition_table(rows)
    assert [column.header for column in table.columns] == [
        "client",
        "size",
        "q1",
        "q2",
        "q3",
        "q4",
        "q5",
        "mean",
    ]


def test_table_with_many_labels_shows_most_common() -> None:
    labels = list(range(20)) * 2
    rows = describe_partition(
        [np.arange(20), np.arange(20, 40)], labels, [f"g{index}" for index in range(20)]
    )
    table = format_partition_table(rows, [f"g{index}" for index in range(20)])
    assert [column.header for column in table.columns] == ["client", "size", "most common labels"]


def test_dirichlet_over_clients_gives_equal_sizes_and_per_client_label_skew() -> None:
    """Hsu et al. 2019: each client's label mix ~ Dir(alpha), every client the same size, each example once."""
    classes = np.asarray(LABELS)

    def shards(alpha: float, seed: int = 0) -> list[np.ndarray]:
        return partition_indices(LABELS, PartitionConfig(kind="dirichlet", dirichlet_over="clients", num_clients=10,
                                                         alpha=alpha), seed)

    skewed = shards(0.1)
    assert sorted(np.concatenate(skewed).tolist()) == list(range(400))
    assert {len(shard) for shard in skewed} == {40}  # the class-wise split gives unequal sizes; this does not
    assert all(np.array_equal(a, b) for a, b in zip(skewed, shards(0.1)))
    assert not all(np.array_equal(a, b) for a, b in zip(skewed, shards(0.1, seed=1)))
    entropy = {alpha: float(np.mean([_entropy(np.bincount(classes[s], minlength=4)) for s in shards(alpha)]))
               for alpha in (0.1, 100.0)}
    assert entropy[0.1] < 0.8 < 1.2 < entropy[100.0] <= np.log(4)  # near one class vs near uniform over 4
