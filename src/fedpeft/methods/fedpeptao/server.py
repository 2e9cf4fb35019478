"""The server half of FedPepTAO's Algorithm 2: control variates, momentum and a global learning-rate schedule.

Per round r, over the keys the clients sent (S = this round's clients, weights n_i / N, Eq. 4)::

    Delta w^r  = sum_i (n_i/N) Delta w_i^r                         (line 12; Delta w_i = local - start)
    c_i^r      = c_i^{r-1} - c_g^{r-1} - Delta w_i^r / (T_i alpha)  (line 14; T_i local steps, alpha device lr)
    Delta c^r  = sum_i (n_i/N) (c_i^r - c_i^{r-1})                 (lines 15, 17)
    c_g^r      = c_g^{r-1} + Delta c^r |S| / |M|                    (line 18)
    g^r        = Delta w^{r-1} - Delta w^r                          (line 19; Delta w^0 = 0)
    m_i^r      = beta m^{r-1} + (1 - beta) g^r + c_g^r - c_i^r      (line 21)
    w_i^r      = base - eta^r m_i^r                                 (line 22)
    w^r, m^r   = sum_i (n_i/N) w_i^r, sum_i (n_i/N) m_i^r           (lines 24, 25)

``base`` is our one reading beyond the text. Line 22 writes w^{r-1}; taken literally the clients'
updates never enter w except through g, which telescopes: with beta = 0 and no control variates
w^R = w^0 + eta Delta w^R, whatever happened before. The released code (and every FedOpt-style
method) starts from the aggregated client models P_avg = w^{r-1} + Delta w^r, so ``aggregate`` (the
default) uses that and ``previous`` is the literal text. eta^r = max(eta^1 decay^(r-1), eta_min):
the paper's "set of global learning rates" as a schedule (constant by default; Sec. 4.6 uses 1e-3).

``released`` reproduces the authors' code (``run_fed_pers_with_optim_v2.py``, ``fsgdm.py``) minus
its defects: Delta = P^{r-1} - P_avg (the opposite sign, so g flips), no server step in the first
round (it only stores Delta), eta = max(0.99 eta, 1e-4) starting from 0.05 with the first decay
before the first use, v_i = 0.9 v + 0.1 g + c - c_i, P_i = P_avg - eta v_i, and P, v the
sample-weighted means. Its momentum buffer is not chained across the clients of a round as
``Fsgdm`` does by reference: every client starts from the same v^{r-1}.

Setting ``control_variates`` off drops c_g - c_i (the MomS+AdamD baseline).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fedpeft.federated.client_store import ClientStateStore
from fedpeft.federated.types import State


@dataclass
class ClientDelta:
    """One client's reply as the server sees it."""

    client_id: int
    delta: State
    num_samples: int
    local_steps: int


@dataclass
class AdaptiveServerOptions:
    beta: float = 0.9
    lr: float = 1e-3
    lr_decay: float = 1.0
    lr_min: float = 0.0
    local_lr: float = 1e-2
    num_devices: int = 1
    control_variates: bool = True
    base: str = "aggregate"
    variant: str = "paper"


def _weighted(values: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    total = float(sum(weights))
    return sum((w / total) * v for v, w in zip(values, weights, strict=True))  # type: ignore[return-value]


@dataclass
class AdaptiveServer:
    """Server state of Algorithm 2 (persists across rounds and in checkpoints)."""

    options: AdaptiveServerOptions
    global_control: State = field(default_factory=dict)
    client_controls: ClientStateStore = field(default_factory=lambda: ClientStateStore("controls"))
    momentum: State = field(default_factory=dict)
    previous_delta: State = field(default_factory=dict)
    rounds_done: int = 0

    def learning_rate(self, round_idx: int) -> float:
        """eta^r; ``released`` decays from the start value before the first use."""
        o = self.options
        return max(o.lr * o.lr_decay ** (round_idx - 1), o.lr_min)

    def step(self, round_idx: int, global_state: State, replies: Sequence[ClientDelta]) -> State:
        """One server round over the keys the clients sent; other keys are returned unchanged."""
        o = self.options
        keys = sorted({k for r in replies for k in r.delta})
        weights = [float(r.num_samples) for r in replies]
        new_state = dict(global_state)
        fraction = len(replies) / o.num_devices
        released = o.variant == "released"
        lr = self.learning_rate(round_idx)
        # this round's devices' control variates c_i^{r-1} (read once; written back after the round)
        stored = {r.client_id: (self.client_controls.get(r.client_id) or {}) if o.control_variates else {}
                  for r in replies}
        for key in keys:
            senders = [(r, w) for r, w in zip(replies, weights) if key in r.delta]
            sender_weights = [w for _, w in senders]
            mean_delta = _weighted([r.delta[key] for r, _ in senders], sender_weights)  # line 12
            aggregate = global_state[key] + mean_delta
            zero = torch.zeros_like(mean_delta)
            old_global_c = self.global_control.get(key, zero)
            controls: dict[int, torch.Tensor] = {}
            if o.control_variates:
                changes = []
                for reply, _ in senders:
                    old = stored[reply.client_id].get(key, zero)
                    new = old - old_global_c - reply.delta[key] / (reply.local_steps * o.local_lr)  # line 14
                    controls[reply.client_id] = new
                    changes.append(new - old)  # line 15
                self.global_control[key] = old_global_c + _weighted(changes, sender_weights) * fraction  # lines 17-18
                for client_id, control in controls.items():
                    stored[client_id][key] = control
            signed = -mean_delta if released else mean_delta
            previous = self.previous_delta.get(key)
            self.previous_delta[key] = signed
            if released and previous is None:  # the released code only records Delta in round 1
                new_state[key] = aggregate
                continue
            g = (previous if previous is not None else zero) - signed  # line 19
            base = aggregate if o.base == "aggregate" else global_state[key]
            m_prev = self.momentum.get(key, zero)
            locals_w, locals_m = [], []
            for reply, _ in senders:
                correction = (self.global_control[key] - controls[reply.client_id]) if o.control_variates else zero
                m_i = o.beta * m_prev + (1 - o.beta) * g + correction  # line 21
                locals_m.append(m_i)
                locals_w.append(base - lr * m_i)  # line 22
            new_state[key] = _weighted(locals_w, sender_weights)  # line 24
            self.momentum[key] = _weighted(locals_m, sender_weights)  # line 25
        if o.control_variates:
            for client_id, control_state in stored.items():
                self.client_controls.put(client_id, control_state)
        self.rounds_done = round_idx
        return new_state

    def forget(self, keys: Sequence[str]) -> None:
        """Drop the state of keys that will no longer be exchanged (layers left on the clients)."""
        for table in (self.global_control, self.momentum, self.previous_delta):
            for key in keys:
                table.pop(key, None)
        for client in list(self.client_controls):  # one device at a time: memory stays flat
            kept = {k: v for k, v in self.client_controls[client].items() if k not in keys}
            self.client_controls.put(client, kept)

    def state_dict(self) -> dict[str, Any]:
        return {
            "global_control": dict(self.global_control),
            "client_controls": self.client_controls.state_dict(),
            "momentum": dict(self.momentum),
            "previous_delta": dict(self.previous_delta),
            "rounds_done": self.rounds_done,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.global_control = dict(state.get("global_control", {}))
        self.client_controls.load_state_dict(state["client_controls"])
        self.momentum = dict(state.get("momentum", {}))
        self.previous_delta = dict(state.get("previous_delta", {}))
        self.rounds_done = int(state.get("rounds_done", 0))
