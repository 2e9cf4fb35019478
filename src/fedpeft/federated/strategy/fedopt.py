"""Adaptive server optimizers of Reddi et al. (2021), "Adaptive Federated Optimization", Alg. 2.

m <- beta1 m + (1 - beta1) delta;  v <- second-moment rule of the subclass;
x <- x + eta * m / (sqrt(v) + tau).  As in the paper, there is no bias correction and
v starts at tau^2 (the paper requires v_{-1} >= tau^2), m at 0.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

import torch

from fedpeft.federated.strategy.base import Strategy
from fedpeft.federated.types import State


class FedOpt(Strategy):
    optimizer_fields = frozenset({"beta1", "beta2", "tau"})

    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg)
        self.m: State = {}
        self.v: State = {}

    @abstractmethod
    def second_moment(self, v: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """The new second moment from the old one and this round's averaged update."""

    def step(self, global_state: State, delta: State) -> State:
        b1, eta, tau = self.cfg.beta1, self.cfg.server_lr, self.cfg.tau
        new_state = dict(global_state)
        for key, d in delta.items():
            m = self.m.get(key, torch.zeros_like(d))
            v = self.v.get(key, torch.full_like(d, tau * tau))
            m = b1 * m + (1 - b1) * d
            v = self.second_moment(v, d)
            self.m[key], self.v[key] = m, v
            new_state[key] = global_state[key] + eta * m / (v.sqrt() + tau)
        return new_state

    def state_dict(self) -> dict[str, Any]:
        return {"m": {k: t.clone() for k, t in self.m.items()}, "v": {k: t.clone() for k, t in self.v.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.m = {k: t.clone() for k, t in state.get("m", {}).items()}
        self.v = {k: t.clone() for k, t in state.get("v", {}).items()}
