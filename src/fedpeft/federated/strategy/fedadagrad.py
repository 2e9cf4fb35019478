"""FedAdagrad: v <- v + delta^2 (Reddi et al., 2021)."""

from __future__ import annotations

import torch

from fedpeft.federated.strategy.base import register_strategy
from fedpeft.federated.strategy.fedopt import FedOpt


@register_strategy
class FedAdagrad(FedOpt):
    name = "fedadagrad"
    optimizer_fields = frozenset({"beta1", "tau"})  # Adagrad's second moment has no beta2

    def second_moment(self, v: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        return v + delta * delta
