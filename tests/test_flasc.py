"""FLASC (Alg. 1) and its sparsity baselines: exact math on small tensors, then tiny end-to-end runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fedpeft.config import ConfigError, DirectionCodecConfig, build_config
from fedpeft.engines.local import LocalEngine, run_client
from fedpeft.experiment import prepare
from fedpeft.federated.codec import build_codec
from fedpeft.federated.sparse_codec import apply_masks, keep_count, topk_sparsify
from fedpeft.federated.types import ClientResult
from fedpeft.methods.federa import lora_matrix
from fedpeft.methods.flasc import (
    group_fractions,
    lora_partner,
    magnitude_prune,
    rank_masks,
    scheduled_density,
    weight_scores,
)
from fedpeft.metrics.summary import summarize
from tests.conftest import tiny_raw_config


def flasc_raw(train: Path, eval_: Path, run_dir: Path, method: str = "flasc", **strategy: object) -> dict:
    return tiny_raw_config(
        train, eval_, run_dir, method=method, rounds=2,
        adapter={"kind": "lora", "r": 4, "alpha": 8, "dropout": 0.0, "init": "kaiming"},
        client={"optimizer": "sgd", "lr": 0.05, "momentum": 0.9, "batch_size": 8, "local_epochs": 1},
        strategy={"name": "fedadamw", "server_lr": 0.05, "clients_per_round": 2, **strategy})


def test_density_schedule_is_the_released_step_decay() -> None:
    assert [scheduled_density(0.25, 0.5, 2, t) for t in range(1, 6)] == [0.25, 0.25, 0.125, 0.125, 0.0625]
    assert scheduled_density(0.25, 1.0, 1, 100) == 0.25


def test_magnitude_prune_is_nested_and_keeps_the_largest() -> None:
    state = {"a": torch.tensor([5.0, -0.1, 3.0, 0.2]), "b": torch.tensor([-4.0, 1.0, 0.0, 2.0])}
    alive = {"a": torch.tensor([True, True, True, True]), "b": torch.tensor([True, True, False, True])}
    kept = magnitude_prune(state, alive, 0.5)  # 7 alive -> keep floor(3.5) = 3: 5, -4, 3
    assert kept["a"].tolist() == [True, False, True, False] and kept["b"].tolist() == [True, False, False, False]
    again = magnitude_prune({"a": torch.ones(4) * 9, "b": torch.ones(4) * 9}, kept, 0.34)  # 3 -> 1, inside kept
    assert int(sum(m.sum() for m in again.values())) == 1 and again["a"][0]


@pytest.fixture
def flasc_exp(toy_files: tuple[Path, Path], tmp_path: Path):
    train, eval_ = toy_files
    return prepare(build_config(flasc_raw(train, eval_, tmp_path / "run", down_density=0.25, up_density=0.125)))


def test_client_starts_from_masked_server_weights_and_trains_every_entry(flasc_exp) -> None:
    exp = flasc_exp
    algo = exp.algorithm
    dense = {k: v.clone() for k, v in algo.dense.items()}
    tasks = algo.configure_train(1, [0, 1], exp.initial_state)
    masked = topk_sparsify(dense, 0.25)
    for key, value in tasks[0].payload.items():
        assert torch.equal(value, masked[key]), key
    numel = sum(v.numel() for v in dense.values())
    assert sum(int((v != 0).sum()) for v in tasks[0].payload.values()) == int(0.25 * numel)
    # train with a dense upload to see every entry move, masked-out ones included
    tasks[0].config["up_density"] = 1.0
    run = run_client(exp, tasks[0], 1, False)
    update = run.result.update
    zero_at_start = {k: masked[k] == 0 for k in masked}
    moved_outside_mask = sum(int(((update[k] != 0) & zero_at_start[k]).sum()) for k in update)
    assert moved_outside_mask > 0.5 * sum(int(z.sum()) for z in zero_at_start.values())
    # lora_B is all zeros at init (never downloaded) but trains anyway
    b_keys = [k for k in update if "lora_B" in k]
    assert b_keys and all(not masked[k].any() for k in b_keys) and any(update[k].abs().sum() > 0 for k in b_keys)


def test_upload_is_topk_of_the_dense_update_without_error_feedback(flasc_exp) -> None:
    exp = flasc_exp
    task = exp.algorithm.configure_train(1, [0], exp.initial_state)[0]
    dense_task = exp.algorithm.configure_train(1, [0], exp.initial_state)[0]
    dense_task.config["up_density"] = 1.0
    dense_update = run_client(exp, dense_task, 1, False).result.update
    sparse_first = run_client(exp, task, 1, False).result.update
    expected = topk_sparsify(dense_update, 0.125)
    for key in expected:
        assert torch.allclose(sparse_first[key], expected[key], atol=1e-7), key
    n = sum(v.numel() for v in dense_update.values())
    assert sum(int((v != 0).sum()) for v in sparse_first.values()) == int(0.125 * n)
    # no error feedback: sending the same task again gives the same update (nothing dropped is carried over)
    task_again = exp.algorithm.configure_train(1, [0], exp.initial_state)[0]
    sparse_second = run_client(exp, task_again, 1, False).result.update
    assert all(torch.equal(sparse_second[k], sparse_first[k]) for k in sparse_first)


def test_server_steps_the_dense_weights_with_adamw(flasc_exp) -> None:
    algo = flasc_exp.algorithm
    dense = {k: v.clone() for k, v in algo.dense.items()}
    key = sorted(dense)[0]
    updates = [{k: torch.zeros_like(v) for k, v in dense.items()} for _ in range(2)]
    updates[0][key].view(-1)[0] = 0.3  # mean over 2 clients: 0.15 on one entry, 0 elsewhere
    results = [ClientResult(i, u, 10 * (i + 1), 0.0) for i, u in enumerate(updates)]
    public = algo.aggregate(1, flasc_exp.initial_state, results)
    lr, wd = 0.05, 0.01
    # AdamW's first step: w(1 - lr wd) - lr * sign(-g) for g != 0; g = 0 entries only decay
    first = dense[key].view(-1)[0]
    assert algo.dense[key].view(-1)[0].item() == pytest.approx(float(first * (1 - lr * wd) + lr), abs=1e-6)
    other = sorted(dense)[1]
    assert torch.allclose(algo.dense[other], dense[other] * (1 - lr * wd))
    # what is returned (evaluated, deployed) is the next round's download: the top 25% of the new dense weights
    assert all(torch.equal(public[k], topk_sparsify(algo.dense, 0.25)[k]) for k in public)


def test_freezing_baselines_train_only_the_received_entries(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    train, eval_ = toy_files
    exp = prepare(build_config(flasc_raw(train, eval_, tmp_path / "fs", method="federated_select",
                                         down_density=0.25)))
    task = exp.algorithm.configure_train(1, [0], exp.initial_state)[0]
    assert task.config["train_received_only"]
    received = {k: v != 0 for k, v in task.payload.items()}
    update = run_client(exp, task, 1, False).result.update
    assert all(not (update[k][~received[k]] != 0).any() for k in update)
    assert sum(int((update[k] != 0).sum()) for k in update) > 0


def test_sparse_adapter_prunes_once_after_the_dense_round(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    train, eval_ = toy_files
    raw = flasc_raw(train, eval_, tmp_path / "sa", method="sparse_adapter", down_density=0.25)
    raw["rounds"] = 3
    exp = prepare(build_config(raw))
    records = LocalEngine(exp, tmp_path / "sa").run()
    # resuming after the pruning round restores the mask and the server's AdamW moments exactly
    part = dict(raw, rounds=2, output={"run_dir": str(tmp_path / "part"), "progress": False})
    LocalEngine(prepare(build_config(part)), tmp_path / "part").run()
    part["rounds"] = 3
    assert strip_timing(LocalEngine(prepare(build_config(part)), tmp_path / "part").run(resume=True)) \
        == strip_timing(records)
    algo = exp.algorithm
    n = sum(v.numel() for v in algo.dense.values())
    # round 1 is dense both ways; from round 2 the pattern is fixed at 25% and the uploads stay inside it
    assert records[0]["method"]["down_density"] == 1.0
    assert records[1]["method"]["mask_density"] == pytest.approx(int(0.25 * n) / n)
    assert records[1]["bytes_down"][0] < records[0]["bytes_down"][0]
    assert max(records[2]["bytes_up"]) < min(records[0]["bytes_up"])
    assert all(not algo.dense[k][~algo.mask[k]].any() for k in algo.dense)


def test_adapter_lth_shrinks_by_the_prune_fraction_every_k_rounds(toy_files: tuple[Path, Path],
                                                                  tmp_path: Path) -> None:
    train, eval_ = toy_files
    raw = flasc_raw(train, eval_, tmp_path / "lth", method="adapter_lth", prune_fraction=0.2, prune_every=1)
    exp = prepare(build_config(raw))
    records = LocalEngine(exp, tmp_path / "lth").run()
    n = sum(v.numel() for v in exp.algorithm.dense.values())
    first = int(0.8 * n)
    assert records[0]["method"]["mask_density"] == pytest.approx(first / n)
    assert records[1]["method"]["mask_density"] == pytest.approx(int(0.8 * first) / n)


def strip_timing(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in ("time", "cum_wall_seconds", "client_seconds")} for r in records]


def test_flasc_learns_and_resumes_bit_identically(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    train, eval_ = toy_files
    # FLASC's masks with a FedAvg server and Adam clients: the tiny random model learns in a few rounds
    # (the recipe's AdamW server takes lr-sized steps, too slow for a 6-round test; its math is tested above)
    raw = flasc_raw(train, eval_, tmp_path / "full", down_density=0.25, up_density=0.25, name="fedavg", server_lr=1.0)
    raw.update(rounds=6, client={"optimizer": "adam", "lr": 0.02, "batch_size": 8, "local_epochs": 2})
    raw["adapter"].update(init="gaussian", dropout=0.1)
    full = LocalEngine(prepare(build_config(raw)), tmp_path / "full")
    records = full.run()
    accuracy = [r["eval"]["accuracy"] for r in records]
    assert max(accuracy[-2:]) >= 0.7, accuracy  # chance is 0.5 on 64 balanced examples
    assert sum(r["train_loss"] for r in records[-2:]) / 2 < records[0]["train_loss"]
    n = records[0]["trainable_params"]
    assert max(records[0]["bytes_up"]) < 0.5 * (4 * n)  # a quarter of the values + positions, vs 4 B per weight
    # the time model: default 10 Mbps down, 1 Mbps up, no latency, plus each client's measured compute
    for r in records:
        comm = max(8 * d / 10e6 + 8 * u / 1e6 for d, u in zip(r["bytes_down"], r["bytes_up"]))
        assert r["time"]["simulated_communication"] == pytest.approx(comm)
        assert r["time"]["simulated"] >= comm
    assert records[-1]["time"]["cum_simulated"] == pytest.approx(sum(r["time"]["simulated"] for r in records))

    part = dict(raw, rounds=3, output={"run_dir": str(tmp_path / "part"), "progress": False})
    LocalEngine(prepare(build_config(part)), tmp_path / "part").run()
    part["rounds"] = 6
    resumed_engine = LocalEngine(prepare(build_config(part)), tmp_path / "part")
    assert strip_timing(resumed_engine.run(resume=True)) == strip_timing(records)
    assert all(torch.equal(full.exp.algorithm.dense[k], resumed_engine.exp.algorithm.dense[k])
               for k in full.exp.algorithm.dense)


@pytest.mark.parametrize(("method", "options"), [
    ("sparse_adapter", {"down_density": 0.5}),
    ("federated_select", {"down_density": 1.0, "down_density_decay": 0.5, "decay_every": 3, "dense_head": True,
                          "mask_score": "product"}),
    ("adapter_lth", {"prune_fraction": 0.1}),
])
def test_sparsity_baselines_learn(toy_files: tuple[Path, Path], tmp_path: Path, method: str, options: dict) -> None:
    train, eval_ = toy_files
    # LoRA's B starts at zero: a client-freezing method that never receives B cannot train it (the paper's
    # point about freezing), so Federated Select downloads densely for two rounds, then at 1/2 and 1/4
    raw = flasc_raw(train, eval_, tmp_path / method, method=method, name="fedavg", server_lr=1.0, **options)
    raw.update(rounds=6, client={"optimizer": "adam", "lr": 0.02, "batch_size": 8, "local_epochs": 2})
    raw["adapter"]["init"] = "gaussian"
    records = LocalEngine(prepare(build_config(raw)), tmp_path / method).run()
    accuracy = [r["eval"]["accuracy"] for r in records]
    assert max(accuracy[-2:]) >= 0.7, accuracy  # chance is 0.5 on 64 balanced examples
    assert sum(r["train_loss"] for r in records[-2:]) / 2 < records[0]["train_loss"]
    assert records[-1]["method"]["down_density"] < 1.0


def test_dp_fedadam_reports_epsilon(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    train, eval_ = toy_files
    raw = flasc_raw(train, eval_, tmp_path / "dp", down_density=1.0, up_density=1.0, dp_clip_norm=0.05,
                    dp_noise_multiplier=1.0, dp_delta=1e-3)
    raw["rounds"] = 2
    records = LocalEngine(prepare(build_config(raw)), tmp_path / "dp").run()
    from fedpeft.federated.privacy import dp_fedadam_epsilon

    for round_idx, record in enumerate(records, start=1):
        privacy = record["server_privacy"]
        assert privacy["epsilon"] == pytest.approx(dp_fedadam_epsilon(1.0, 2, 4, round_idx, 1e-3))
        assert (privacy["delta"], privacy["noise_multiplier"], privacy["clip_norm"]) == (1e-3, 1.0, 0.05)
        assert len(privacy["update_norms"]) == 2 and all(x > 0 for x in privacy["update_norms"])
    summary = summarize(records, "accuracy")
    assert summary["server_dp_epsilon"] == pytest.approx(dp_fedadam_epsilon(1.0, 2, 4, 2, 1e-3))
    assert summary["server_dp_delta"] == 1e-3 and "dp_epsilon" not in summary  # no local DP-SGD here


def test_bad_sparsity_options_name_the_field(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    train, eval_ = toy_files
    with pytest.raises(ConfigError, match=r"strategy\.up_density"):
        prepare(build_config(flasc_raw(train, eval_, tmp_path / "bad", up_density=1.5)))
    with pytest.raises(ConfigError, match=r"strategy\.mask_scope"):
        prepare(build_config(flasc_raw(train, eval_, tmp_path / "bad", mask_scope="layer")))


def test_per_tensor_scope_masks_every_tensor_alike(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    train, eval_ = toy_files
    exp = prepare(build_config(flasc_raw(train, eval_, tmp_path / "pt", down_density=0.25, mask_scope="per_tensor")))
    payload = exp.algorithm.configure_train(1, [0], exp.initial_state)[0].payload
    for key, value in payload.items():
        expected = 0 if not exp.algorithm.dense[key].any() else keep_count(value.numel(), 0.25)
        assert int((value != 0).sum()) == expected, key


# --- systems heterogeneity: per-client density tiers (Sec. 4.4) -----------------------------------------

def test_density_tiers_scale_each_client_s_download_and_upload(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    train, eval_ = toy_files
    exp = prepare(build_config(flasc_raw(train, eval_, tmp_path / "tiers", down_density=0.5, up_density=0.5,
                                         density_tiers=[0.5, 1.0], tier_assignment="modulo")))
    algo = exp.algorithm
    assert algo.client_tiers == [0.5, 1.0, 0.5, 1.0]
    dense = {k: v.clone() for k, v in algo.dense.items()}
    numel = sum(v.numel() for v in dense.values())
    tasks = algo.configure_train(1, [3, 0], exp.initial_state)  # client 3 is tier 1, client 0 tier 0.5
    for task, density in zip(tasks, (0.5, 0.25), strict=True):  # the base density times the client's tier
        expected = topk_sparsify(dense, density)
        assert all(torch.equal(task.payload[k], expected[k]) for k in expected)
        assert sum(int((v != 0).sum()) for v in task.payload.values()) == keep_count(numel, density)
        assert task.config["up_density"] == density and not task.config["train_received_only"]
    assert algo.last["client_tiers"] == [1.0, 0.5]
    assert algo.last["down_density"] == pytest.approx((keep_count(numel, 0.25) + keep_count(numel, 0.5)) / 2 / numel)
    assert algo.last["up_density"] == pytest.approx(0.375)
    update = run_client(exp, tasks[1], 1, False).result.update
    assert sum(int((v != 0).sum()) for v in update.values()) == keep_count(numel, 0.25)
    # the model evaluated and deployed is the base-density download (what a tier-1 client receives)
    results = [run_client(exp, t, 1, False).result for t in tasks]
    public = algo.aggregate(1, exp.initial_state, results)
    assert all(torch.equal(public[k], topk_sparsify(algo.dense, 0.5)[k]) for k in public)


@pytest.mark.parametrize("dense_head", [True, "down"])
def test_density_tiers_with_a_dense_head(toy_files: tuple[Path, Path], tmp_path: Path, dense_head: object) -> None:
    """``down`` (the released het script): head out of the download mask, in the upload top-k; true: out of both."""
    train, eval_ = toy_files
    exp = prepare(build_config(flasc_raw(train, eval_, tmp_path / str(dense_head), down_density=1.0, up_density=1.0,
                                         density_tiers=[0.25, 1.0], tier_assignment="modulo",
                                         dense_head=dense_head)))
    algo = exp.algorithm
    head = [k for k in algo.dense if lora_matrix(k) is None]
    lora = [k for k in algo.dense if lora_matrix(k)]
    lora_numel = sum(algo.dense[k].numel() for k in lora)
    numel = lora_numel + sum(algo.dense[k].numel() for k in head)
    low, top = algo.configure_train(1, [2, 1], exp.initial_state)
    expected = topk_sparsify({k: algo.dense[k] for k in lora}, 0.25)  # LoRA's own top quarter
    assert all(torch.equal(low.payload[k], expected[k]) for k in lora)
    assert all(torch.equal(low.payload[k], algo.dense[k]) for k in head)
    assert all(torch.equal(top.payload[k], algo.dense[k]) for k in algo.dense)
    update = run_client(exp, low, 1, False).result.update
    if dense_head is True:  # a quarter of LoRA's update entries, the head's update whole
        assert sum(int((update[k] != 0).sum()) for k in lora) == keep_count(lora_numel, 0.25)
        assert all(bool((update[k] != 0).all()) for k in head if k.endswith("weight"))
    else:  # a quarter of all the update's entries, head and LoRA ranked together
        assert sum(int((update[k] != 0).sum()) for k in update) == keep_count(numel, 0.25)
    full = run_client(exp, top, 1, False).result.update
    assert sum(int((full[k] != 0).sum()) for k in full) > keep_count(numel, 0.5)


def test_federated_select_freezes_only_the_tiers_below_one(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    train, eval_ = toy_files
    exp = prepare(build_config(flasc_raw(train, eval_, tmp_path / "fs", method="federated_select", down_density=1.0,
                                         density_tiers=[0.5, 1.0], tier_assignment="modulo")))
    tasks = exp.algorithm.configure_train(1, [0, 1, 3], exp.initial_state)
    assert [t.config["train_received_only"] for t in tasks] == [True, False, False]


def test_density_tiers_follow_hetlora_s_assignment(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    """Under one seed a client gets the same tier index from FLASC's density tiers as from HetLoRA's ranks."""
    train, eval_ = toy_files
    for seed in (0, 1, 2):
        flasc = flasc_raw(train, eval_, tmp_path / f"f{seed}", down_density=1.0, up_density=1.0,
                          density_tiers=[0.0625, 0.25, 1.0])
        het = flasc_raw(train, eval_, tmp_path / f"h{seed}", method="hetlora", rank_tiers=[1, 2, 4])
        for raw in (flasc, het):
            raw.update(seed=seed, partition={"kind": "iid", "num_clients": 12})
        tiers = prepare(build_config(flasc)).algorithm.client_tiers
        ranks = prepare(build_config(het)).algorithm.client_ranks
        assert [[0.0625, 0.25, 1.0].index(t) for t in tiers] == [[1, 2, 4].index(r) for r in ranks]
        assert len(set(tiers)) > 1


@pytest.mark.parametrize(("method", "options"), [
    ("flasc", {"dense_head": "down"}),
    ("federated_select", {"dense_head": "down"}),
    ("federated_select", {"dense_head": True, "mask_granularity": "rank", "mask_scope": "per_tensor"}),
])
def test_density_tiers_learn(toy_files: tuple[Path, Path], tmp_path: Path, method: str, options: dict) -> None:
    train, eval_ = toy_files
    raw = flasc_raw(train, eval_, tmp_path / method, method=method, name="fedavg", server_lr=1.0,
                    down_density=1.0, up_density=1.0, density_tiers=[0.25, 1.0], tier_assignment="modulo",
                    **options)
    raw.update(rounds=6, client={"optimizer": "adam", "lr": 0.02, "batch_size": 8, "local_epochs": 2})
    raw["adapter"]["init"] = "gaussian"
    records = LocalEngine(prepare(build_config(raw)), tmp_path / method).run()
    accuracy = [r["eval"]["accuracy"] for r in records]
    assert max(accuracy[-2:]) >= 0.7, accuracy  # chance is 0.5 on 64 balanced examples
    tiers = [t for r in records for t in r["method"]["client_tiers"]]
    assert set(tiers) == {0.25, 1.0}
    # a round's bytes follow its clients' tiers: the 1/4 tier receives and sends fewer than the dense one
    for direction in ("bytes_down", "bytes_up"):
        sizes = {t: b for r in records for t, b in zip(r["method"]["client_tiers"], r[direction], strict=True)}
        assert sizes[0.25] < 0.5 * sizes[1.0], direction


def test_bad_density_tiers_name_the_field(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    train, eval_ = toy_files
    for tiers in ([0.0, 1.0], [1.5], []):
        with pytest.raises(ConfigError, match=r"strategy\.density_tiers"):
            prepare(build_config(flasc_raw(train, eval_, tmp_path / "bad", density_tiers=tiers)))
    with pytest.raises(ConfigError, match=r"strategy\.dense_head"):
        prepare(build_config(flasc_raw(train, eval_, tmp_path / "bad", dense_head="up")))
    with pytest.raises(ConfigError, match=r"strategy\.tier_assignment"):
        prepare(build_config(flasc_raw(train, eval_, tmp_path / "bad", density_tiers=[1.0], tier_assignment="rr")))
    for method in ("sparse_adapter", "adapter_lth"):
        with pytest.raises(ConfigError, match=r"strategy\.density_tiers.*one pattern"):
            prepare(build_config(flasc_raw(train, eval_, tmp_path / method, method=method, density_tiers=[0.5, 1.0])))


# --- structured masks: whole LoRA rank components (the paper's Fig. 6 Federated Select) ----------------

def test_rank_masks_keep_whole_components() -> None:
    a1, b1 = "m1.q.lora_A.default.weight", "m1.q.lora_B.default.weight"
    a2, b2 = "m2.q.lora_A.default.weight", "m2.q.lora_B.default.weight"
    scores = {  # r = 4; component k scores sum(A[k, :]) + sum(B[:, k])
        a1: torch.tensor([[1.0, 0.0], [0.0, 0.0], [3.0, 1.0], [0.5, 0.0]]),  # rows: 1, 0, 4, 0.5
        b1: torch.tensor([[0.0, 2.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]]),  # cols: 0, 2, 0, 1 -> 1, 2, 4, 1.5
        a2: torch.zeros(4, 2), b2: torch.tensor([[0.0, 0.0, 0.0, 9.0]]),  # 0, 0, 0, 9
    }
    per_module = rank_masks(scores, 0.5, "per_tensor")  # 2 of 4 components in every module
    assert per_module[a1][:, 0].tolist() == [False, True, True, False]
    assert per_module[a2][:, 0].tolist() == [True, False, False, True]  # a tie at 0 goes to the lower index
    for a, b in ((a1, b1), (a2, b2)):  # a kept component keeps its whole row of A and column of B
        assert torch.equal(per_module[a], per_module[a][:, :1].expand_as(per_module[a]))
        assert torch.equal(per_module[b], per_module[a][:, 0][None, :].expand_as(per_module[b]))
    overall = rank_masks(scores, 0.25, "global")  # 2 of all 8 components: 9 (m2) and 4 (m1)
    assert overall[a1][:, 0].tolist() == [False, False, True, False]
    assert overall[a2][:, 0].tolist() == [False, False, False, True]
    zeros = rank_masks({a1: torch.zeros(4, 2), b1: torch.zeros(2, 4)}, 0.25, "per_tensor")
    assert zeros[a1][:, 0].tolist() == [True, False, False, False]  # all 0: HetLoRA's first components


@pytest.mark.parametrize(("tier", "scope", "rows"), [(0.5, "per_tensor", 2), (0.125, "per_tensor", 1),
                                                     (0.25, "global", None)])
def test_federated_select_rank_tiers_train_whole_components(toy_files: tuple[Path, Path], tmp_path: Path,
                                                            tier: float, scope: str, rows: int | None) -> None:
    """A low-tier client gets the top components (of every module: at least one, even where r * tier < 1;
    or over all modules), trains exactly those, B's columns included while they are still 0 (an entry
    mask leaves such a B frozen), and uploads them whole."""
    train, eval_ = toy_files
    updates = {}
    for granularity in ("rank", "entry"):
        exp = prepare(build_config(flasc_raw(
            train, eval_, tmp_path / granularity, method="federated_select", down_density=1.0, up_density=1.0,
            density_tiers=[tier, 1.0], tier_assignment="modulo", dense_head=True, mask_granularity=granularity,
            mask_scope=scope)))
        algo = exp.algorithm
        low = algo.configure_train(1, [0], exp.initial_state)[0]
        lora = {k: v for k, v in algo.dense.items() if lora_matrix(k)}
        if granularity == "rank":
            expected = rank_masks(weight_scores(lora, "magnitude", 2.0), tier, scope)
            for key in lora:
                assert torch.equal(low.payload[key], algo.dense[key] * expected[key]), key
                if lora_matrix(key) == "A" and rows is not None:  # of r = 4 rows
                    assert int((low.payload[key] != 0).any(dim=1).sum()) == rows
        updates[granularity] = run_client(exp, low, 1, False).result.update
    update = updates["rank"]
    for key in lora:
        moved = update[key] != 0
        assert torch.equal(moved, expected[key]), key  # exactly the received components, B's zero columns too
    assert all(bool(update[k].any()) for k in update if lora_matrix(k) is None)  # the dense head trains
    assert not any(bool(updates["entry"][k].any()) for k in lora if lora_matrix(k) == "B")


def test_rank_masks_over_product_scores() -> None:
    """Under ``product`` a component scores s (|A_k|_1 |B_:k|_2 + |B_:k|_1 |A_k|_2), its share of B A;
    magnitude ranks the raw entries and here keeps the other component."""
    a, b = "m.q.lora_A.default.weight", "m.q.lora_B.default.weight"
    state = {a: torch.tensor([[3.0, -4.0], [10.0, 0.0]]),  # rows: L1 7, 10; L2 5, 10
             b: torch.tensor([[1.0, 0.0], [0.0, 0.1]])}  # columns: L1 = L2 = 1, 0.1
    # product: 2 (7 * 1 + 1 * 5) = 24 against 2 (10 * 0.1 + 0.1 * 10) = 4; magnitude: 8 against 10.1
    product = weight_scores(state, "product", 2.0)
    torch.testing.assert_close(product[a].sum(dim=1) + product[b].sum(dim=0), torch.tensor([24.0, 4.0]))
    assert rank_masks(product, 0.5, "per_tensor")[a][:, 0].tolist() == [True, False]
    assert rank_masks(weight_scores(state, "magnitude", 2.0), 0.5, "per_tensor")[a][:, 0].tolist() == [False, True]


def test_rank_product_tiers_start_from_hetlora_s_slice(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    """With B = 0 every product score is 0, so a low tier first receives each module's first components
    (HetLoRA's top-left slice); once B has moved the server's choice follows B A."""
    train, eval_ = toy_files
    raw = flasc_raw(train, eval_, tmp_path / "p", method="federated_select", down_density=1.0, up_density=1.0,
                    density_tiers=[0.5, 1.0], tier_assignment="modulo", dense_head=True, mask_granularity="rank",
                    mask_scope="per_tensor", mask_score="product")
    exp = prepare(build_config(raw))
    algo = exp.algorithm
    low = algo.configure_train(1, [0], exp.initial_state)[0]
    a_keys = [k for k in algo.dense if lora_matrix(k) == "A"]
    for key in a_keys:
        assert (low.payload[key] != 0).any(dim=1).tolist() == [True, True, False, False], key
    raw["rounds"] = 3
    engine = LocalEngine(prepare(build_config(raw)), tmp_path / "p")
    engine.run()
    algo = engine.exp.algorithm
    lora = {k: v for k, v in algo.dense.items() if lora_matrix(k)}
    later = algo.configure_train(4, [0], engine.exp.initial_state)[0]
    expected = rank_masks(weight_scores(lora, "product", 2.0), 0.5, "per_tensor")
    for key in lora:
        assert torch.equal(later.payload[key], algo.dense[key] * expected[key]), key
    assert any(expected[k][:, 0].tolist() != [True, True, False, False] for k in a_keys)  # no longer the slice


def test_rank_masks_travel_as_zero_slices(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    """Whole components are zero rows of A and zero columns of B, which the ``zero_slices`` codec names
    with one bit each instead of the ``topk`` codec's bitmask over every entry: the same run (lossless),
    and at MiniLM's width (r = 16 x 384) a 1/16 tier's message is smaller."""
    train, eval_ = toy_files
    records = {}
    for codec in ("topk", "zero_slices"):
        raw = flasc_raw(train, eval_, tmp_path / codec, method="federated_select", down_density=1.0, up_density=1.0,
                        density_tiers=[0.25, 1.0], tier_assignment="modulo", dense_head=True,
                        mask_granularity="rank", mask_scope="per_tensor")
        raw["codec"] = {"down": {"kind": codec}, "up": {"kind": codec}}
        records[codec] = LocalEngine(prepare(build_config(raw)), tmp_path / codec).run()
    for topk, zs in zip(records["topk"], records["zero_slices"], strict=True):
        assert zs["train_loss"] == topk["train_loss"] and zs["eval"] == topk["eval"]
    a, b = "m.q.lora_A.default.weight", "m.q.lora_B.default.weight"
    state = {a: torch.randn(16, 384), b: torch.randn(384, 16)}
    payload = apply_masks(state, rank_masks(weight_scores(state, "magnitude", 1.0), 0.0625, "per_tensor"))
    sizes = {}
    for kind in ("topk", "zero_slices"):
        codec = build_codec(DirectionCodecConfig(kind=kind), "down")
        message = codec.encode(payload)
        assert all(torch.equal(v, payload[k]) for k, v in codec.decode(message).items())
        sizes[kind] = len(message)
    values = 2 * 384 * 4  # one component: a row of A and a column of B in fp32
    assert values < sizes["zero_slices"] < values + 600 < sizes["topk"]  # topk's bitmask alone is 1,536 bytes


def test_sparse_adapter_rank_mask_prunes_whole_components(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    """SparseAdapter under rank masks: after its dense round it keeps half of every module's components
    (rows of A with their columns of B), which stay the only LoRA entries that are nonzero and train."""
    train, eval_ = toy_files
    raw = flasc_raw(train, eval_, tmp_path / "s", method="sparse_adapter", down_density=0.5, dense_rounds=1,
                    dense_head=True, mask_granularity="rank", mask_scope="per_tensor")
    raw["rounds"] = 3
    engine = LocalEngine(prepare(build_config(raw)), tmp_path / "s")
    records = engine.run()
    algo = engine.exp.algorithm
    assert records[0]["method"]["mask_kept"] == {"lora_A": 0.5, "lora_B": 0.5, "head": 1.0}
    chosen = {k: m.clone() for k, m in algo.mask.items()}
    for key, mask in chosen.items():
        if lora_matrix(key) == "A":
            rows = mask[:, 0]
            assert torch.equal(mask, rows[:, None].expand_as(mask)) and int(rows.sum()) == 2
            assert torch.equal(chosen[lora_partner(key)], rows[None, :].expand_as(chosen[lora_partner(key)]))
    for key, mask in chosen.items():
        assert not algo.dense[key][~mask].any(), key  # pruned components stay 0
        assert bool(algo.dense[key][mask].all()), key  # kept ones (B's columns too) have moved off 0
    assert records[2]["method"]["up_kept"]["lora_B"] <= 0.5


def test_bad_rank_granularity_names_the_field(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    train, eval_ = toy_files
    with pytest.raises(ConfigError, match=r"strategy\.mask_granularity.*dense_head"):
        prepare(build_config(flasc_raw(train, eval_, tmp_path / "h", down_density=0.5, mask_granularity="rank")))
    for dense_head in (True, False):  # the reason named first is the one that cannot be fixed by another field
        with pytest.raises(ConfigError, match=r"strategy\.mask_granularity.*entries"):
            prepare(build_config(flasc_raw(train, eval_, tmp_path / "l", method="adapter_lth", dense_head=dense_head,
                                           mask_granularity="rank")))
    raw = flasc_raw(train, eval_, tmp_path / "ffa", dense_head=True, mask_granularity="rank")
    raw["adapter"]["kind"] = "ffa_lora"
    with pytest.raises(ConfigError, match=r"strategy\.mask_granularity.*partner"):
        prepare(build_config(raw))
    with pytest.raises(ConfigError, match=r"strategy\.mask_granularity"):
        prepare(build_config(flasc_raw(train, eval_, tmp_path / "x", mask_granularity="column")))


# --- what the masks keep (visible per round), and the options that change it ------------------------

def test_product_score_is_each_entry_s_contribution_to_ba() -> None:
    a_key, b_key = "m.q.lora_A.default.weight", "m.q.lora_B.default.weight"
    state = {a_key: torch.tensor([[3.0, -4.0], [1.0, 0.0]]),  # A: r=2 x in=2, row norms 5, 1
             b_key: torch.tensor([[0.5, 0.0], [0.0, 2.0], [0.0, 0.0]]),  # B: out=3 x r=2, column norms 0.5, 2
             "classifier.weight": torch.tensor([-0.7, 0.1])}
    scores = weight_scores(state, "product", scale=2.0)
    torch.testing.assert_close(scores[a_key], 2.0 * torch.tensor([[3 * 0.5, 4 * 0.5], [1 * 2.0, 0.0]]))
    torch.testing.assert_close(scores[b_key], 2.0 * torch.tensor([[0.5 * 5, 0.0], [0.0, 2 * 1.0], [0.0, 0.0]]))
    torch.testing.assert_close(scores["classifier.weight"], torch.tensor([0.7, 0.1]))
    # invariant to A -> cA, B -> B/c (the same B A); magnitude is not
    rescaled = {a_key: 10 * state[a_key], b_key: state[b_key] / 10, "classifier.weight": state["classifier.weight"]}
    again = weight_scores(rescaled, "product", scale=2.0)
    assert all(torch.allclose(again[k], scores[k]) for k in scores)
    assert torch.equal(weight_scores(state, "magnitude", 2.0)[a_key], state[a_key].abs())
    fractions = group_fractions(state, {a_key: torch.tensor([[True, False], [False, False]]),
                                        b_key: torch.zeros(3, 2, dtype=torch.bool)})
    assert fractions == {"lora_A": 0.25, "lora_B": 0.0, "head": 1.0}


@pytest.mark.parametrize("score", ["magnitude", "product"])
def test_sparse_adapter_logs_its_mask_and_product_keeps_b(toy_files: tuple[Path, Path], tmp_path: Path,
                                                          score: str) -> None:
    """The review's finding: after one dense round under server AdamW, B has moved by about server_lr, below
    most |A|: the magnitude mask keeps no B entry. The product score keeps B entries."""
    train, eval_ = toy_files
    raw = flasc_raw(train, eval_, tmp_path / score, method="sparse_adapter", down_density=0.25, mask_score=score)
    raw["rounds"] = 2
    engine = LocalEngine(prepare(build_config(raw)), tmp_path / score)
    records = engine.run()
    algo = engine.exp.algorithm
    assert records[0]["method"]["down_kept"] == {"lora_A": 1.0, "lora_B": 1.0, "head": 1.0}  # the dense round
    kept = records[0]["method"]["mask_kept"]  # the pattern chosen after it
    assert kept == group_fractions(algo.dense, algo.mask)
    assert records[1]["method"]["down_kept"] == kept and records[1]["method"]["up_kept"]["lora_B"] <= kept["lora_B"]
    if score == "magnitude":
        assert kept["lora_B"] == 0.0 and kept["lora_A"] > 0.25
    else:
        assert kept["lora_B"] > 0.1


def test_sparse_adapter_dense_rounds_choose_when_the_mask_is_fixed(toy_files: tuple[Path, Path],
                                                                   tmp_path: Path) -> None:
    train, eval_ = toy_files
    at_init = prepare(build_config(flasc_raw(train, eval_, tmp_path / "i", method="sparse_adapter",
                                             down_density=0.25, dense_rounds=0)))
    assert at_init.algorithm.mask is not None  # pruning at initialisation: B = 0 is pruned whole
    assert group_fractions(at_init.algorithm.dense, at_init.algorithm.mask)["lora_B"] == 0.0
    raw = flasc_raw(train, eval_, tmp_path / "k", method="sparse_adapter", down_density=0.25, dense_rounds=2)
    raw["rounds"] = 3
    records = LocalEngine(prepare(build_config(raw)), tmp_path / "k").run()
    assert "mask_kept" not in records[0]["method"] and "mask_kept" in records[1]["method"]
    assert records[1]["method"]["down_density"] == 1.0 and records[2]["method"]["down_density"] < 1.0


def test_dense_head_is_never_masked(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    train, eval_ = toy_files
    exp = prepare(build_config(flasc_raw(train, eval_, tmp_path / "dh", down_density=0.25, up_density=0.125,
                                         dense_head=True)))
    algo = exp.algorithm
    head = [k for k in algo.dense if lora_matrix(k) is None]
    lora = [k for k in algo.dense if lora_matrix(k)]
    task = algo.configure_train(1, [0], exp.initial_state)[0]
    assert head and all(torch.equal(task.payload[k], algo.dense[k]) for k in head)
    lora_numel = sum(algo.dense[k].numel() for k in lora)
    assert sum(int((task.payload[k] != 0).sum()) for k in lora) == keep_count(lora_numel, 0.25)
    assert algo.last["down_kept"]["head"] == 1.0
    update = run_client(exp, task, 1, False).result.update
    assert all(bool((update[k] != 0).all()) for k in head if k.endswith("weight"))  # the head goes up dense
    assert sum(int((update[k] != 0).sum()) for k in lora) == keep_count(lora_numel, 0.125)
    # without it the head competes in the top-k like any LoRA entry (the released main script)
    plain = prepare(build_config(flasc_raw(train, eval_, tmp_path / "p", down_density=0.25)))
    plain.algorithm.configure_train(1, [0], plain.initial_state)
    assert plain.algorithm.last["down_kept"]["head"] < 1.0


def test_dense_head_trains_a_zero_bias_under_client_freezing(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    train, eval_ = toy_files
    bias_moved = {}
    for dense_head in (False, True):
        exp = prepare(build_config(flasc_raw(train, eval_, tmp_path / str(dense_head), method="federated_select",
                                             down_density=0.5, dense_head=dense_head)))
        task = exp.algorithm.configure_train(1, [0], exp.initial_state)[0]
        assert not task.payload["classifier.bias"].any()  # a new head's bias starts at 0
        bias_moved[dense_head] = bool(run_client(exp, task, 1, False).result.update["classifier.bias"].any())
    assert bias_moved == {False: False, True: True}  # a zero that is sent is not "not received" any more


def test_product_score_needs_both_factors(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    train, eval_ = toy_files
    raw = flasc_raw(train, eval_, tmp_path / "ffa", down_density=0.25, mask_score="product")
    raw["adapter"]["kind"] = "ffa_lora"
    with pytest.raises(ConfigError, match=r"strategy\.mask_score"):
        prepare(build_config(raw))


# --- FeDeRA's SVD init where LoRA is masked ---------------------------------------------------------

@pytest.mark.parametrize(("method", "options"), [
    ("flasc", {"down_density": 0.25}),
    ("flasc", {"down_density": 1.0, "down_density_decay": 0.5}),
    ("flasc", {"down_density": 1.0, "density_tiers": [0.25, 1.0]}),
    ("federated_select", {"down_density": 0.5}),
    ("sparse_adapter", {"down_density": 0.25}),
    ("adapter_lth", {}),
])
def test_svd_init_is_refused_where_lora_is_masked(toy_files: tuple[Path, Path], tmp_path: Path, method: str,
                                                  options: dict) -> None:
    train, eval_ = toy_files
    raw = flasc_raw(train, eval_, tmp_path / method, method=method, **options)
    raw["adapter"]["init"] = "svd"
    with pytest.raises(ConfigError, match=r"adapter\.init: svd .*cut pretrained weight"):
        prepare(build_config(raw))


def test_svd_init_with_sparse_upload_only_keeps_the_output(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    """Dense download, top-k upload: clients start from the exact SVD model, the server's copy keeps every entry."""
    train, eval_ = toy_files
    raw = flasc_raw(train, eval_, tmp_path / "up", down_density=1.0, up_density=0.25)
    raw["adapter"]["init"] = "svd"
    exp = prepare(build_config(raw))
    task = exp.algorithm.configure_train(1, [0], exp.initial_state)[0]
    assert all(torch.equal(task.payload[k], exp.initial_state[k]) for k in task.payload)
    assert all(lora_matrix(k) is None or bool(v.all()) for k, v in task.payload.items())  # nothing zeroed
    with pytest.raises(ConfigError, match=r"adapter\.init"):  # a lossy download codec masks just the same
        build_config({**raw, "method": "lora", "codec": {"down": {"kind": "topk", "density": 0.5}}})


# --- DP-FedAdam's epsilon wherever fedadamw adds noise --------------------------------------------

def test_server_dp_epsilon_is_reported_for_any_recipe_on_fedadamw(toy_files: tuple[Path, Path],
                                                                 tmp_path: Path) -> None:
    train, eval_ = toy_files
    raw = flasc_raw(train, eval_, tmp_path / "lora", method="lora", dp_clip_norm=0.05, dp_noise_multiplier=0.8,
                    dp_simulated_cohort=3)
    raw["rounds"] = 1
    records = LocalEngine(prepare(build_config(raw)), tmp_path / "lora").run()
    from fedpeft.federated.privacy import dp_fedadam_epsilon

    assert records[0]["server_privacy"]["epsilon"] == pytest.approx(dp_fedadam_epsilon(0.8, 2, 4, 1, 1e-5, 3))
    assert summarize(records, "accuracy")["server_dp_epsilon"] == records[0]["server_privacy"]["epsilon"]
    with pytest.raises(ConfigError, match=r"strategy\.dp_simulated_cohort"):  # refused with the config, before a run
        build_config(flasc_raw(train, eval_, tmp_path / "big", method="lora", dp_clip_norm=0.05,
                               dp_noise_multiplier=0.8, dp_simulated_cohort=5))
    # a method with its own aggregation would never apply the noise: refused rather than reported
    with pytest.raises(ConfigError, match=r"strategy\.dp_clip_norm"):
        prepare(build_config(flasc_raw(train, eval_, tmp_path / "hp", method="headprune", dp_clip_norm=0.05,
                                       dp_noise_multiplier=0.8)))
