"""Local DP-SGD on the client: clipping and noise by hand, exact per-sample gradients, the privacy
plan and accountant against Opacus, supported and rejected adapters, learning, resume."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from opacus.accountants import RDPAccountant
from opacus.accountants.utils import get_noise_multiplier
from opacus.grad_sample.grad_sample_module import GradSampleHooks
from torch import nn

from fedpeft.config import ClientConfig, ConfigError, DPConfig, build_config, load_config
from fedpeft.engines.local import LocalEngine
from fedpeft.engines.protocol import device_state, load_device_state
from fedpeft.experiment import Experiment, prepare
from fedpeft.federated.dp_sgd import ClientPrivacy, poisson_batches, private_optimizer, private_step
from fedpeft.federated.privacy import RDP_ORDERS, PrivacyLedger, privacy_record
from fedpeft.metrics.recorder import load_metrics, resume_fingerprint
from fedpeft.metrics.summary import summarize
from fedpeft.models.encoding import example_mean_loss, training_batch
from tests.conftest import tiny_raw_config, without_timing


def privacy(sigma: float, clip: float, expected_batch: int, noise_seed: int | None = 0) -> ClientPrivacy:
    return ClientPrivacy(noise_multiplier=sigma, sample_rate=0.5, clip_norm=clip, expected_batch_size=expected_batch,
                         accountant=RDPAccountant(), noise_seed=noise_seed)


def test_per_sample_clipping_by_hand() -> None:
    model = nn.Linear(3, 1, bias=False)
    nn.init.zeros_(model.weight)
    x = torch.tensor([[3.0, 4.0, 0.0], [0.3, 0.4, 0.0], [0.0, 0.0, 12.0], [1.0, 0.0, 0.0]])
    y = torch.tensor([1.0, -1.0, 0.5, 2.0])  # sample j's gradient is y_j x_j: norms 5, 0.5, 6, 2
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    with private_optimizer(model, optimizer, privacy(0.0, 2.0, expected_batch=8), seed=0) as dp:
        dp.zero_grad()
        (model(x).squeeze(1) * y).mean().backward()
        private_step(dp, len(x))
    # clip to C = 2: [1.2, 1.6, 0], [-0.3, -0.4, 0], [0, 0, 2], [2, 0, 0]; sum / expected batch 8
    expected = -torch.tensor([[2.9, 1.2, 2.0]]) / 8
    assert torch.allclose(model.weight.detach(), expected, atol=1e-5)
    assert not any(hasattr(model.weight, a) for a in ("grad_sample", "_forward_counter", "summed_grad"))


def test_noise_std_is_sigma_clip_over_batch() -> None:
    model = nn.Linear(100, 100, bias=False)
    nn.init.zeros_(model.weight)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    client = privacy(1.5, 2.0, expected_batch=4)
    with private_optimizer(model, optimizer, client, seed=3) as dp:
        private_step(dp, 0)  # an empty Poisson sample: pure noise N(0, sigma^2 C^2) / B
    step = model.weight.detach().flatten()
    assert abs(float(step.std()) / (1.5 * 2.0 / 4) - 1) < 0.03
    assert abs(float(step.mean())) < 0.03
    assert client.accountant.history == [(1.5, 0.5, 1)]  # the noisy step was counted


def test_noise_is_unpredictable_unless_a_seed_is_set() -> None:
    def noise(seed: int, noise_seed: int | None) -> torch.Tensor:
        model = nn.Linear(4, 4, bias=False)
        nn.init.zeros_(model.weight)
        with private_optimizer(model, torch.optim.SGD(model.parameters(), lr=1.0), privacy(1.0, 1.0, 1, noise_seed),
                               seed) as dp:
            private_step(dp, 0)
        return model.weight.detach().clone()

    assert torch.equal(noise(5, 0), noise(5, 0))
    assert not torch.equal(noise(5, 0), noise(6, 0))  # every client and round draws its own noise
    assert not torch.equal(noise(5, 0), noise(5, 1))
    assert not torch.equal(noise(5, None), noise(5, None))  # the default: OS entropy
    assert DPConfig(epsilon=1.0).noise_seed is None


def test_poisson_batches_are_seeded_with_the_right_rate() -> None:
    draws = list(poisson_batches(1000, 0.1, 50, torch.Generator().manual_seed(0)))
    again = list(poisson_batches(1000, 0.1, 50, torch.Generator().manual_seed(0)))
    assert draws == again and len(draws) == 50
    assert abs(sum(map(len, draws)) / 50 / 100 - 1) < 0.05
    assert all(len(set(b)) == len(b) and all(0 <= i < 1000 for i in b) for b in draws)


def test_plan_matches_opacus_and_spends_at_most_the_target() -> None:
    dp = DPConfig(epsilon=3.0, delta=1e-5, clip_norm=2.0, rounds=4)
    ledger = PrivacyLedger(dp, ClientConfig(batch_size=8, local_epochs=1), [40, 80])
    assert ledger.sample_rate(0) == 0.2 and ledger.planned_steps(0) == 4 * 5
    sigma = ledger.noise_multiplier(0)
    assert sigma == get_noise_multiplier(target_epsilon=3.0, target_delta=1e-5, sample_rate=0.2, steps=20,
                                         alphas=RDP_ORDERS)
    acct = RDPAccountant()
    for _ in range(20):
        acct.step(noise_multiplier=sigma, sample_rate=0.2)
    assert 3.0 - 0.011 <= acct.get_epsilon(delta=1e-5, alphas=RDP_ORDERS) <= 3.0
    assert ledger.noise_multiplier(1) < sigma  # the larger shard samples at a lower rate


def test_accountants_round_trip_as_device_state() -> None:
    """What engines move (torchrun) or keep on the node (Flower): the accountant, exactly, beside the
    method's own device state; None forgets it on this process."""
    dp = DPConfig(epsilon=3.0, clip_norm=2.0, rounds=4)
    ledger = PrivacyLedger(dp, ClientConfig(batch_size=8, local_epochs=1), [40, 80])
    client = ledger.client(1)
    for _ in range(7):
        client.accountant.step(noise_multiplier=client.noise_multiplier, sample_rate=client.sample_rate)
    client.accountant.step(noise_multiplier=2.0, sample_rate=0.5)

    class Method:
        def __init__(self) -> None:
            self.kept: dict[int, dict[str, torch.Tensor]] = {}

        def device_state(self, client_id: int) -> dict[str, torch.Tensor] | None:
            return self.kept.get(client_id)

        def load_device_state(self, client_id: int, state: dict[str, torch.Tensor] | None) -> None:
            if state is None:
                self.kept.pop(client_id, None)
            else:
                self.kept[client_id] = state

    here = SimpleNamespace(algorithm=Method(), privacy=ledger)
    here.algorithm.kept[1] = {"prompt": torch.ones(2)}
    assert device_state(here, 0) is None  # client 0 never trained here
    state = device_state(here, 1)
    assert state is not None and set(state) == {"method.prompt", "privacy.history"}
    assert state["privacy.history"].dtype == torch.float64

    there = SimpleNamespace(algorithm=Method(), privacy=PrivacyLedger(dp, ClientConfig(batch_size=8), [40, 80]))
    load_device_state(there, 1, state)
    assert there.privacy.accountants[1].history == ledger.accountants[1].history
    assert there.privacy.report(1) == ledger.report(1)
    assert ledger.report(1)["dp_steps"] == 8 and ledger.report(1)["dp_epsilon"] > 0
    assert torch.equal(there.algorithm.kept[1]["prompt"], torch.ones(2))
    load_device_state(there, 1, None)
    assert not there.privacy.accountants and not there.algorithm.kept
    assert there.privacy.report(1)["dp_epsilon"] == 0.0


def test_privacy_record_is_built_from_the_clients_reports() -> None:
    dp = DPConfig(epsilon=3.0, clip_norm=2.0, rounds=4)
    reports = {4: {"dp_epsilon": 1.5, "dp_noise_multiplier": 0.9, "dp_steps": 6.0, "steps": 3.0},
               2: {"dp_epsilon": 0.7, "dp_noise_multiplier": 1.1, "dp_steps": 3.0},
               5: {"steps": 3.0}}  # a reply without a report is left out
    record = privacy_record(dp, reports, previous_max=1.2)
    assert record == {"delta": 1e-5, "target_epsilon": 3.0, "clip_norm": 2.0, "epsilon": {"2": 0.7, "4": 1.5},
                      "noise_multiplier": {"2": 1.1, "4": 0.9}, "steps": {"2": 3, "4": 6}, "max_epsilon": 1.5,
                      "noise_seeded": False}
    assert privacy_record(dp, {}, previous_max=1.2)["max_epsilon"] == 1.2  # spending never goes back


def test_dp_config_errors_name_the_field(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    train, eval_ = toy_files
    for dp, field in [({"epsilon": 0}, "client.dp.epsilon"), ({"clip_norm": 2}, "client.dp.epsilon"),
                      ({"epsilon": 1, "delta": 1.5}, "client.dp.delta"),
                      ({"epsilon": 1, "clip_norm": -1}, "client.dp.clip_norm"),
                      ({"epsilon": 1, "accountant": "gdp"}, "client.dp.accountant"),
                      ({"epsilon": 1, "sigma": 1}, "client.dp.sigma")]:
        with pytest.raises(ConfigError) as err:
            build_config(tiny_raw_config(train, eval_, tmp_path / "run", client={"dp": dp}))
        assert err.value.field == field, dp
    cfg = build_config(tiny_raw_config(train, eval_, tmp_path / "run", rounds=7, client={"dp": {"epsilon": 1}}))
    assert cfg.client.dp is not None and cfg.client.dp.rounds == 7  # pinned: resumed runs keep their noise
    plain = build_config(tiny_raw_config(train, eval_, tmp_path / "run", rounds=7))
    assert resume_fingerprint(cfg) != resume_fingerprint(plain)  # a DP run never resumes as a plain one
    with pytest.raises(ConfigError, match="no noise multiplier") as err:  # sigma would exceed 10^6
        prepare(build_config(tiny_raw_config(train, eval_, tmp_path / "run", client={"dp": {"epsilon": 1e-7}})))
    assert err.value.field == "client.dp.epsilon"


def test_table4_example_config_validates() -> None:
    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "fedtt_dp_sst2.yaml",
                      ["client.dp.epsilon=6", "client.dp.clip_norm=5"])
    dp = cfg.client.dp
    assert cfg.method == "fedtt" and dp is not None
    assert (dp.epsilon, dp.delta, dp.clip_norm, dp.rounds) == (6, 1e-5, 5, 8)


@pytest.mark.parametrize("method", ["lora", "fedtt", "bitfit"])
def test_per_sample_gradients_equal_single_example_gradients(toy_files: tuple[Path, Path], tmp_path: Path,
                                                             method: str) -> None:
    """What Opacus's hooks (LoRA, BitFit) and functorch (TT layers) return is each example's own gradient."""
    train, eval_ = toy_files
    raw = tiny_raw_config(train, eval_, tmp_path / "run", method=method)
    raw.pop("adapter")
    assert_per_sample_gradients_are_single_example_gradients(prepare(build_config(raw)))


def assert_per_sample_gradients_are_single_example_gradients(exp: Experiment) -> None:
    """Opacus's per-sample gradients of rows 0-2 against one backward pass per row (dropout off so
    that passes agree; restored after)."""
    model, data = exp.slot.model, exp.train_data
    model.train()  # Opacus records activations in training mode only
    dropouts = [(m, m.p) for m in model.modules() if isinstance(m, nn.Dropout)]
    for module, _ in dropouts:
        module.p = 0.0
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    singles = []
    for i in range(3):
        model.zero_grad()
        example_mean_loss(model, data, training_batch(data, [i])).backward()
        singles.append({n: p.grad.clone() for n, p in params.items()})
    model.zero_grad()
    hooks = GradSampleHooks(model, batch_first=True, loss_reduction="mean", strict=True)
    example_mean_loss(model, data, training_batch(data, [0, 1, 2])).backward()
    per_sample = {n: p.grad_sample.clone() for n, p in params.items()}
    hooks.cleanup()
    model.zero_grad()
    for module, p in dropouts:
        module.p = p
    for name, samples in per_sample.items():
        for i in range(3):
            assert torch.allclose(samples[i], singles[i][name], atol=1e-5, rtol=1e-4), (name, i)


@pytest.mark.parametrize("task", ["ner", "qa"])
def test_per_token_tasks_get_exact_per_example_gradients_and_train_privately(tmp_path: Path, task: str) -> None:
    """Token classification (one loss per example, not per batch token) and extractive QA (one per
    window): Opacus's per-sample gradients are each row's own gradient, and a DP round runs."""
    from tests.test_extractive_qa import qa_raw
    from tests.test_token_classification import ner_raw

    raw = (ner_raw if task == "ner" else qa_raw)(tmp_path, "lora", rounds=1, adapter={"dropout": 0.0},
                                                   client={"local_steps": 2, "dp": {"epsilon": 3.0}})
    exp = prepare(build_config(raw))  # the probe step passed
    assert_per_sample_gradients_are_single_example_gradients(exp)
    records = LocalEngine(exp, tmp_path / "run").run()
    assert records[-1]["privacy"]["steps"] == {str(c): 2 for c in records[-1]["clients"]}
    assert 0 < records[-1]["privacy"]["max_epsilon"] < 3.0


@pytest.mark.parametrize("method,culprit", [
    ("full", "position_embeddings"), ("ia3", "ia3_l"), ("prompt_tuning", "prompt_encoder"),
    ("p_tuning_v2", "prefix_encoder")])
def test_adapters_opacus_cannot_handle_are_a_clear_error(toy_files: tuple[Path, Path], tmp_path: Path, method: str,
                                                         culprit: str) -> None:
    train, eval_ = toy_files
    raw = tiny_raw_config(train, eval_, tmp_path / "run", method=method, client={"dp": {"epsilon": 3}})
    raw.pop("adapter")
    with pytest.raises(ConfigError, match="Opacus cannot compute") as err:
        prepare(build_config(raw))
    assert err.value.field == "client.dp" and culprit in str(err.value)


def dp_raw(train: Path, eval_: Path, run_dir: Path, rounds: int, noise_seed: int | None = 0) -> dict:
    return tiny_raw_config(train, eval_, run_dir, rounds=rounds, partition={"kind": "iid", "num_clients": 2},
                           strategy={"selection": "all", "clients_per_round": None},
                           client={"local_steps": 3, "dp": {"epsilon": 3.0, "clip_norm": 2.0, "rounds": 2,
                                                            "noise_seed": noise_seed}})


def test_unseeded_runs_draw_different_noise_and_a_seeded_run_reproduces(toy_files: tuple[Path, Path],
                                                                        tmp_path: Path) -> None:
    train, eval_ = toy_files

    def final(name: str, noise_seed: int | None) -> tuple[dict[str, torch.Tensor], list[dict]]:
        engine = LocalEngine(prepare(build_config(dp_raw(train, eval_, tmp_path / name, 1, noise_seed))),
                             tmp_path / name)
        records = engine.run()
        return engine.final_state, records

    first, records = final("a", None)
    second, _ = final("b", None)
    assert any(not torch.equal(first[k], second[k]) for k in first)
    assert records[-1]["privacy"]["noise_seeded"] is False
    assert summarize(records, "accuracy")["dp_noise_seeded"] is False
    longer = dp_raw(train, eval_, tmp_path / "a", 2, None)  # an unseeded run resumes (with fresh noise)
    resumed = LocalEngine(prepare(build_config(longer)), tmp_path / "a").run(resume=True)
    assert [r["round"] for r in resumed] == [1, 2] and resumed[0] == records[0]
    with pytest.raises(ConfigError, match=r"client\.dp\.reproducible_noise: replaced by client\.dp\.noise_seed"):
        build_config(tiny_raw_config(train, eval_, tmp_path / "old", client={"dp": {"epsilon": 3.0,
                                                                                  "reproducible_noise": True}}))
    seeded, records = final("c", 7)
    again, _ = final("d", 7)
    assert all(torch.equal(seeded[k], again[k]) for k in seeded)
    assert records[-1]["privacy"]["noise_seeded"] is True


def test_reported_epsilon_is_opacus_accountants_and_resume_is_exact(toy_files: tuple[Path, Path],
                                                                   tmp_path: Path) -> None:
    train, eval_ = toy_files
    full = LocalEngine(prepare(build_config(dp_raw(train, eval_, tmp_path / "full", 2))), tmp_path / "full")
    records = full.run()
    ledger = full.exp.privacy
    assert ledger is not None
    for client in ("0", "1"):
        sigma = records[-1]["privacy"]["noise_multiplier"][client]
        own = RDPAccountant()
        for _ in range(2 * 3):  # two rounds of three noisy steps
            own.step(noise_multiplier=sigma, sample_rate=ledger.sample_rate(int(client)))
        reported = records[-1]["privacy"]["epsilon"][client]
        assert records[-1]["privacy"]["steps"][client] == 6
        assert reported == pytest.approx(own.get_epsilon(delta=1e-5, alphas=RDP_ORDERS), rel=1e-12)
        assert reported <= own.get_epsilon(delta=1e-5) + 1e-9  # Opacus's default orders: never tighter
    assert 3.0 - 0.011 <= records[-1]["privacy"]["max_epsilon"] <= 3.0  # the whole budget, and no more
    assert records[0]["privacy"]["max_epsilon"] < records[1]["privacy"]["max_epsilon"]
    assert summarize(records, "accuracy")["dp_epsilon"] == records[-1]["privacy"]["max_epsilon"]

    part = dp_raw(train, eval_, tmp_path / "part", 1)
    LocalEngine(prepare(build_config(part)), tmp_path / "part").run()
    part["rounds"] = 2
    resumed = LocalEngine(prepare(build_config(part)), tmp_path / "part")
    resumed.run(resume=True)
    assert without_timing(load_metrics(tmp_path / "part")) == without_timing(records)
    assert all(torch.equal(full.final_state[k], resumed.final_state[k]) for k in full.final_state)


def test_dp_client_still_learns_at_a_loose_epsilon(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    train, eval_ = toy_files
    raw = tiny_raw_config(train, eval_, tmp_path / "run", rounds=1, partition={"kind": "iid", "num_clients": 1},
                          strategy={"clients_per_round": 1}, evaluation={"at_start": True},
                          client={"optimizer": "adam", "lr": 0.01, "batch_size": 32, "local_steps": 60,
                                  "dp": {"epsilon": 500, "clip_norm": 1.0, "noise_seed": 0}})
    records = LocalEngine(prepare(build_config(raw)), tmp_path / "run").run()
    before, after = records[0]["eval"]["accuracy"], records[1]["eval"]["accuracy"]
    assert after >= 0.75 and after > before + 0.1, (before, after)  # chance is 0.5
    assert 490 < records[1]["privacy"]["epsilon"]["0"] <= 500


def test_token_classification_loss_is_a_mean_of_per_example_token_means() -> None:
    """transformers averages a tagging loss over the batch's tokens; DP-SGD needs one loss per example."""
    logits = torch.randn(2, 4, 3)

    class Tagger(nn.Module):
        def forward(self, **batch: torch.Tensor) -> SimpleNamespace:
            return SimpleNamespace(logits=logits)

    labels = torch.tensor([[-100, 0, 2, 1], [-100, 1, -100, -100]])  # aligned with the logits, no shift
    batch = {"input_ids": torch.zeros(2, 4, dtype=torch.long), "labels": labels}
    data = SimpleNamespace(targets=None, head="token_classification")
    logp = torch.log_softmax(logits, dim=-1)
    first = -(logp[0, 1, 0] + logp[0, 2, 2] + logp[0, 3, 1]) / 3
    second = -logp[1, 1, 1]
    assert torch.allclose(example_mean_loss(Tagger(), data, batch), (first + second) / 2)  # type: ignore[arg-type]


def test_generation_loss_is_a_mean_of_per_example_token_means() -> None:
    """DP-SGD clips per example, so no example's weight may depend on the other examples' lengths."""
    logits = torch.randn(2, 4, 5)

    class Causal(nn.Module):
        def forward(self, **batch: torch.Tensor) -> SimpleNamespace:
            return SimpleNamespace(logits=logits)

    labels = torch.tensor([[-100, 1, 2, 3], [-100, -100, 4, -100]])
    batch = {"input_ids": torch.zeros(2, 4, dtype=torch.long), "labels": labels}
    data = SimpleNamespace(targets=[[1]], head="causal_lm")
    logp = torch.log_softmax(logits, dim=-1)
    first = -(logp[0, 0, 1] + logp[0, 1, 2] + logp[0, 2, 3]) / 3  # causal: position t predicts label t + 1
    second = -logp[1, 1, 4]
    assert torch.allclose(example_mean_loss(Causal(), data, batch), (first + second) / 2)  # type: ignore[arg-type]
