"""FedAvg (McMahan et al., 2017): x <- x + eta * mean_w(delta); eta = 1 averages the weights."""

from __future__ import annotations

from fedpeft.federated.strategy.base import Strategy, register_strategy
from fedpeft.federated.types import State


@register_strategy
class FedAvg(Strategy):
    name = "fedavg"

    def step(self, global_state: State, delta: State) -> State:
        lr = self.cfg.server_lr
        return {k: v + lr * delta[k] if k in delta else v for k, v in global_state.items()}
