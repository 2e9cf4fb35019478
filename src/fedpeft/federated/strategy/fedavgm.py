"""FedAvgM (Hsu et al., 2019): server momentum v <- beta v + delta; x <- x + eta v."""

from __future__ import annotations

from typing import Any

import torch

from fedpeft.federated.strategy.base import Strategy, register_strategy
from fedpeft.federated.types import State


@register_strategy
class FedAvgM(Strategy):
    name = "fedavgm"
    optimizer_fields = frozenset({"server_momentum"})

    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg)
        self.velocity: State = {}

    def step(self, global_state: State, delta: State) -> State:
        beta, lr = self.cfg.server_momentum, self.cfg.server_lr
        new_state = dict(global_state)
        for key, d in delta.items():
            v = beta * self.velocity[key] + d if key in self.velocity else d.clone()
            self.velocity[key] = v
            new_state[key] = global_state[key] + lr * v
        return new_state

    def state_dict(self) -> dict[str, Any]:
        return {"velocity": {k: v.clone() for k, v in self.velocity.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.velocity = {k: torch.as_tensor(v).clone() for k, v in state.get("velocity", {}).items()}
