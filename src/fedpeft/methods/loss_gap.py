"""Loss-gap client selection (``papers/003``, Sec. 3.3, Eq. 9), usable by any recipe.

``strategy.selection: loss_gap`` picks the K clients with the largest gap between their last
reported local loss and the global loss:

    S^(r) = argmax_{1..K} ( L_c^(r') - L_g^(r-1) )                         (Eq. 9)

- ``L_c^(r')`` is client c's training loss from the last round it took part in (the mean loss
  of its local steps, :attr:`ClientResult.train_loss`). A client never selected has an infinite
  loss, so every client gets a turn before any is picked twice ("we initiate all clients with
  high loss values").
- ``L_g^(r-1)`` is the global model's loss: the evaluation's ``loss`` when the evaluation reports
  one, else the sample-weighted mean of the last round's client losses. It is the same number for
  every client, so it never changes which clients are picked; it is kept for the logged gaps.
- Ties (e.g. all the never-selected clients) are broken by the round's seeded generator.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from fedpeft.federated.selection import Selector, register_selector
from fedpeft.federated.types import ClientResult


def loss_gap_selection(last_losses: Sequence[float], global_loss: float, k: int,
                       rng: np.random.Generator) -> list[int]:
    """Eq. 9: the ``k`` clients with the largest ``last_loss - global_loss`` (sorted ids).

    ``inf`` marks a client never seen; ties are ordered by a random permutation from ``rng``.
    """
    losses = np.asarray(last_losses, dtype=np.float64)
    offset = 0.0 if math.isnan(global_loss) else global_loss
    gaps = losses - offset
    shuffled = rng.permutation(len(losses))
    order = shuffled[np.argsort(-gaps[shuffled], kind="stable")]
    return sorted(int(c) for c in order[:k])


@register_selector
class LossGapSelector(Selector):
    """Eq. 9 selection; remembers each client's last loss and the last global loss."""

    name = "loss_gap"

    def __init__(self, num_clients: int) -> None:
        super().__init__(num_clients)
        self.last_losses = [math.inf] * num_clients
        self.global_loss = math.nan

    def select(self, round_idx: int, k: int, rng: np.random.Generator) -> list[int]:
        return loss_gap_selection(self.last_losses, self.global_loss, k, rng)

    def observe(self, round_idx: int, results: Sequence[ClientResult], global_metrics: dict[str, float]) -> None:
        reported = [r for r in results if math.isfinite(r.train_loss)]
        for r in reported:
            self.last_losses[r.client_id] = float(r.train_loss)
        if "loss" in global_metrics:
            self.global_loss = float(global_metrics["loss"])
        elif reported:
            weights = [r.num_samples for r in reported]
            self.global_loss = float(np.average([r.train_loss for r in reported], weights=weights))

    def gaps(self) -> list[float]:
        """Each client's current ``L_c - L_g`` (``inf`` for clients never selected)."""
        offset = 0.0 if math.isnan(self.global_loss) else self.global_loss
        return [loss - offset for loss in self.last_losses]

    def state_dict(self) -> dict[str, Any]:
        return {"last_losses": list(self.last_losses), "global_loss": self.global_loss}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            self.last_losses = [float(x) for x in state["last_losses"]]
            self.global_loss = float(state["global_loss"])
