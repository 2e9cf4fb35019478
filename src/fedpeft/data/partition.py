"""Split a training set into client shards (federated simulation of who holds which data).

:func:`partition_indices` returns one sorted array of example indices per client, for the kinds
of :class:`~fedpeft.config.PartitionConfig`:

- ``iid``: a random permutation cut into near-equal parts;
- ``dirichlet``: label skew. ``dirichlet_over: classes`` (default): each class's examples are split
  over clients with proportions ~ Dirichlet(alpha), as FedML / NIID-Bench's ``hetero`` (sizes
  vary with the draw); ``dirichlet_over: clients``: each client's label mix ~ Dirichlet(alpha) and
  every client the same size (Hsu et al. 2019), label skew without quantity skew;
- ``quantity_skew``: client sizes ~ Dirichlet(alpha), labels iid;
- ``label_proportions``: each client's label distribution given row by row (FedTT App. B);
- ``natural``: a group per example names its client;
- ``centralized``: one client holds everything (the non-federated reference).

The "label" of an example is its class: for token classification (NER) the set of tags it holds,
for extractive QA its article title (FeDeRA App. A.2; assigned by
:func:`fedpeft.data.tasks.with_example_classes`), so ``dirichlet`` skews clients over those
classes, and ``natural`` gives every QA article its own client.

Every random choice comes from ``numpy.random.default_rng(seed)``: the same seed gives the same
shards. :func:`describe_partition` and :func:`format_partition_table` summarise shards.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from rich.table import Table

from fedpeft.config import ConfigError, PartitionConfig

Label = int | float | None

DIRICHLET_MAX_ATTEMPTS = 1000
"""Redraws allowed before ``dirichlet`` gives up on a minimum shard size."""

REGRESSION_BINS = 5
"""Float (regression) targets are binned into this many quantile bins to act as classes."""


def partition_indices(
    labels: Sequence[Label],
    cfg: PartitionConfig,
    seed: int,
    groups: Sequence[str | None] | None = None,
) -> list[np.ndarray]:
    """Assign each training example to one client; one sorted ``int64`` index array per client.

    ``seed`` is the experiment seed; ``cfg.seed``, when set, overrides it so a partition can be
    held fixed while the training seed varies. ``groups`` (one name per example) is needed by
    ``natural`` only.
    """
    num_examples = len(labels)
    if cfg.num_clients > num_examples:
        raise ConfigError(
            "partition.num_clients",
            f"{cfg.num_clients} clients but only {num_examples} training examples; "
            f"use at most {num_examples}",
        )
    if cfg.num_clients * cfg.min_examples_per_client > num_examples:
        raise ConfigError(
            "partition.min_examples_per_client",
            f"{cfg.num_clients} clients x {cfg.min_examples_per_client} examples exceeds the "
            f"{num_examples} training examples",
        )
    rng = np.random.default_rng(cfg.seed if cfg.seed is not None else seed)
    if cfg.kind == "iid":
        shards = iid_shards(num_examples, cfg.num_clients, rng)
    elif cfg.kind == "dirichlet" and cfg.dirichlet_over == "clients":
        shards = dirichlet_client_shards(class_ids(labels), cfg.num_clients, cfg.alpha, rng)
    elif cfg.kind == "dirichlet":
        shards = dirichlet_label_shards(
            class_ids(labels), cfg.num_clients, cfg.alpha, cfg.min_examples_per_client, rng
        )
    elif cfg.kind == "quantity_skew":
        shards = quantity_skew_shards(
            num_examples, cfg.num_clients, cfg.alpha, cfg.min_examples_per_client, rng
        )
    elif cfg.kind == "label_proportions":
        shards = label_proportion_shards(labels, cfg, rng)
    elif cfg.kind == "natural":
        shards = natural_shards(groups, cfg.num_clients)
    elif cfg.kind == "centralized":
        shards = [np.arange(num_examples)]
    else:  # unreachable through PartitionConfig validation; kept for direct callers
        raise ConfigError("partition.kind", f"unknown kind {cfg.kind!r}")
    _check_minimum(shards, cfg)
    return [np.sort(np.asarray(shard, dtype=np.int64)) for shard in shards]


def _check_minimum(shards: Sequence[np.ndarray], cfg: PartitionConfig) -> None:
    smallest = min(len(shard) for shard in shards)
    if smallest < cfg.min_examples_per_client:
        client = next(index for index, shard in enumerate(shards) if len(shard) == smallest)
        raise ConfigError(
            "partition.min_examples_per_client",
            f"client {client} gets {smallest} examples under partition.kind {cfg.kind!r}, fewer than "
            f"{cfg.min_examples_per_client}; use fewer clients or a smaller minimum",
        )


def iid_shards(num_examples: int, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    """A random permutation cut into ``num_clients`` parts whose sizes differ by at most one."""
    return list(np.array_split(rng.permutation(num_examples), num_clients))


def is_regression(labels: Sequence[Label]) -> bool:
    """Float targets mean regression; classification and multiple-choice labels are ints."""
    return any(isinstance(label, (float, np.floating)) for label in labels)


def class_ids(labels: Sequence[Label]) -> np.ndarray:
    """Labels as class ids for label-skewed partitions.

    Integer labels are used as they are. Float (regression) targets are cut into
    :data:`REGRESSION_BINS` quantile bins (:func:`quantile_bins`), so "label skew" means skew
    over low/high targets. Missing labels (``None``) form one extra class of their own.
    """
    if is_regression(labels):
        return quantile_bins(labels)
    present = [int(label) for label in labels if label is not None]
    missing_class = max(present) + 1 if present else 0
    return np.array([missing_class if label is None else int(label) for label in labels], dtype=np.int64)


def quantile_bins(targets: Sequence[Label], num_bins: int = REGRESSION_BINS) -> np.ndarray:
    """Bin ``0..num_bins-1`` of each target, cut at the quantiles of the targets (ties share a
    bin, so bins can be uneven); ``None`` goes to bin ``num_bins``."""
    values = np.asarray([target for target in targets if target is not None], dtype=float)
    edges = np.quantile(values, np.linspace(0, 1, num_bins + 1)[1:-1]) if len(values) else np.zeros(0)
    return np.array(
        [
            num_bins if target is None else int(np.searchsorted(edges, target, side="right"))
            for target in targets
        ],
        dtype=np.int64,
    )


def dirichlet_label_shards(
    classes: np.ndarray,
    num_clients: int,
    alpha: float,
    min_size: int,
    rng: np.random.Generator,
) -> list[np.ndarray]:
    """Label-skewed shards: for each class, split its examples over clients with proportions
    drawn from Dirichlet(alpha).

    As FedML's / NIID-Bench's ``hetero`` partition: a client that already holds its fair share
    ``N / num_clients`` gets no more examples of later classes (keeps sizes from running away),
    and the whole draw is repeated until every client has at least ``min_size`` examples, at
    most :data:`DIRICHLET_MAX_ATTEMPTS` times. Small alpha: each client sees few classes.
    """
    num_examples = len(classes)
    by_class = [np.flatnonzero(classes == value) for value in np.unique(classes)]
    for _attempt in range(DIRICHLET_MAX_ATTEMPTS):
        shards: list[list[int]] = [[] for _ in range(num_clients)]
        for members in by_class:
            members = rng.permutation(members)
            proportions = rng.dirichlet(np.full(num_clients, alpha))
            below_share = np.array([len(shard) < num_examples / num_clients for shard in shards])
            proportions = _normalised(proportions * below_share, fallback=below_share)
            cuts = (np.cumsum(proportions) * len(members)).astype(int)[:-1]
            for shard, part in zip(shards, np.split(members, cuts)):
                shard.extend(part.tolist())
        if min(len(shard) for shard in shards) >= min_size:
            return [np.asarray(shard, dtype=np.int64) for shard in shards]
    raise ConfigError(
        "partition.alpha",
        f"could not give each of {num_clients} clients at least {min_size} examples in "
        f"{DIRICHLET_MAX_ATTEMPTS} Dirichlet draws at alpha={alpha}; use a larger alpha, fewer clients "
        "or a smaller partition.min_examples_per_client",
    )


def dirichlet_client_shards(
    classes: np.ndarray, num_clients: int, alpha: float, rng: np.random.Generator
) -> list[np.ndarray]:
    """Equal-size shards whose label mixes are drawn per client from Dirichlet(alpha) over the
    classes (Hsu et al. 2019, Sec. 3): client k's examples are drawn one class at a time with
    probabilities q_k, without replacement; a class that runs out is dropped from q_k and the rest
    renormalised, so every example is used once and sizes differ by at most one."""
    values = np.unique(classes)
    pools = [list(rng.permutation(np.flatnonzero(classes == value))) for value in values]
    sizes = _split_count(len(classes), np.ones(num_clients))
    mixes = rng.dirichlet(np.full(len(values), alpha), size=num_clients)
    shards: list[list[int]] = [[] for _ in range(num_clients)]
    for client in rng.permutation(num_clients):
        for _ in range(sizes[client]):
            left = np.array([len(pool) > 0 for pool in pools])
            choice = rng.choice(len(pools), p=_normalised(mixes[client] * left, fallback=left))
            shards[client].append(pools[choice].pop())
    return [np.asarray(shard, dtype=np.int64) for shard in shards]


def _normalised(weights: np.ndarray, fallback: np.ndarray) -> np.ndarray:
    """``weights / sum``; when every weight underflowed to 0 (tiny alpha), spread over ``fallback``."""
    total = weights.sum()
    if total > 0:
        return weights / total
    fallback = fallback.astype(float)
    return fallback / fallback.sum()


def quantity_skew_shards(
    num_examples: int,
    num_clients: int,
    alpha: float,
    min_size: int,
    rng: np.random.Generator,
) -> list[np.ndarray]:
    """Shards of unequal size, labels iid: after giving every client ``min_size`` examples, the
    remaining ones are shared out in proportions drawn from Dirichlet(alpha) over clients
    (NIID-Bench's quantity skew; the floor replaces its redraw-until-large-enough loop, which
    need not end for small alpha and many clients)."""
    proportions = rng.dirichlet(np.full(num_clients, alpha))
    spare = num_examples - num_clients * min_size
    sizes = min_size + _split_count(spare, proportions)
    return list(np.split(rng.permutation(num_examples), np.cumsum(sizes)[:-1]))


def _split_count(total: int, proportions: np.ndarray) -> np.ndarray:
    """Integer parts of ``total`` following ``proportions``, summing exactly to ``total``
    (largest remainders get the leftover units)."""
    exact = proportions / proportions.sum() * total
    counts = np.floor(exact).astype(np.int64)
    leftover = total - int(counts.sum())
    counts[np.argsort(-(exact - counts), kind="stable")[:leftover]] += 1
    return counts


def label_proportion_shards(
    labels: Sequence[Label], cfg: PartitionConfig, rng: np.random.Generator
) -> list[np.ndarray]:
    """Each client's label distribution is one row of ``cfg.label_proportions`` (FedTT App. B,
    e.g. ``[[0.05, 0.95], [0.95, 0.05], [0.5, 0.5]]``).

    All clients get the same size ``s``, the largest the data allows: class ``j`` must supply
    ``s * sum_i p_ij`` examples, so ``s = min_j n_j / sum_i p_ij`` (and at most N / clients).
    Client ``i`` then draws ``floor(s * p_ij)`` examples of class ``j`` without replacement;
    examples that do not fit the proportions are left out of every shard.
    """
    classes = _class_labels(labels, "label_proportions")
    num_classes = int(classes.max()) + 1
    proportions = _check_proportions(cfg.label_proportions, cfg.num_clients, num_classes)
    available = np.bincount(classes, minlength=num_classes)
    demand = proportions.sum(axis=0)
    for label in range(num_classes):
        if demand[label] > 0 and available[label] == 0:
            raise ConfigError(
                "partition.label_proportions", f"label {label} has no training examples but a row asks for it"
            )
    size = min(
        len(classes) / cfg.num_clients,
        *(available[j] / demand[j] for j in range(num_classes) if demand[j] > 0),
    )
    counts = np.floor(size * proportions + 1e-9).astype(np.int64)
    pools = [rng.permutation(np.flatnonzero(classes == j)) for j in range(num_classes)]
    offsets = np.zeros(num_classes, dtype=np.int64)
    shards = []
    for client_counts in counts:
        parts = [pools[j][offsets[j] : offsets[j] + client_counts[j]] for j in range(num_classes)]
        offsets += client_counts
        shards.append(np.concatenate(parts))
    return shards


def _class_labels(labels: Sequence[Label], kind: str) -> np.ndarray:
    if any(label is None for label in labels) or is_regression(labels):
        raise ConfigError("partition.kind", f"{kind} needs a class label (0..K-1) on every example")
    classes = np.asarray([int(label) for label in labels], dtype=np.int64)  # type: ignore[arg-type]
    if classes.min() < 0:
        raise ConfigError("partition.kind", f"{kind} needs class ids 0..K-1, got {int(classes.min())}")
    return classes


def _check_proportions(rows: list[list[float]] | None, num_clients: int, num_classes: int) -> np.ndarray:
    """The ``label_proportions`` matrix, checked: one row per client, one entry per label,
    non-negative, each row summing to 1."""
    field = "partition.label_proportions"
    if rows is None:
        raise ConfigError(field, "required when partition.kind is 'label_proportions'")
    if len(rows) != num_clients:
        raise ConfigError(field, f"{len(rows)} rows for {num_clients} clients; give one row per client")
    for index, row in enumerate(rows):
        if len(row) != num_classes:
            raise ConfigError(
                field,
                f"row {index} has {len(row)} entries; the data has {num_classes} labels, give one per label",
            )
        if any(value < 0 for value in row) or not math.isclose(sum(row), 1.0, abs_tol=1e-6):
            raise ConfigError(field, f"row {index} {row} must be non-negative and sum to 1")
    return np.asarray(rows, dtype=float)


def natural_shards(groups: Sequence[str | None] | None, num_clients: int) -> list[np.ndarray]:
    """One client per distinct group name (sorted by name); the number of groups must be
    ``num_clients``."""
    if groups is None or any(group is None for group in groups):
        raise ConfigError("partition.kind", "natural needs a group on every example (set task.group_column)")
    names = sorted(set(groups))  # type: ignore[type-var]
    if len(names) != num_clients:
        raise ConfigError(
            "partition.num_clients",
            f"the data has {len(names)} distinct groups, so a natural partition has {len(names)} clients; "
            f"set partition.num_clients to {len(names)} (got {num_clients})",
        )
    client_of = {name: index for index, name in enumerate(names)}
    owners = np.asarray([client_of[group] for group in groups])
    return [np.flatnonzero(owners == client) for client in range(num_clients)]


# --------------------------------------------------------------------------------------------
# Summaries


def describe_partition(
    shards: Sequence[np.ndarray], labels: Sequence[Label], label_names: Sequence[str]
) -> list[dict[str, Any]]:
    """Per client: ``{"client", "size", "labels"}`` where ``labels`` maps each label name to its
    count in the shard. Without label names (regression), ``labels`` counts the quantile bins
    ``q1..q5`` used by ``dirichlet`` and ``mean`` gives the mean target."""
    classes = class_ids(labels) if label_names else quantile_bins(labels)
    names = list(label_names) or [f"q{index + 1}" for index in range(REGRESSION_BINS)]
    rows = []
    for client, shard in enumerate(shards):
        counts = np.bincount(classes[shard], minlength=len(names)) if len(shard) else np.zeros(len(names))
        row: dict[str, Any] = {
            "client": client,
            "size": len(shard),
            "labels": {name: int(counts[index]) for index, name in enumerate(names) if index < len(counts)},
        }
        if not label_names:
            targets = [labels[index] for index in shard.tolist() if labels[index] is not None]
            row["mean"] = float(np.mean(targets)) if targets else float("nan")
        rows.append(row)
    return rows


def format_partition_table(
    rows: Sequence[dict[str, Any]],
    label_names: Sequence[str] = (),
    title: str | None = None,
    max_label_columns: int = 10,
) -> Table:
    """A rich table of :func:`describe_partition` rows: client, size, then one column per label
    (in ``label_names`` order when given), or past ``max_label_columns`` labels the three most
    common labels of each client; regression rows also show the mean target."""
    names = list(label_names) or (list(rows[0]["labels"]) if rows else [])
    per_label = len(names) <= max_label_columns
    show_mean = any("mean" in row for row in rows)
    table = Table(title=title)
    table.add_column("client", justify="right")
    table.add_column("size", justify="right")
    for name in names if per_label else ["most common labels"]:
        table.add_column(name, justify="right" if per_label else "left")
    if show_mean:
        table.add_column("mean", justify="right")
    for row in rows:
        counts = row["labels"]
        if per_label:
            cells = [str(counts.get(name, 0)) for name in names]
        else:
            top = sorted(counts.items(), key=lambda item: -item[1])[:3]
            cells = [", ".join(f"{name} {count}" for name, count in top if count)]
        if show_mean:
            cells.append(f"{row['mean']:.3f}")
        table.add_row(str(row["client"]), str(row["size"]), *cells)
    return table
