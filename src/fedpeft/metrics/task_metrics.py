"""Evaluation metrics of the built-in and user tasks (GLUE / SuperGLUE conventions).

Every metric is a pure function of ``predictions`` and ``references`` (numpy arrays of class ids,
or of floats for regression) returning a Python float. :func:`compute_metrics` evaluates several
by name; the names are the ones a task's ``metrics`` lists (the first is the primary metric).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
from scipy import stats
from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef


def accuracy(predictions: np.ndarray, references: np.ndarray, num_labels: int | None = None) -> float:
    """Fraction of predictions equal to their reference."""
    return float(accuracy_score(references, predictions))


def f1(predictions: np.ndarray, references: np.ndarray, num_labels: int | None = None) -> float:
    """GLUE's F1: F1 of class 1 for a binary task (MRPC, QQP), macro-F1 otherwise.

    A task is binary when ``num_labels == 2`` or, when the caller does not say, when every
    prediction and reference is 0 or 1.
    """
    binary = num_labels == 2 if num_labels is not None else _is_binary(predictions, references)
    if binary:
        return float(f1_score(references, predictions, pos_label=1, average="binary", zero_division=0))
    return macro_f1(predictions, references, num_labels)


def macro_f1(predictions: np.ndarray, references: np.ndarray, num_labels: int | None = None) -> float:
    """Unweighted mean of the per-class F1 over the classes seen in references or predictions."""
    return float(f1_score(references, predictions, average="macro", zero_division=0))


def matthews(predictions: np.ndarray, references: np.ndarray, num_labels: int | None = None) -> float:
    """Matthews correlation coefficient (CoLA's metric); 0.0 for a constant predictor."""
    return float(matthews_corrcoef(references, predictions))


def pearson(predictions: np.ndarray, references: np.ndarray, num_labels: int | None = None) -> float:
    """Pearson correlation (STS-B). 0.0 when either side is constant: the correlation is then
    undefined (scipy gives NaN) and a constant prediction carries no information."""
    if _is_constant(predictions) or _is_constant(references):
        return 0.0
    return float(stats.pearsonr(predictions.astype(float), references.astype(float))[0])


def spearman(predictions: np.ndarray, references: np.ndarray, num_labels: int | None = None) -> float:
    """Spearman rank correlation (STS-B); 0.0 when either side is constant, as for :func:`pearson`."""
    if _is_constant(predictions) or _is_constant(references):
        return 0.0
    return float(stats.spearmanr(predictions.astype(float), references.astype(float))[0])


MetricFunction = Callable[[np.ndarray, np.ndarray, int | None], float]

METRICS: dict[str, MetricFunction] = {
    "accuracy": accuracy,
    "f1": f1,
    "macro_f1": macro_f1,
    "matthews": matthews,
    "pearson": pearson,
    "spearman": spearman,
}
METRIC_NAMES: tuple[str, ...] = tuple(METRICS)
REGRESSION_METRICS = frozenset({"pearson", "spearman"})


def compute_metrics(
    names: Sequence[str],
    predictions: np.ndarray,
    references: np.ndarray,
    num_labels: int | None = None,
) -> dict[str, float]:
    """Evaluate each metric in ``names`` on the predictions, in the order given.

    ``predictions`` are class ids (or floats for regression). A 2-D array of per-class scores
    (logits) is reduced by argmax and an ``(n, 1)`` array is squeezed, so a head's raw output
    can be passed as is. ``num_labels`` (optional) tells :func:`f1` whether the task is binary.
    """
    unknown = [name for name in names if name not in METRICS]
    if unknown:
        raise ValueError(f"unknown metric {unknown[0]!r}; allowed: {', '.join(METRIC_NAMES)}")
    predictions = _as_prediction_vector(np.asarray(predictions))
    references = np.asarray(references).reshape(-1)
    if predictions.shape != references.shape:
        raise ValueError(
            f"predictions and references differ in length: {predictions.shape[0]} vs {references.shape[0]}"
        )
    if references.size == 0:
        raise ValueError("cannot compute metrics on zero examples")
    return {name: METRICS[name](predictions, references, num_labels) for name in names}


def constant_score(name: str, references: Sequence[int]) -> float | None:
    """The best ``name`` score of a model that gives every example the same class, picked with hindsight
    among the classes of ``references``: the level a classifier must beat to have learned anything.

    Accuracy: the most frequent class's share. GLUE's binary F1: ``2p / (1 + p)`` for the positive class's
    share ``p`` (MRPC's dev set: 0.81). Macro-F1 over K classes: the most frequent class's F1 over K
    (0.42 on a 72/28 split). Matthews: 0. Scored as evaluation scores (no ``num_labels``). None for a
    regression metric or no references."""
    if name in REGRESSION_METRICS or name not in METRICS or not len(references):
        return None
    refs = np.asarray(references).reshape(-1)
    return max(METRICS[name](np.full_like(refs, label), refs, None) for label in np.unique(refs))


def _as_prediction_vector(predictions: np.ndarray) -> np.ndarray:
    if predictions.ndim == 2 and predictions.shape[1] == 1:
        return predictions[:, 0]
    if predictions.ndim == 2:
        return predictions.argmax(axis=1)
    return predictions.reshape(-1)


def _is_binary(predictions: np.ndarray, references: np.ndarray) -> bool:
    seen = np.union1d(np.unique(predictions), np.unique(references))
    return bool(np.isin(seen, [0, 1]).all())


def _is_constant(values: np.ndarray) -> bool:
    return bool(np.all(values == values.reshape(-1)[0]))
