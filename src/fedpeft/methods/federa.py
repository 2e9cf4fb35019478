"""LoRA-family FedAvg with FeDeRA's update-stability monitor (Section 4.2, Eq. 11-14).

The ``lora`` algorithm is plain FedAvg over the LoRA matrices (FedLR and FeDeRA share it: FeDeRA
differs only in its initialisation, :mod:`fedpeft.adapters.federa`), and it logs, every round,
how much each global LoRA matrix moved between consecutive global states w^{t-1} -> w^t:

    M_W = [||w^1||, ..., ||w^k||]                     (Eq. 11, column norms)
    D_W = [w^1 / ||w^1||, ..., w^k / ||w^k||]         (Eq. 12, column directions)
    dM(W1, W2) = sum_n |m1^n - m2^n| / k               (Eq. 13)
    dD(W1, W2) = sum_n (1 - cos(d1^n, d2^n)) / k       (Eq. 14)

W is taken in the paper's layout (out x in, like ``nn.Linear.weight``: B is d x r, A is r x k),
and its columns are the vectors ``W[:, j]``. A zero column (LoRA's B at round 0) has no
direction: its cosine similarity is taken as 0 (``torch.nn.functional.cosine_similarity``'s eps),
so it counts as a full unit of direction change. These are the curves of the paper's Fig. 3-4.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from fedpeft.federated.algorithm import Algorithm, register_algorithm
from fedpeft.federated.types import ClientResult, State


def lora_matrix(key: str) -> str | None:
    """``"A"`` or ``"B"`` for a LoRA matrix's parameter name, else None."""
    if ".lora_A." in key:
        return "A"
    if ".lora_B." in key:
        return "B"
    return None


def short_name(key: str) -> str:
    """``bert.encoder.layer.0.attention.self.query.lora_A.default.weight`` -> ``...query.lora_A``."""
    for matrix in ("lora_A", "lora_B"):
        marker = f".{matrix}."
        if marker in key:
            return key.split(marker)[0] + f".{matrix}"
    return key


def magnitude_variation(w1: torch.Tensor, w2: torch.Tensor) -> float:
    """Eq. 13: mean absolute change of the column norms (Eq. 11) of two d x k matrices."""
    m1 = torch.linalg.vector_norm(w1.double(), dim=0)
    m2 = torch.linalg.vector_norm(w2.double(), dim=0)
    return float((m1 - m2).abs().mean())


def direction_variation(w1: torch.Tensor, w2: torch.Tensor) -> float:
    """Eq. 14: mean (1 - cosine similarity) of the column directions (Eq. 12) of two d x k matrices."""
    cosine = F.cosine_similarity(w1.double(), w2.double(), dim=0, eps=1e-12)
    return float((1.0 - cosine).clamp(0.0, 2.0).mean())  # clamp: rounding can push cos past 1


def lora_variation(previous: State, current: State) -> dict[str, Any]:
    """Per LoRA matrix and averaged per kind (A, B): Eq. 13 and Eq. 14 between two global states."""
    magnitude: dict[str, float] = {}
    direction: dict[str, float] = {}
    per_kind: dict[str, list[tuple[float, float]]] = {"A": [], "B": []}
    for key in sorted(current):
        kind = lora_matrix(key)
        if kind is None or key not in previous:
            continue
        dm = magnitude_variation(previous[key], current[key])
        dd = direction_variation(previous[key], current[key])
        magnitude[short_name(key)] = dm
        direction[short_name(key)] = dd
        per_kind[kind].append((dm, dd))
    if not magnitude:
        return {}
    metrics: dict[str, Any] = {"magnitude_variation": magnitude, "direction_variation": direction}
    for kind, values in per_kind.items():
        if values:
            metrics[f"magnitude_variation_{kind}"] = sum(v[0] for v in values) / len(values)
            metrics[f"direction_variation_{kind}"] = sum(v[1] for v in values) / len(values)
    return metrics


@register_algorithm
class LoraFedAvg(Algorithm):
    """FedAvg (or the configured strategy) over LoRA matrices, logging Eq. 13-14 every round."""

    name = "lora"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._variation: dict[str, Any] = {}

    def aggregate(self, round_idx: int, global_state: State, results: Sequence[ClientResult]) -> State:
        new_state = super().aggregate(round_idx, global_state, results)
        self._variation = lora_variation(global_state, new_state)
        return new_state

    def round_metrics(self, round_idx: int, global_state: State) -> dict[str, Any]:
        return dict(self._variation)
