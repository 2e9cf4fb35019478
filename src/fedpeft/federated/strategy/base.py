"""Server strategies: aggregate client updates into a pseudo-gradient and step the global state.

A strategy sees a list of :class:`ClientResult` (updates = local minus start) and returns the
new global state. Aggregation is per key over the clients that sent that key, so partial
uploads (RoLoRA, FedTT+, sparse codecs) need no special case. Keys nobody sent stay as they are.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from pydantic import BaseModel

from fedpeft.config import ConfigError, StrategyConfig
from fedpeft.federated.types import ClientResult, State

OPTIMIZER_FIELDS = frozenset({"server_momentum", "beta1", "beta2", "tau", "proximal_mu"})
"""``StrategyConfig`` fields that only some server optimisers (or a method's own server) read; the rest
(selection, ``server_lr``, weighting, robust aggregation, ...) apply to every strategy. A value given for
one that nothing in the run reads is refused (:func:`fedpeft.federated.algorithm.check_strategy_fields`):
``proximal_mu`` with ``name: fedavg`` would otherwise run plain FedAvg under a FedProx label."""


def weighted_mean(updates: Sequence[State], weights: Sequence[float]) -> State:
    """Per-key mean of ``updates`` weighted by ``weights``, over the updates holding the key."""
    totals: dict[str, torch.Tensor] = {}
    mass: dict[str, float] = {}
    for update, weight in zip(updates, weights, strict=True):
        for key, value in update.items():
            scaled = value.to(torch.float32) * weight
            totals[key] = totals[key] + scaled if key in totals else scaled
            mass[key] = mass.get(key, 0.0) + weight
    return {key: total / mass[key] for key, total in totals.items()}


class Strategy(ABC):
    """Aggregation (sample-weighted mean, Eq. 1 of McMahan et al.) followed by a server step."""

    name: ClassVar[str]
    default_weighting: ClassVar[str] = "samples"
    strategy_options: ClassVar[tuple[type[BaseModel], ...]] = ()  # its own ``strategy.*`` fields
    optimizer_fields: ClassVar[frozenset[str]] = frozenset()  # the OPTIMIZER_FIELDS it reads

    def __init__(self, cfg: StrategyConfig) -> None:
        self.cfg = cfg

    @property
    def weighting(self) -> str:
        """``samples`` (each client by its sample count) or ``uniform`` (1/N): ``strategy.weighting`` or
        the strategy's default."""
        return self.cfg.weighting or self.default_weighting

    def client_config(self) -> dict[str, Any]:
        """Extra instructions every client gets with its task (e.g. FedProx's mu)."""
        return {}

    def aggregate(self, global_state: State, results: Sequence[ClientResult]) -> State:
        """The sample-weighted mean (or the configured robust aggregate) stepped by the server."""
        from fedpeft.federated.strategy.robust import robust_delta

        return self.step(global_state, robust_delta(self.cfg, results, self.weighting))

    def server_privacy(self, rounds: int, cohort: int, population: int) -> dict[str, Any] | None:
        """The client-level DP guarantee of the server's own noise after ``rounds`` rounds of ``cohort``
        clients sampled from ``population`` (``epsilon``, ``delta``, ...); None when it adds none."""
        return None

    @abstractmethod
    def step(self, global_state: State, delta: State) -> State:
        """Apply the averaged update ``delta`` (a pseudo-gradient pointing downhill) to the state."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state


STRATEGIES: dict[str, type[Strategy]] = {}


def register_strategy(cls: type[Strategy]) -> type[Strategy]:
    STRATEGIES[cls.name] = cls
    return cls


def build_strategy(cfg: StrategyConfig) -> Strategy:
    if cfg.name not in STRATEGIES:
        raise ConfigError("strategy.name", f"unknown strategy {cfg.name!r}; allowed: {', '.join(sorted(STRATEGIES))}")
    return STRATEGIES[cfg.name](cfg)
