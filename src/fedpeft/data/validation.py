"""The validation split: examples carved out of the training data for tuning, never for reporting.

``task.validation_fraction`` takes that fraction of the (subsampled) training set out before it
is partitioned, stratified by class (the example's label, or its class for NER/QA, see
:func:`fedpeft.data.partition.class_ids`; regression targets by quantile bin), so no validation
example ever reaches a client's shard, and the eval split is never touched. The draw uses a
fixed seed, like ``max_train_examples``: every run and every seed of a comparison trains on the
same examples and tunes on the same validation set. ``task.validation_file`` reads the split
from a file instead (see :func:`fedpeft.data.tasks.load_task`).
"""

from __future__ import annotations

import numpy as np

from fedpeft.config import ConfigError
from fedpeft.data.partition import class_ids
from fedpeft.data.types import Example

VALIDATION_SEED = 20_241_124
"""Seed of the stratified draw: fixed, so the split does not move with the run's seed."""


def validation_indices(labels: list[int | float | None], fraction: float, seed: int = VALIDATION_SEED) -> np.ndarray:
    """Sorted indices of the validation examples: ``round(fraction * n_c)`` of each class ``c``.

    Raises :class:`ConfigError` (``task.validation_fraction``) when a class would keep no training
    example, or when the split would be empty.
    """
    classes = class_ids(labels) if any(label is not None for label in labels) else np.zeros(len(labels), np.int64)
    rng = np.random.default_rng(seed)
    chosen: list[np.ndarray] = []
    for value in np.unique(classes):
        members = np.flatnonzero(classes == value)
        take = round(fraction * len(members))
        if take >= len(members):
            raise ConfigError("task.validation_fraction",
                              f"{fraction} of the {len(members)} training example(s) of class {int(value)} leaves it "
                              "no training example; use a smaller fraction")
        chosen.append(rng.choice(members, size=take, replace=False))
    picked = np.sort(np.concatenate(chosen)) if chosen else np.zeros(0, np.int64)
    if len(picked) == 0:
        raise ConfigError("task.validation_fraction",
                          f"{fraction} of {len(labels)} training examples is an empty validation split; use a larger "
                          "fraction")
    return picked.astype(np.int64)


def split_validation(train: list[Example], fraction: float) -> tuple[list[Example], list[Example]]:
    """(training examples, validation examples), both in their original order."""
    held = set(validation_indices([ex.label for ex in train], fraction).tolist())
    return ([ex for i, ex in enumerate(train) if i not in held], [ex for i, ex in enumerate(train) if i in held])
