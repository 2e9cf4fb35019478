"""What crosses between server and client in one round."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from fedpeft.federated.dp_sgd import ClientPrivacy

State = dict[str, torch.Tensor]


@dataclass
class ClientTask:
    """The server's instruction to one client for one round.

    ``payload`` is the global state the client loads before training (it may be a subset of
    the trainable keys, or a masked copy). ``train_keys`` are trained this round (None: every
    trainable key); ``upload_keys`` are returned as updates (None: the trained keys).
    ``config`` carries per-round knobs from the strategy or method (proximal mu, masks, ...).
    ``privacy`` is the client's own DP-SGD state (``client.dp``): attached on the client side by the
    engine, never sent by the server.
    """

    client_id: int
    payload: State
    train_keys: frozenset[str] | None = None
    upload_keys: frozenset[str] | None = None
    config: dict[str, Any] = field(default_factory=dict)
    privacy: ClientPrivacy | None = None


@dataclass
class ClientResult:
    """A client's reply: its update (local minus start) for the upload keys, and statistics."""

    client_id: int
    update: State
    num_samples: int
    train_loss: float
    metrics: dict[str, float] = field(default_factory=dict)
