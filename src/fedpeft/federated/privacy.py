"""Privacy budgets from Opacus's maintained accountants: DP-FedAdam (client-level DP on the
server) and local DP-SGD on every client (:class:`PrivacyLedger`).

DP-FedAdam:

Each round is one subsampled Gaussian mechanism: a client is sampled with probability
``q = cohort / population`` and the server adds N(0, sigma^2) to the sum of clipped updates
divided by C, so sigma is the noise multiplier the accountants expect. We compose ``rounds`` of
them with Opacus's RDP accountant (or its PRV accountant) and convert to epsilon at ``delta``.

Simulated cohorts (paper App. B.4, after Song et al.): experiments train with a small cohort n
but report epsilon for a large cohort n_sim. The noise on the *mean* update is sigma * C / n; a
cohort of n_sim gives the same noise on the mean with multiplier ``sigma * n_sim / n``, sampled at
``n_sim / population``. Utility is unchanged; only the reported epsilon moves.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch

from fedpeft.config import ClientConfig, ConfigError, DPConfig
from fedpeft.federated.client import local_steps
from fedpeft.federated.dp_sgd import ClientPrivacy
from fedpeft.federated.types import State

if TYPE_CHECKING:  # Opacus is imported where an accountant is needed: runs without DP start without it
    from opacus.accountants import IAccountant

Accountant = Literal["rdp", "prv"]
# Opacus's default RDP orders (1.1 .. 63), extended to 1024: with the large noise multipliers of
# simulated cohorts the best order lies above 63, and a wider grid only tightens the bound.
RDP_ORDERS = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)) + [64, 80, 96, 128, 192, 256, 384, 512, 1024]


def dp_epsilon(noise_multiplier: float, sample_rate: float, rounds: int, delta: float,
               accountant: Accountant = "rdp") -> float:
    """Epsilon after ``rounds`` subsampled Gaussian steps (``inf`` without noise)."""
    if not 0 < sample_rate <= 1:
        raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}")
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    if rounds <= 0:
        return 0.0
    if noise_multiplier <= 0:
        return float("inf")
    acct = make_accountant(accountant)
    for _ in range(rounds):  # the accountant merges identical consecutive steps, so this is cheap
        acct.step(noise_multiplier=noise_multiplier, sample_rate=sample_rate)
    return accountant_epsilon(acct, delta)


def simulated_noise_multiplier(noise_multiplier: float, cohort: int, simulated_cohort: int | None) -> float:
    """The multiplier a cohort of ``simulated_cohort`` would need for the same noise on the mean."""
    if simulated_cohort is None:
        return noise_multiplier
    return noise_multiplier * simulated_cohort / cohort


def dp_fedadam_epsilon(noise_multiplier: float, cohort: int, population: int, rounds: int, delta: float,
                       simulated_cohort: int | None = None, accountant: Accountant = "rdp") -> float:
    """Epsilon of DP-FedAdam for ``rounds`` rounds of ``cohort`` clients out of ``population``."""
    effective_cohort = simulated_cohort or cohort
    if effective_cohort > population:
        raise ValueError(f"cohort {effective_cohort} exceeds the population {population}")
    sigma = simulated_noise_multiplier(noise_multiplier, cohort, simulated_cohort)
    return dp_epsilon(sigma, effective_cohort / population, rounds, delta, accountant)


def make_accountant(accountant: Accountant) -> IAccountant:
    from opacus.accountants import PRVAccountant, RDPAccountant

    return RDPAccountant() if accountant == "rdp" else PRVAccountant()


def accountant_epsilon(acct: IAccountant, delta: float) -> float:
    """Epsilon spent so far by ``acct`` at ``delta`` (0 before its first step)."""
    from opacus.accountants import RDPAccountant

    if not acct.history:
        return 0.0
    if isinstance(acct, RDPAccountant):
        return float(acct.get_epsilon(delta=delta, alphas=RDP_ORDERS))
    return float(acct.get_epsilon(delta=delta))


def noise_multiplier_for(epsilon: float, delta: float, sample_rate: float, steps: int,
                         accountant: Accountant = "rdp") -> float:
    """The smallest sigma (to Opacus's 0.01 tolerance on epsilon, from above) for which ``steps``
    subsampled Gaussian steps at ``sample_rate`` spend at most ``epsilon`` at ``delta``."""
    from opacus.accountants.utils import get_noise_multiplier

    extra: dict[str, Any] = {"alphas": RDP_ORDERS} if accountant == "rdp" else {}
    with warnings.catch_warnings():  # the search probes huge sigmas whose best RDP order is the largest
        warnings.simplefilter("ignore")
        return float(get_noise_multiplier(target_epsilon=epsilon, target_delta=delta, sample_rate=sample_rate,
                                          steps=steps, accountant=accountant, **extra))


EPSILON, NOISE_MULTIPLIER, STEPS = "dp_epsilon", "dp_noise_multiplier", "dp_steps"
"""The keys of a DP client's privacy report in its reply's metrics (:meth:`PrivacyLedger.report`)."""


class PrivacyLedger:
    """Every client's DP-SGD plan and Opacus accountant: the client-side privacy state of a run.

    Client i (n_i examples) samples at q_i = min(1, batch_size / n_i) and takes s_i local steps per
    round; its noise multiplier is planned for ``dp.rounds * s_i`` steps (it may be selected in every
    round) so that it never spends more than ``dp.epsilon``. Its accountant counts the noisy steps
    it really took. Plans are a function of the config (cached by (q, steps)), so every process
    computes the same; :meth:`check` plans the most demanding client up front, so an impossible
    budget fails before training.

    The accountants are device-side state: the ledger of the process that serves a client holds
    its accountant while it trains (:meth:`device_state` moves it with the client or keeps it on
    its device) and the client reports what it has spent with its reply (:meth:`report`); the
    server builds the round's record from those reports (:func:`privacy_record`) and never needs
    an accountant. Where the server process is also the keeper of device state (local engine,
    torchrun rank 0) the accountants are checkpointed (:meth:`state_dict`).
    """

    def __init__(self, dp: DPConfig, client: ClientConfig, shard_sizes: Sequence[int]) -> None:
        self.dp = dp
        self.batch_size = client.batch_size
        self.sizes = [int(n) for n in shard_sizes]
        self.steps_per_round = [local_steps(n, client) for n in self.sizes]
        self.accountants: dict[int, IAccountant] = {}
        self._sigmas: dict[tuple[float, int], float] = {}
        self._spent: dict[int, tuple[tuple[Any, ...], float]] = {}

    def sample_rate(self, client_id: int) -> float:
        return min(1.0, self.batch_size / self.sizes[client_id])

    def planned_steps(self, client_id: int) -> int:
        assert self.dp.rounds is not None  # filled from the experiment's rounds by the config
        return self.dp.rounds * self.steps_per_round[client_id]

    def noise_multiplier(self, client_id: int) -> float:
        key = (self.sample_rate(client_id), self.planned_steps(client_id))
        if key not in self._sigmas:
            try:
                self._sigmas[key] = noise_multiplier_for(self.dp.epsilon, self.dp.delta, *key, self.dp.accountant)
            except ValueError as err:
                raise ConfigError("client.dp.epsilon", f"no noise multiplier reaches epsilon {self.dp.epsilon} "
                                  f"over {key[1]} steps at sampling rate {key[0]:.4g}: {err}") from err
        return self._sigmas[key]

    def check(self) -> None:
        """Plan the client with the largest q * sqrt(steps) (FedTT Prop. 1: sigma grows with it)."""
        hardest = max(range(len(self.sizes)), key=lambda c: self.sample_rate(c) * math.sqrt(self.planned_steps(c)))
        self.noise_multiplier(hardest)

    def client(self, client_id: int) -> ClientPrivacy:
        """What client ``client_id`` trains with this round (its accountant is the ledger's)."""
        acct = self.accountants.setdefault(client_id, make_accountant(self.dp.accountant))
        return ClientPrivacy(noise_multiplier=self.noise_multiplier(client_id),
                             sample_rate=self.sample_rate(client_id), clip_norm=self.dp.clip_norm,
                             expected_batch_size=min(self.batch_size, self.sizes[client_id]), accountant=acct,
                             noise_seed=self.dp.noise_seed)

    def epsilon(self, client_id: int) -> float:
        """Epsilon client ``client_id`` has spent so far (cached until its accountant steps again)."""
        acct = self.accountants.get(client_id)
        if acct is None:
            return 0.0
        history = tuple(tuple(h) for h in acct.history)
        cached = self._spent.get(client_id)
        if cached is None or cached[0] != history:
            cached = self._spent[client_id] = (history, accountant_epsilon(acct, self.dp.delta))
        return cached[1]

    def steps(self, client_id: int) -> int:
        """Noisy steps client ``client_id`` has taken so far."""
        acct = self.accountants.get(client_id)
        return 0 if acct is None else sum(int(h[2]) for h in acct.history)

    def report(self, client_id: int) -> dict[str, float]:
        """What the client tells the server with its reply: epsilon spent so far, its noise
        multiplier and its noisy steps so far (not private: functions of the config and its rounds)."""
        return {EPSILON: self.epsilon(client_id), NOISE_MULTIPLIER: self.noise_multiplier(client_id),
                STEPS: float(self.steps(client_id))}

    def device_state(self, client_id: int) -> State | None:
        """The client's accountant history as a (steps entries x 3) float64 tensor of (sigma, q,
        steps), for the engines' device-state hooks (None: it never trained here)."""
        acct = self.accountants.get(client_id)
        if acct is None:
            return None
        return {"history": torch.tensor([[float(x) for x in h] for h in acct.history],
                                        dtype=torch.float64).reshape(-1, 3)}

    def load_device_state(self, client_id: int, state: State | None) -> None:
        """Restore what :meth:`device_state` returned for ``client_id`` (None: forget its accountant)."""
        if state is None:
            self.accountants.pop(client_id, None)
            return
        acct = make_accountant(self.dp.accountant)
        acct.history = [(float(s), float(q), int(n)) for s, q, n in state["history"].tolist()]
        self.accountants[client_id] = acct

    def state_dict(self) -> dict[str, Any]:
        """The accountants this process keeps (every client's in the local engine and torchrun's rank 0)."""
        return {"history": {int(c): [tuple(h) for h in a.history] for c, a in self.accountants.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.accountants = {}
        for client_id, history in state.get("history", {}).items():
            acct = make_accountant(self.dp.accountant)
            acct.history = [tuple(h) for h in history]
            self.accountants[int(client_id)] = acct


def privacy_record(dp: DPConfig, reports: Mapping[int, Mapping[str, float]], previous_max: float) -> dict[str, Any]:
    """A round's ``privacy`` record, from the reports in the replies that arrived (``reports``: client
    -> reply metrics) and the run's largest epsilon before the round.

    Clients hold disjoint data, so the run's guarantee for any one example is the largest epsilon
    any client spent (parallel composition): ``max_epsilon``, the maximum over every report so far
    (a client's spending only grows).
    """
    clients = sorted(c for c, metrics in reports.items() if EPSILON in metrics)
    spent = {c: float(reports[c][EPSILON]) for c in clients}
    return {
        "delta": dp.delta,
        "target_epsilon": dp.epsilon,
        "clip_norm": dp.clip_norm,
        "epsilon": {str(c): e for c, e in spent.items()},
        "noise_multiplier": {str(c): float(reports[c][NOISE_MULTIPLIER]) for c in clients},
        "steps": {str(c): int(reports[c][STEPS]) for c in clients},
        "max_epsilon": max([previous_max, *spent.values()]),
        "noise_seeded": dp.noise_seed is not None,
    }
