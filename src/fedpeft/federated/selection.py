"""Client selection: which clients train in a round.

``all`` is cross-silo (every client, every round); ``uniform`` is cross-device (a seeded random
subset of ``k`` clients). Methods add policies (e.g. loss-gap selection) by registering a
:class:`Selector` that may learn from each round's results through :meth:`Selector.observe`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

from fedpeft.config import ConfigError
from fedpeft.federated.types import ClientResult


class Selector:
    """Uniform sampling without replacement (cross-device)."""

    name: ClassVar[str] = "uniform"

    def __init__(self, num_clients: int) -> None:
        self.num_clients = num_clients

    def select(self, round_idx: int, k: int, rng: np.random.Generator) -> list[int]:
        del round_idx
        return sorted(rng.choice(self.num_clients, size=k, replace=False).tolist())

    def observe(self, round_idx: int, results: Sequence[ClientResult], global_metrics: dict[str, float]) -> None:
        """Learn from a finished round (no-op for stateless policies)."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state


class AllClients(Selector):
    """Cross-silo: every client every round."""

    name = "all"

    def select(self, round_idx: int, k: int, rng: np.random.Generator) -> list[int]:
        return list(range(self.num_clients))


SELECTORS: dict[str, type[Selector]] = {"uniform": Selector, "all": AllClients}


def register_selector(cls: type[Selector]) -> type[Selector]:
    SELECTORS[cls.name] = cls
    return cls


def build_selector(name: str, num_clients: int) -> Selector:
    if name not in SELECTORS:
        raise ConfigError("strategy.selection", f"unknown selection {name!r}; allowed: {', '.join(sorted(SELECTORS))}")
    return SELECTORS[name](num_clients)
