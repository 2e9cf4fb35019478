"""FedProx (Li et al., 2020): FedAvg on the server; clients add (mu/2)||w - w_global||^2."""

from __future__ import annotations

from typing import Any

from fedpeft.federated.strategy.base import register_strategy
from fedpeft.federated.strategy.fedavg import FedAvg


@register_strategy
class FedProx(FedAvg):
    name = "fedprox"
    optimizer_fields = frozenset({"proximal_mu"})

    def client_config(self) -> dict[str, Any]:
        return {"proximal_mu": self.cfg.proximal_mu}
