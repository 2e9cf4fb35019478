"""Server strategies, one file each. Importing this package registers them all."""

from fedpeft.federated.strategy import fedadagrad, fedadam, fedadamw, fedavg, fedavgm, fedprox, fedyogi
from fedpeft.federated.strategy.base import (
    OPTIMIZER_FIELDS,
    STRATEGIES,
    Strategy,
    build_strategy,
    register_strategy,
    weighted_mean,
)

__all__ = [
    "OPTIMIZER_FIELDS", "STRATEGIES", "Strategy", "build_strategy", "fedadagrad", "fedadam", "fedadamw", "fedavg",
    "fedavgm", "fedprox", "fedyogi", "register_strategy", "weighted_mean",
]
