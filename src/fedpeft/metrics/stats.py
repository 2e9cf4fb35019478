"""Intervals over a metric: seeds, or the evaluation set's size when there is one seed.

With several seeds the 95% interval is Student's t over the seeds' values (mean +- t * s / sqrt(n),
s the sample standard deviation): it holds the variation of training (initialisation, client
sampling, batches, partition). With one seed only the evaluation set's sampling error is
known: the binomial standard error sqrt(p (1 - p) / n) of a fraction p measured on n examples,
which is exact for accuracy and an approximation for F1-like fractions. Two values are "within
noise" of each other when their intervals overlap.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from scipy import stats

CONFIDENCE = 0.95


@dataclass(frozen=True)
class Estimate:
    """A metric over seeds: mean, sample std (0 with one seed), its 95% interval and how it was made."""

    mean: float
    std: float
    low: float
    high: float
    seeds: int
    kind: str  # "t" over seeds, "binomial" from the eval size, or "none"

    def overlaps(self, other: Estimate) -> bool:
        return self.low <= other.high and other.low <= self.high


def binomial_halfwidth(p: float, n: int, confidence: float = CONFIDENCE) -> float:
    """Half the normal-approximation interval of a fraction ``p`` measured on ``n`` examples."""
    if n <= 0:
        raise ValueError(f"an interval needs a positive sample size, got {n}")
    p = min(max(p, 0.0), 1.0)
    return float(stats.norm.ppf(0.5 + confidence / 2)) * math.sqrt(p * (1 - p) / n)


def t_halfwidth(values: Sequence[float], confidence: float = CONFIDENCE) -> float:
    """Half Student's t interval of the mean of ``values`` (at least two)."""
    if len(values) < 2:
        raise ValueError("a t interval needs at least two values")
    sd = statistics.stdev(values)
    return float(stats.t.ppf(0.5 + confidence / 2, len(values) - 1)) * sd / math.sqrt(len(values))


def estimate(values: Sequence[float], eval_examples: int | None = None, fraction: bool = True) -> Estimate:
    """Mean and 95% interval of ``values`` (one per seed): t over seeds when there are several,
    else the binomial interval from ``eval_examples`` when the metric is a ``fraction`` in [0, 1],
    else a zero-width interval marked ``none``."""
    if not values:
        raise ValueError("no values to estimate from")
    mean = statistics.fmean(values)
    if len(values) > 1:
        half = t_halfwidth(values)
        low, high = mean - half, mean + half
        if fraction and all(0.0 <= v <= 1.0 for v in values):  # a fraction's interval stays inside [0, 1]
            low, high = max(low, 0.0), min(high, 1.0)
        return Estimate(mean, statistics.stdev(values), low, high, len(values), "t")
    if eval_examples and fraction and 0.0 <= mean <= 1.0:
        half = binomial_halfwidth(mean, eval_examples)
        return Estimate(mean, 0.0, mean - half, mean + half, 1, "binomial")
    return Estimate(mean, 0.0, mean, mean, 1, "none")
