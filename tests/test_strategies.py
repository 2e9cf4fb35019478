"""Strategy math against hand computation on small tensors."""

from __future__ import annotations

import math

import pytest
import torch

from fedpeft.config import StrategyConfig
from fedpeft.federated.strategy import build_strategy, weighted_mean
from fedpeft.federated.types import ClientResult


def result(cid: int, n: int, **update: list[float]) -> ClientResult:
    return ClientResult(cid, {k: torch.tensor(v) for k, v in update.items()}, n, 0.0)


def test_weighted_mean_per_key_over_senders() -> None:
    mean = weighted_mean([{"a": torch.tensor([1.0]), "b": torch.tensor([4.0])}, {"a": torch.tensor([3.0])}],
                         [1.0, 3.0])
    assert mean["a"].item() == pytest.approx((1 * 1 + 3 * 3) / 4)
    assert mean["b"].item() == pytest.approx(4.0)  # only the first client sent b


def test_fedavg_sample_weighted() -> None:
    strat = build_strategy(StrategyConfig(name="fedavg"))
    new = strat.aggregate({"w": torch.tensor([1.0, 1.0]), "z": torch.tensor([5.0])},
                          [result(0, 10, w=[1.0, 0.0]), result(1, 30, w=[-1.0, 2.0])])
    # mean delta = (10*[1,0] + 30*[-1,2]) / 40 = [-0.5, 1.5]
    assert torch.allclose(new["w"], torch.tensor([0.5, 2.5]))
    assert new["z"].item() == 5.0


@pytest.mark.parametrize("name", ["fedavg", "fedadamw"])
def test_uniform_weighting_is_the_plain_mean(name: str) -> None:
    """``weighting: uniform`` (FedTT's and FLASC's 1/N) ignores the sample counts, for any strategy."""
    uniform = build_strategy(StrategyConfig(name=name, weighting="uniform", server_lr=1.0))
    by_samples = build_strategy(StrategyConfig(name=name, weighting="samples", server_lr=1.0))
    state = {"w": torch.tensor([1.0, 1.0])}
    results = [result(0, 10, w=[1.0, 0.0]), result(1, 30, w=[-1.0, 2.0])]
    if name == "fedavg":
        assert torch.allclose(uniform.aggregate(state, results)["w"], torch.tensor([1.0, 2.0]))  # mean [0, 1]
        assert torch.allclose(by_samples.aggregate(state, results)["w"], torch.tensor([0.5, 2.5]))
    else:  # AdamW's first step moves each coordinate by lr * sign(mean delta): 0 stays put only uniformly
        assert uniform.aggregate(state, results)["w"][0].item() == pytest.approx(1.0 * (1 - 0.01), abs=1e-6)
        assert by_samples.aggregate(state, results)["w"][0].item() < 0.5


def test_fedavg_server_lr() -> None:
    strat = build_strategy(StrategyConfig(name="fedavg", server_lr=0.5))
    new = strat.aggregate({"w": torch.tensor([0.0])}, [result(0, 1, w=[2.0])])
    assert new["w"].item() == pytest.approx(1.0)


def test_fedavgm_momentum_two_rounds() -> None:
    strat = build_strategy(StrategyConfig(name="fedavgm", server_lr=1.0, server_momentum=0.5))
    s = strat.aggregate({"w": torch.tensor([0.0])}, [result(0, 1, w=[1.0])])
    assert s["w"].item() == pytest.approx(1.0)  # v = 1
    s = strat.aggregate(s, [result(0, 1, w=[1.0])])
    assert s["w"].item() == pytest.approx(1.0 + 1.5)  # v = 0.5*1 + 1


@pytest.mark.parametrize("name", ["fedadam", "fedyogi", "fedadagrad"])
def test_fedopt_two_rounds(name: str) -> None:
    b1, b2, eta, tau = 0.9, 0.99, 0.1, 1e-3
    strat = build_strategy(StrategyConfig(name=name, server_lr=eta, beta1=b1, beta2=b2, tau=tau))
    x, m, v = 0.0, 0.0, tau * tau
    state = {"w": torch.tensor([x], dtype=torch.float64)}
    for d in (0.4, -0.2):
        state = strat.aggregate(state, [result(0, 2, w=[d]), result(1, 2, w=[d])])
        m = b1 * m + (1 - b1) * d
        if name == "fedadam":
            v = b2 * v + (1 - b2) * d * d
        elif name == "fedyogi":
            v = v - (1 - b2) * d * d * math.copysign(1.0, v - d * d)
        else:
            v = v + d * d
        x = x + eta * m / (math.sqrt(v) + tau)
        assert state["w"].item() == pytest.approx(x, rel=1e-5)
    restored = build_strategy(StrategyConfig(name=name))
    restored.load_state_dict(strat.state_dict())
    assert restored.state_dict()["m"]["w"].item() == pytest.approx(m, rel=1e-5)


def test_fedprox_sends_mu() -> None:
    strat = build_strategy(StrategyConfig(name="fedprox", proximal_mu=0.1))
    assert strat.client_config() == {"proximal_mu": 0.1}
