"""FFA-LoRA, RoLoRA, HetLoRA: what is trained and sent, the slicing/padding math, and that each learns."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from fedpeft.config import ConfigError, build_config
from fedpeft.engines.local import LocalEngine, run_client
from fedpeft.experiment import Experiment, prepare
from fedpeft.federated.types import ClientResult
from fedpeft.methods.federa import lora_matrix
from fedpeft.methods.hetlora import default_tiers, pad_lora, slice_lora
from fedpeft.methods.rolora import trained_matrix
from tests.conftest import tiny_raw_config

LORA = {"kind": "lora", "r": 4, "alpha": 8}
FEDAVG = {"name": "fedavg", "clients_per_round": 2, "server_lr": 1.0}


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny models run far faster on one thread on a shared machine; restore the count afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def raw_for(method: str, toy: tuple[Path, Path], run_dir: Path, **sections: object) -> dict:
    train, eval_ = toy
    adapter = {**LORA, "kind": "ffa_lora"} if method == "ffa_lora" else LORA
    return tiny_raw_config(train, eval_, run_dir, method=method, **{"adapter": adapter, "strategy": FEDAVG,
                                                                    **sections})


def keys_of(exp: Experiment, kind: str | None) -> set[str]:
    return {k for k in exp.slot.trainable if lora_matrix(k) == kind}


def assert_learns(records: list[dict]) -> None:
    losses = [r["train_loss"] for r in records]
    assert sum(losses[-3:]) / 3 < 0.85 * losses[0], losses


# --- FFA-LoRA --------------------------------------------------------------------------------------

def test_ffa_lora_never_changes_or_sends_a_and_learns(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    raw = raw_for("ffa_lora", toy_files, tmp_path / "run", rounds=8, client={"local_epochs": 2, "lr": 0.03})
    exp = prepare(build_config(raw))
    a_names = [n for n in exp.slot.params if ".lora_A." in n]
    assert len(a_names) == 4 and not keys_of(exp, "A") and len(keys_of(exp, "B")) == 4
    a_before = {n: exp.slot.params[n].detach().clone() for n in a_names}
    engine = LocalEngine(exp, tmp_path / "run")
    records = engine.run()
    assert_learns(records)
    assert all(torch.equal(exp.slot.params[n], a_before[n]) for n in a_names)  # A frozen throughout
    assert not any(lora_matrix(k) == "A" for k in engine.final_state)  # A is not in the exchanged state
    expected = len(exp.up_codec.encode(exp.initial_state))  # B + head only
    assert all(r["bytes_up"] == [expected] * 2 and r["bytes_down"] == [expected] * 2 for r in records)
    b_and_head = sum(t.numel() for t in exp.initial_state.values())
    a_numel = sum(t.numel() for t in a_before.values())
    assert exp.trainable_params == b_and_head and a_numel > 0


def test_ffa_lora_rejects_svd_init(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    raw = raw_for("ffa_lora", toy_files, tmp_path / "run", adapter={**LORA, "kind": "ffa_lora", "init": "svd"})
    with pytest.raises(ConfigError, match=r"adapter\.init"):
        prepare(build_config(raw))


# --- RoLoRA ----------------------------------------------------------------------------------------

def test_rolora_alternation_order() -> None:
    assert [trained_matrix(t, "B") for t in (1, 2, 3, 4)] == ["B", "A", "B", "A"]
    assert [trained_matrix(t, "A") for t in (1, 2, 3)] == ["A", "B", "A"]


def test_rolora_sends_only_the_matrix_it_trained(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    raw = raw_for("rolora", toy_files, tmp_path / "run", client={"lr": 0.02})
    exp = prepare(build_config(raw))
    head = keys_of(exp, None)
    state = dict(exp.initial_state)
    for round_idx, active in ((1, "B"), (2, "A")):
        task = exp.algorithm.configure_train(round_idx, [0], state)[0]
        assert set(task.payload) == set(exp.slot.trainable)  # stateless client: it needs both matrices
        client = run_client(exp, task, round_idx, False)
        assert set(client.result.update) == keys_of(exp, active) | head
        assert client.bytes_up == len(exp.up_codec.encode({k: state[k] for k in client.result.update}))
        frozen = "A" if active == "B" else "B"
        for key in keys_of(exp, frozen):  # the frozen matrix did not move on the client
            assert torch.equal(exp.slot.params[key], state[key])
        state = exp.algorithm.aggregate(round_idx, state, [client.result])


def test_rolora_learns_and_logs_alternation(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    raw = raw_for("rolora", toy_files, tmp_path / "run", rounds=8, client={"local_epochs": 2, "lr": 0.02})
    records = LocalEngine(prepare(build_config(raw)), tmp_path / "run").run()
    assert_learns(records)
    assert [r["method"]["trained_matrix"] for r in records] == ["B", "A"] * 4
    for record in records:  # the global copy of the frozen matrix never moves
        frozen = "A" if record["method"]["trained_matrix"] == "B" else "B"
        assert record["method"][f"magnitude_variation_{frozen}"] == 0.0
    assert records[0]["bytes_up"][0] < records[0]["bytes_down"][0]


def test_rolora_rejects_unknown_first_matrix(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    raw = raw_for("rolora", toy_files, tmp_path / "run", strategy={**FEDAVG, "rolora_first": "C"})
    with pytest.raises(ConfigError, match=r"strategy\.rolora_first"):
        prepare(build_config(raw))


# --- HetLoRA ---------------------------------------------------------------------------------------

A_KEY, B_KEY = "x.q.lora_A.default.weight", "x.q.lora_B.default.weight"


def test_hetlora_slicing_and_zero_padding() -> None:
    state = {A_KEY: torch.arange(12.0).reshape(3, 4), B_KEY: torch.arange(15.0).reshape(5, 3),
             "classifier.bias": torch.ones(2)}
    sliced = slice_lora(state, 2)
    torch.testing.assert_close(sliced[A_KEY], state[A_KEY][:2])  # uppermost rows of A
    torch.testing.assert_close(sliced[B_KEY], state[B_KEY][:, :2])  # leftmost columns of B
    assert sliced["classifier.bias"] is state["classifier.bias"]
    padded = pad_lora(sliced, {k: v.shape for k, v in state.items()})
    assert torch.equal(padded[A_KEY][:2], state[A_KEY][:2]) and not padded[A_KEY][2:].any()
    assert torch.equal(padded[B_KEY][:, :2], state[B_KEY][:, :2]) and not padded[B_KEY][:, 2:].any()
    assert default_tiers(16) == [1, 4, 16] and default_tiers(8) == [1, 4, 8] and default_tiers(1) == [1]


def test_hetlora_aggregates_zero_padded_updates(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    raw = raw_for("hetlora", toy_files, tmp_path / "run", strategy={**FEDAVG, "rank_tiers": [1, 4]})
    exp = prepare(build_config(raw))
    state = dict(exp.initial_state)
    a_key = sorted(keys_of(exp, "A"))[0]
    b_key = sorted(keys_of(exp, "B"))[0]
    small = {a_key: torch.ones(1, 32), b_key: torch.ones(32, 1)}  # rank-1 client, 1 sample
    large = {a_key: 2 * torch.ones(4, 32), b_key: 2 * torch.ones(32, 4)}  # rank-4 client, 3 samples
    new = exp.algorithm.aggregate(1, state, [ClientResult(0, small, 1, 0.0), ClientResult(1, large, 3, 0.0)])
    expected_a = torch.full((4, 32), 1.5)  # rows 1..3: (1 * 0 + 3 * 2) / 4
    expected_a[0] = 1.75  # row 0: (1 * 1 + 3 * 2) / 4
    torch.testing.assert_close(new[a_key] - state[a_key], expected_a)
    torch.testing.assert_close(new[b_key] - state[b_key], expected_a.T)


def test_hetlora_client_trains_and_sends_only_its_slice(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    raw = raw_for("hetlora", toy_files, tmp_path / "run",
                  strategy={**FEDAVG, "rank_tiers": [1, 4], "rank_assignment": "modulo"})
    exp = prepare(build_config(raw))
    assert exp.algorithm.client_ranks == [1, 4, 1, 4]
    # a non-zero global B, so that the rank-1 client's slice really is a slice of something
    state = {k: v + 0.1 if lora_matrix(k) == "B" else v for k, v in exp.initial_state.items()}
    task = exp.algorithm.configure_train(1, [0], state)[0]
    assert all(task.payload[k].shape[0] == 1 for k in keys_of(exp, "A"))
    client = run_client(exp, task, 1, False)
    for key in keys_of(exp, "A"):
        assert client.result.update[key].shape == (1, 32)
        assert client.result.update[key].abs().sum() > 0
        assert not exp.slot.params[key][1:].any()  # the padding stayed zero while training
    for key in keys_of(exp, "B"):
        assert client.result.update[key].shape == (32, 1)
        assert not exp.slot.params[key][:, 1:].any()
    full_task = exp.algorithm.configure_train(1, [1], state)[0]
    assert client.bytes_down < len(exp.down_codec.encode(full_task.payload))


def test_hetlora_learns(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    raw = raw_for("hetlora", toy_files, tmp_path / "run", rounds=8, client={"local_epochs": 2, "lr": 0.01},
                  strategy={**FEDAVG, "rank_tiers": [1, 2, 4]})
    records = LocalEngine(prepare(build_config(raw)), tmp_path / "run").run()
    assert_learns(records)
    assert all(rank in (1, 2, 4) for r in records for rank in r["method"]["client_ranks"])


def test_hetlora_rejects_tiers_above_rank(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    raw = raw_for("hetlora", toy_files, tmp_path / "run", strategy={**FEDAVG, "rank_tiers": [1, 16]})
    with pytest.raises(ConfigError, match=r"strategy\.rank_tiers"):
        prepare(build_config(raw))


def test_hetlora_refuses_packed_messages_below_the_top_tier(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    raw = raw_for("hetlora", toy_files, tmp_path / "run", strategy={**FEDAVG, "rank_tiers": [1, 4]},
                  codec={"up": {"pack": True}})
    with pytest.raises(ConfigError, match=r"codec\.up\.pack: hetlora sends rank-1 slices"):
        prepare(build_config(raw))
    raw["strategy"]["rank_tiers"] = [4]  # whole LoRA matrices: packing applies
    prepare(build_config(raw))


def test_hetlora_refuses_the_svd_init_below_the_top_tier(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    raw = raw_for("hetlora", toy_files, tmp_path / "run", adapter={**LORA, "init": "svd"},
                  strategy={**FEDAVG, "rank_tiers": [1, 4]})
    with pytest.raises(ConfigError, match=r"adapter\.init: svd .*rank-1 slices"):
        prepare(build_config(raw))
    raw["strategy"]["rank_tiers"] = [4]  # every client holds the whole LoRA: nothing is cut
    prepare(build_config(raw))


def test_hetlora_released_preset_is_the_released_script(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    """train_sparse_lora_het.py: tiers by client id mod 3, sum of zero-padded deltas / n into torch AdamW
    (its learning rates are the recipe's paper_values; the defaults are short-run ones)."""
    cfg = build_config({"method": "hetlora_released", "paper_defaults": True})
    assert (cfg.strategy.name, cfg.strategy.weighting, cfg.strategy.server_lr) == ("fedadamw", "uniform", 0.005)
    assert (cfg.strategy.beta1, cfg.strategy.beta2, cfg.strategy.model_extra["weight_decay"]) == (0.9, 0.999, 0.01)
    assert (cfg.adapter.r, cfg.adapter.lora_alpha, cfg.adapter.dropout) == (16, 16.0, 0.1)
    train, eval_ = toy_files
    raw = tiny_raw_config(train, eval_, tmp_path / "run", method="hetlora_released", paper_defaults=True, adapter=LORA,
                          strategy={"name": "fedadamw", "clients_per_round": 2, "rank_tiers": [1, 4]})
    exp = prepare(build_config(raw))
    assert exp.algorithm.client_ranks == [1, 4, 1, 4]
    state = dict(exp.initial_state)
    a_key = sorted(keys_of(exp, "A"))[0]
    small = {a_key: torch.full((1, 32), 0.3)}  # rank-1 client, 1 sample
    large = {a_key: torch.full((4, 32), -0.1)}  # rank-4 client, 3 samples: weights ignored
    new = exp.algorithm.aggregate(1, state, [ClientResult(0, small, 1, 0.0), ClientResult(1, large, 3, 0.0)])
    param = torch.nn.Parameter(state[a_key].clone())
    optimizer = torch.optim.AdamW([param], lr=0.005)  # torch defaults: betas 0.9/0.999, eps 1e-8, wd 0.01
    mean = torch.zeros(4, 32)
    mean[0] += 0.3
    mean += torch.full((4, 32), -0.1)
    param.grad = -(mean / 2)  # the released code: aggregate of (start - local) / server_batch
    optimizer.step()
    torch.testing.assert_close(new[a_key], param.detach())
