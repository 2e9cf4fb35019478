"""Server AdamW against hand computation and torch; DP clipping, noise scale; epsilon from Opacus."""

from __future__ import annotations

import math

import pytest
import torch

from fedpeft.config import ConfigError, StrategyConfig
from fedpeft.federated.privacy import dp_epsilon, dp_fedadam_epsilon, simulated_noise_multiplier
from fedpeft.federated.strategy import build_strategy
from fedpeft.federated.strategy.fedadamw import clip_update, dp_mean
from fedpeft.federated.types import ClientResult


def result(cid: int, n: int, **update: list[float]) -> ClientResult:
    return ClientResult(cid, {k: torch.tensor(v) for k, v in update.items()}, n, 0.0)


def adamw(**extra: object):
    return build_strategy(StrategyConfig(name="fedadamw", server_lr=0.1, beta1=0.9, beta2=0.999, **extra))


def test_adamw_step_by_hand() -> None:
    strat = adamw(weight_decay=0.01)
    state = {"w": torch.tensor([1.0, -2.0])}
    # unweighted mean of deltas [0.2, 0.4] and [0.0, -0.8] despite 10 vs 30 samples: [0.1, -0.2]; grad = -mean
    new = strat.aggregate(state, [result(0, 10, w=[0.2, 0.4]), result(1, 30, w=[0.0, -0.8])])
    g = torch.tensor([-0.1, 0.2], dtype=torch.float64)
    m, v = 0.1 * g, 0.001 * g * g
    m_hat, v_hat = m / 0.1, v / 0.001
    w = torch.tensor([1.0, -2.0], dtype=torch.float64) * (1 - 0.1 * 0.01)
    expected = w - 0.1 * m_hat / (v_hat.sqrt() + 1e-8)
    assert torch.allclose(new["w"].double(), expected, atol=1e-6)
    # first step moves each coordinate by ~lr against the gradient's sign
    assert new["w"][0] > 1.0 - 0.002 and new["w"][1] < -2.0 + 0.002


def test_adamw_matches_torch_optim_over_several_steps() -> None:
    strat = adamw(weight_decay=0.01)
    torch_param = torch.nn.Parameter(torch.tensor([0.5, -1.5, 2.0]))
    opt = torch.optim.AdamW([torch_param], lr=0.1, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    state = {"w": torch_param.detach().clone()}
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        deltas = [torch.randn(3, generator=g) for _ in range(3)]
        state = strat.aggregate(state, [ClientResult(i, {"w": d}, 1 + i, 0.0) for i, d in enumerate(deltas)])
        opt.zero_grad()
        torch_param.grad = -torch.stack(deltas).mean(0)
        opt.step()
        assert torch.allclose(state["w"], torch_param.detach(), atol=1e-6)


def test_sample_weighting_option() -> None:
    strat = adamw(weighting="samples", weight_decay=0.0)
    new = strat.aggregate({"w": torch.tensor([0.0])}, [result(0, 1, w=[1.0]), result(1, 3, w=[-1.0])])
    assert new["w"].item() == pytest.approx(-0.1, abs=1e-6)  # mean = -0.5 < 0: Adam moves by -lr


def test_clip_scales_to_norm_only_when_above() -> None:
    update = {"a": torch.tensor([3.0]), "b": torch.tensor([4.0])}  # global norm 5
    clipped, norm = clip_update(update, 1.0)
    assert norm == pytest.approx(5.0)
    assert clipped["a"].item() == pytest.approx(0.6) and clipped["b"].item() == pytest.approx(0.8)
    same, _ = clip_update(update, 10.0)
    assert torch.equal(same["a"], update["a"]) and torch.equal(same["b"], update["b"])


def test_dp_mean_sum_over_c_without_noise() -> None:
    updates = [{"w": torch.tensor([3.0, 4.0])}, {"w": torch.tensor([0.1, 0.0])}]
    out = dp_mean(updates, clip_norm=1.0, noise_multiplier=0.0, generator=torch.Generator())
    # clip([3,4]) = [0.6, 0.8]; [0.1, 0] unchanged; sum / C / n
    assert torch.allclose(out["w"], torch.tensor([0.35, 0.4]))
    out = dp_mean(updates, clip_norm=0.5, noise_multiplier=0.0, generator=torch.Generator())
    assert torch.allclose(out["w"], (torch.tensor([0.3, 0.4]) + torch.tensor([0.1, 0.0])) / 0.5 / 2)


def test_dp_noise_has_std_sigma_over_n() -> None:
    zero = [{"w": torch.zeros(200_000)} for _ in range(4)]
    out = dp_mean(zero, clip_norm=0.01, noise_multiplier=2.0, generator=torch.Generator().manual_seed(0))
    assert out["w"].std().item() == pytest.approx(2.0 / 4, rel=0.01)
    assert abs(out["w"].mean().item()) < 0.01


def test_dp_strategy_is_seeded_and_validated() -> None:
    def run(seed: int) -> torch.Tensor:
        strat = adamw(dp_clip_norm=0.1, dp_noise_multiplier=1.0, noise_seed=seed)
        return strat.aggregate({"w": torch.zeros(5)}, [result(0, 1, w=[1.0] * 5)])["w"]

    assert torch.equal(run(3), run(3)) and not torch.equal(run(3), run(4))
    unseeded = adamw(dp_clip_norm=0.1, dp_noise_multiplier=1.0)  # the default: OS entropy
    first, second = (unseeded.aggregate({"w": torch.zeros(5)}, [result(0, 1, w=[1.0] * 5)])["w"] for _ in range(2))
    assert not torch.equal(first, second)
    assert unseeded.server_privacy(1, 1, 10)["noise_seeded"] is False
    assert adamw(dp_clip_norm=0.1, dp_noise_multiplier=1.0, noise_seed=3).server_privacy(1, 1, 10)["noise_seeded"]
    with pytest.raises(ConfigError, match=r"strategy\.dp_noise_multiplier"):
        adamw(dp_noise_multiplier=1.0)
    with pytest.raises(ConfigError, match=r"strategy\.weighting"):
        adamw(dp_clip_norm=1.0, weighting="samples")
    with pytest.raises(ConfigError, match=r"strategy\.weight_decay"):
        adamw(weight_decay=-1)


def test_epsilon_matches_opacus_reference_values() -> None:
    # opacus/tests/accountants_test.py: sigma 1.5, q 0.04, 90 epochs, delta 1e-5 -> 7.32911117143
    assert dp_epsilon(1.5, 0.04, int(90 / 0.04), 1e-5) == pytest.approx(7.32911117143, rel=1e-9)
    assert dp_epsilon(0.0, 0.1, 10, 1e-5) == math.inf
    assert dp_epsilon(1.0, 0.1, 0, 1e-5) == 0.0
    prv = dp_epsilon(1.5, 0.04, int(90 / 0.04), 1e-5, accountant="prv")
    assert 5.0 < prv < 7.33  # PRV is tighter than RDP


def test_simulated_cohort_scales_noise_and_rate() -> None:
    assert simulated_noise_multiplier(0.072, 10, 1000) == pytest.approx(7.2)
    eps = dp_fedadam_epsilon(0.072, cohort=10, population=100_000, rounds=200, delta=1e-6, simulated_cohort=1000)
    assert eps == pytest.approx(dp_epsilon(7.2, 0.01, 200, 1e-6))
    # more noise, fewer rounds -> smaller epsilon
    assert dp_fedadam_epsilon(0.58, 10, 100_000, 200, 1e-6, 1000) < eps
    with pytest.raises(ValueError, match="exceeds"):
        dp_fedadam_epsilon(1.0, 10, 50, 5, 1e-5, simulated_cohort=100)
