"""Robust aggregation: defences against poisoned or broken updates, for any strategy.

``clip`` scales every client update to L2 norm at most ``clip_norm`` before the weighted mean
(bounds any one client's influence); ``median`` takes the coordinate-wise median (Yin et al.,
2018); ``trimmed_mean`` drops the ``trim_fraction`` largest and smallest values of every
coordinate and averages the rest. Median and trimmed mean ignore sample counts, as in their
papers. The result feeds the configured server step (FedAvg, FedAdam, ...).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from fedpeft.config import StrategyConfig
from fedpeft.federated.strategy.base import weighted_mean
from fedpeft.federated.types import ClientResult, State


def clip_update(update: State, max_norm: float) -> State:
    norm = math.sqrt(sum(float(v.float().pow(2).sum()) for v in update.values()))
    scale = min(1.0, max_norm / norm) if norm > 0 else 1.0
    return {k: v * scale for k, v in update.items()}


def clipped_if_robust(cfg: StrategyConfig, update: State) -> State:
    """``update`` clipped to ``cfg.clip_norm`` under ``robust: clip`` (for methods that aggregate
    with their own weights and can honour clipping, not median or trimmed mean)."""
    return clip_update(update, cfg.clip_norm) if cfg.robust == "clip" else update


def _stacked(updates: Sequence[State]) -> dict[str, torch.Tensor]:
    keys = set().union(*updates)
    return {k: torch.stack([u[k].float() for u in updates if k in u]) for k in keys}


def coordinate_median(updates: Sequence[State]) -> State:
    """Per coordinate; with an even count, the mean of the two middle values."""
    return {k: torch.quantile(v, 0.5, dim=0) for k, v in _stacked(updates).items()}


def trimmed_mean(updates: Sequence[State], fraction: float) -> State:
    out = {}
    for key, values in _stacked(updates).items():
        n = values.shape[0]
        cut = min(math.floor(fraction * n), (n - 1) // 2)
        ordered = values.sort(dim=0).values
        out[key] = ordered[cut: n - cut].mean(dim=0)
    return out


def robust_delta(cfg: StrategyConfig, results: Sequence[ClientResult], weighting: str = "samples") -> State:
    """The aggregated update under ``cfg.robust`` (the plain mean for ``none``), each client weighted by
    its sample count (``weighting="samples"``, McMahan et al.'s Eq. 1) or equally (``"uniform"``)."""
    updates = [r.update for r in results]
    weights = [1.0 if weighting == "uniform" else float(r.num_samples) for r in results]
    if cfg.robust == "clip":
        return weighted_mean([clip_update(u, cfg.clip_norm) for u in updates], weights)
    if cfg.robust == "median":
        return coordinate_median(updates)
    if cfg.robust == "trimmed_mean":
        return trimmed_mean(updates, cfg.trim_fraction)
    return weighted_mean(updates, weights)
