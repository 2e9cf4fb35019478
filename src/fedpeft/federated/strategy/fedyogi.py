"""FedYogi: v <- v - (1 - beta2) delta^2 sign(v - delta^2) (Reddi et al., 2021)."""

from __future__ import annotations

import torch

from fedpeft.federated.strategy.base import register_strategy
from fedpeft.federated.strategy.fedopt import FedOpt


@register_strategy
class FedYogi(FedOpt):
    name = "fedyogi"

    def second_moment(self, v: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        sq = delta * delta
        return v - (1 - self.cfg.beta2) * sq * torch.sign(v - sq)
