"""``client.logit_adjustment``: the logit-adjusted loss on a client's own label prior, its exact maths,
where it is refused, and a run through the engine that learns with it."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from fedpeft.config import ConfigError, build_config
from fedpeft.experiment import prepare
from fedpeft.federated.client import logit_adjusted_loss
from tests.conftest import tiny_raw_config
from tests.test_engine import run


class FixedLogits(nn.Module):
    """Returns the same logits whatever the inputs; they are a parameter, so the loss has a gradient."""

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.logits = nn.Parameter(logits.clone())

    def forward(self, **inputs: torch.Tensor) -> SimpleNamespace:
        assert "labels" not in inputs  # the model's own loss is not computed
        return SimpleNamespace(logits=self.logits)


def test_loss_is_the_cross_entropy_of_logits_plus_tau_log_smoothed_prior() -> None:
    logits = torch.tensor([[0.3, -1.2, 0.5], [2.0, 0.1, -0.4]])
    labels = torch.tensor([0, 2])
    counts = np.array([5, 1])  # class 2 never seen on this client: its count is 0, smoothed to 1
    tau = 0.7
    prior = [(5 + 1) / (6 + 3), (1 + 1) / (6 + 3), (0 + 1) / (6 + 3)]
    expected = 0.0
    for row, label in zip(logits.tolist(), labels.tolist()):
        adjusted = [z + tau * math.log(p) for z, p in zip(row, prior)]
        expected += -(adjusted[label] - math.log(sum(math.exp(a) for a in adjusted)))
    loss = logit_adjusted_loss(FixedLogits(logits), {"input_ids": torch.zeros(2, 1), "labels": labels}, counts, tau)
    assert loss.item() == pytest.approx(expected / 2, abs=1e-6)
    plain = logit_adjusted_loss(FixedLogits(logits), {"labels": labels}, counts, 0.0)
    assert plain.item() == pytest.approx(nn.functional.cross_entropy(logits, labels).item(), abs=1e-7)


def test_a_one_class_client_barely_pushes_its_class() -> None:
    """99 examples of class 0 and none of class 1: plain cross-entropy pulls class 0's logit up at full
    strength; adjusted by the prior (log 100/101 against log 1/101), the pull is about 1/100 of it."""
    logits, labels = torch.zeros(4, 2), torch.zeros(4, dtype=torch.long)
    grads = []
    for tau in (0.0, 1.0):
        model = FixedLogits(logits)
        logit_adjusted_loss(model, {"labels": labels}, np.array([99]), tau).backward()
        grads.append(model.logits.grad[:, 0].abs().mean().item())
    assert grads[0] == pytest.approx(0.125)  # (1 - softmax 0.5) / 4 examples
    assert grads[1] == pytest.approx(0.25 * (1 / 101), rel=1e-5)


def test_refused_with_dp_and_off_a_classifier(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        build_config({"client": {"logit_adjustment": 1.0, "dp": {"epsilon": 8.0}}})
    assert info.value.field == "client.logit_adjustment" and "DP-SGD" in str(info.value)
    values = tmp_path / "values.csv"
    values.write_text("text,label\n" + "".join(f"good movie {i},{i / 10}\n" for i in range(20)))
    raw = tiny_raw_config(values, values, tmp_path / "run", client={"logit_adjustment": 1.0})
    raw["task"]["problem_type"] = "regression"
    with pytest.raises(ConfigError) as info:
        prepare(build_config(raw))
    assert info.value.field == "client.logit_adjustment" and "regression" in str(info.value)


def test_a_run_trains_through_it(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    """End to end through the engine (every client's loss is the adjusted one): the tiny model learns the
    separable toy task as with its own loss. That it lifts label-skewed clients is measured on real data,
    where a tiny random model's skewed runs learn nothing either way (benchmarks/first_run_adjusted.yaml)."""
    train, eval_ = toy_files
    raw = tiny_raw_config(train, eval_, tmp_path / "run", rounds=10,
                          client={"local_epochs": 2, "logit_adjustment": 1.0})
    _, records = run(raw)
    accuracies = [r["eval"]["accuracy"] for r in records]
    assert records[-1]["train_loss"] < 0.8 * records[0]["train_loss"]
    assert max(accuracies[-3:]) >= 0.75, accuracies
