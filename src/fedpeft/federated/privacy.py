"""Privacy budget of DP-FedAdam (client-level DP), from Opacus's maintained accountants.

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

from typing import Literal

from opacus.accountants import PRVAccountant, RDPAccountant

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
    acct = RDPAccountant() if accountant == "rdp" else PRVAccountant()
    for _ in range(rounds):  # the accountant merges identical consecutive steps, so this is cheap
        acct.step(noise_multiplier=noise_multiplier, sample_rate=sample_rate)
    if accountant == "prv":
        return float(acct.get_epsilon(delta=delta))
    return float(acct.get_epsilon(delta=delta, alphas=RDP_ORDERS))


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
