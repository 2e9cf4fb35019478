"""FedAdamW: the server steps ``torch.optim.AdamW`` on the averaged pseudo-gradient; optional DP-FedAdam.

This is the server of FLASC's released code (imkevinkuo/flasc, ``train_sparse_lora_dp.py``), which
the paper calls FedAdam (App. A): the pseudo-gradient is ``g = -mean_i(delta_i)`` (our deltas are
local minus start), and AdamW with bias correction, ``eps`` and *decoupled* weight decay steps the
dense global weights. It differs from :mod:`fedadam` (Reddi et al.: no bias correction, ``tau``).

* ``weighting`` (a common strategy field): ``uniform`` (this strategy's default) is the released
  code's plain mean over the sampled clients, sparse updates counting their zeros; ``samples``
  weighs by ``num_samples``. ``robust`` aggregation applies as for every strategy (not together with DP).
* ``weight_decay`` (0.01, torch's AdamW default), ``eps`` (1e-8); ``server_lr``, ``beta1``,
  ``beta2`` come from the strategy section.

DP-FedAdam (paper Sec. 4.5, server-side client-level DP, after Charles et al.): when
``dp_clip_norm`` C > 0, every client update is scaled to L2 norm at most C (all its tensors as one
vector), the clipped updates are summed, divided by C, Gaussian noise N(0, sigma^2) with
``sigma = dp_noise_multiplier`` is added to every coordinate, and the result divided by the number
of clients is the pseudo-gradient (exactly the released code's order). The noise is drawn from OS
entropy unless ``noise_seed`` is set, which seeds it by ``(noise_seed, server step)`` so that a
simulation resumes bit-identically; a known seed lets anyone subtract the noise, so it is for
experiments only.
The privacy budget (:meth:`FedAdamW.server_privacy`, logged every round as ``server_privacy`` and
in ``summary.json`` as ``server_dp_epsilon``) is computed by :mod:`fedpeft.federated.privacy` at
``dp_delta`` (1e-5), for the run's cohort or, with ``dp_simulated_cohort``, for a simulated one.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fedpeft.config import ConfigError
from fedpeft.federated.strategy.base import Strategy, register_strategy
from fedpeft.federated.strategy.robust import robust_delta
from fedpeft.federated.types import ClientResult, State
from fedpeft.seeding import derive_seed


class FedAdamWOptions(BaseModel):
    """The strategy-section fields FedAdamW reads beyond the common ones."""

    model_config = ConfigDict(extra="ignore")

    weight_decay: float = Field(0.01, ge=0)
    eps: float = Field(1e-8, gt=0)
    dp_delta: float = Field(1e-5, gt=0, lt=1)
    dp_simulated_cohort: int | None = Field(None, gt=0)
    dp_clip_norm: float = Field(0.0, ge=0)
    dp_noise_multiplier: float = Field(0.0, ge=0)
    noise_seed: int | None = None


def validate_options(model: type[BaseModel], extra: dict[str, Any], section: str) -> Any:
    """Validate a component's extra config fields; errors name ``section.<field>``."""
    try:
        return model.model_validate(extra)
    except ValidationError as err:
        first = err.errors()[0]
        field = ".".join(str(p) for p in first["loc"])
        raise ConfigError(f"{section}.{field}", f"{first['msg']} (got {first.get('input')!r})") from None


def clip_update(update: State, clip_norm: float) -> tuple[State, float]:
    """Scale ``update`` so its global L2 norm is at most ``clip_norm``; returns it and the original norm."""
    norm = float(torch.sqrt(sum((v.to(torch.float64) ** 2).sum() for v in update.values())))
    divisor = max(norm / clip_norm, 1.0)
    return {k: v / divisor for k, v in update.items()}, norm


def dp_mean(updates: Sequence[State], clip_norm: float, noise_multiplier: float,
            generator: torch.Generator) -> State:
    """``(sum_i clip(u_i) / C + N(0, sigma^2 I)) / n``: the DP-FedAdam pseudo-gradient (negated)."""
    total: State = {}
    for update in updates:
        clipped, _ = clip_update(update, clip_norm)
        for key, value in clipped.items():
            total[key] = total[key] + value if key in total else value.to(torch.float32).clone()
    n = len(updates)
    out = {}
    for key in sorted(total):
        noisy = total[key] / clip_norm
        if noise_multiplier > 0:
            noisy = noisy + noise_multiplier * torch.randn(noisy.shape, generator=generator)
        out[key] = noisy / n
    return out


def adamw_step(param: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: int, lr: float,
               beta1: float, beta2: float, eps: float, weight_decay: float
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One ``torch.optim.AdamW`` step (step counts from 1); returns the new param, m and v."""
    param = param * (1 - lr * weight_decay)
    m = beta1 * m + (1 - beta1) * grad
    v = beta2 * v + (1 - beta2) * grad * grad
    bias1 = 1 - beta1**step
    bias2 = 1 - beta2**step
    denom = v.sqrt() / bias2**0.5 + eps
    return param - (lr / bias1) * m / denom, m, v


@register_strategy
class FedAdamW(Strategy):
    name = "fedadamw"
    default_weighting = "uniform"
    strategy_options = (FedAdamWOptions,)
    optimizer_fields = frozenset({"beta1", "beta2"})

    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg)
        self.options: FedAdamWOptions = validate_options(FedAdamWOptions, cfg.model_extra or {}, "strategy")
        if self.dp and self.weighting != "uniform":
            raise ConfigError("strategy.weighting", "DP-FedAdam needs uniform weighting (sensitivity is per client)")
        if self.dp and cfg.robust != "none":
            raise ConfigError("strategy.robust", "DP-FedAdam clips every update itself; use robust: none with it")
        if self.options.dp_noise_multiplier > 0 and not self.dp:
            raise ConfigError("strategy.dp_noise_multiplier", "noise needs a clipping norm: set strategy.dp_clip_norm")
        self.m: State = {}
        self.v: State = {}
        self.steps = 0
        self.last_norms: list[float] = []

    @property
    def dp(self) -> bool:
        return self.options.dp_clip_norm > 0

    def aggregate(self, global_state: State, results: Sequence[ClientResult]) -> State:
        updates = [r.update for r in results]
        self.last_norms = [clip_update(u, 1.0)[1] for u in updates]
        if self.dp:
            seed = self.options.noise_seed
            seed = secrets.randbits(62) if seed is None else derive_seed(seed, "dp_noise", self.steps + 1)
            delta = dp_mean(updates, self.options.dp_clip_norm, self.options.dp_noise_multiplier,
                            torch.Generator().manual_seed(seed))
        else:  # strategy.robust (clip, median, trimmed mean) or the plain mean
            delta = robust_delta(self.cfg, results, self.weighting)
        return self.step(global_state, delta)

    def server_privacy(self, rounds: int, cohort: int, population: int) -> dict[str, Any] | None:
        """DP-FedAdam's client-level (epsilon, delta) after ``rounds`` rounds, and this round's update norms."""
        if not self.dp:
            return None
        # imported here: the accountant pulls in Opacus (seconds), and every config validation builds the
        # strategy (ExperimentConfig._strategy_fields), most of them without DP
        from fedpeft.federated.privacy import dp_fedadam_epsilon

        o = self.options
        if (o.dp_simulated_cohort or cohort) > population:
            raise ConfigError("strategy.dp_simulated_cohort", f"a cohort of {o.dp_simulated_cohort or cohort} exceeds "
                              f"the {population} clients of partition.num_clients (epsilon assumes the cohort is "
                              "sampled from them; a simulated cohort only moves the reported epsilon, so at most "
                              "the population)")
        return {"epsilon": dp_fedadam_epsilon(o.dp_noise_multiplier, cohort, population, rounds, o.dp_delta,
                                              o.dp_simulated_cohort),
                "delta": o.dp_delta, "noise_multiplier": o.dp_noise_multiplier, "clip_norm": o.dp_clip_norm,
                "simulated_cohort": o.dp_simulated_cohort, "update_norms": list(self.last_norms),
                "noise_seeded": o.noise_seed is not None}

    def step(self, global_state: State, delta: State) -> State:
        """AdamW on ``grad = -delta`` for the keys in ``delta``; the other keys are left alone."""
        self.steps += 1
        o = self.options
        new_state = dict(global_state)
        for key, d in delta.items():
            grad = -d.to(torch.float32)
            m = self.m.get(key, torch.zeros_like(grad))
            v = self.v.get(key, torch.zeros_like(grad))
            new_state[key], self.m[key], self.v[key] = adamw_step(
                global_state[key], grad, m, v, self.steps, self.cfg.server_lr, self.cfg.beta1, self.cfg.beta2,
                o.eps, o.weight_decay)
        return new_state

    def state_dict(self) -> dict[str, Any]:
        return {"m": {k: t.clone() for k, t in self.m.items()}, "v": {k: t.clone() for k, t in self.v.items()},
                "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.m = {k: t.clone() for k, t in state.get("m", {}).items()}
        self.v = {k: t.clone() for k, t in state.get("v", {}).items()}
        self.steps = int(state.get("steps", 0))
