"""FedTT and FedTT+ end to end: round-robin math (Alg. 2), exact uplink bytes, frozen cores
bit-identical across clients and rounds, learning on a tiny model, the paper's partition presets."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from fedpeft.adapters.tt import tt_layers
from fedpeft.config import ConfigError, build_config
from fedpeft.data.presets import PRESETS
from fedpeft.engines.local import LocalEngine
from fedpeft.experiment import load_data, prepare
from fedpeft.federated.types import ClientResult, State
from fedpeft.methods.fedtt import round_robin_core, trainable_cores
from tests.conftest import tiny_raw_config


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Tiny models gain nothing from threads, and on a shared CPU two spinning threads cost 10x."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# hidden 32 -> [2, 4, 4] and bottleneck 8 -> [2, 4] with modes <= 4: five cores per TT layer
SMALL_MODES = {"kind": "tt", "bottleneck_size": 8, "tt_rank": 3, "tt_max_mode": 4}


def test_round_robin_index_covers_the_middle_cores() -> None:
    # J = 5: middle cores 2, 3, 4 in turn, starting from r = mod(1, 3) + 2 = 3
    assert [round_robin_core(t, 5) for t in range(1, 7)] == [3, 4, 2, 3, 4, 2]
    assert [round_robin_core(t, 6) for t in range(1, 5)] == [3, 4, 5, 2]
    assert trainable_cores(1, 5) == (1, 3, 5)
    assert trainable_cores(3, 6) == (1, 5, 6)
    assert {round_robin_core(t, 8) for t in range(1, 7)} == set(range(2, 8))
    assert trainable_cores(7, 3) == (1, 2, 3)  # nothing to freeze
    assert round_robin_core(1, 2) is None and trainable_cores(1, 2) == (1, 2)


def expected_upload_keys(model: torch.nn.Module, trainable: Sequence[str], round_idx: int,
                         biases: bool = False) -> set[str]:
    """Computed from the paper's rule directly: G_1, G_r, G_J of every adapter TT layer, r = t mod (J-2) + 2,
    and the head; the adapters' biases only with ``biases``."""
    frozen = set()
    for name, layer in tt_layers(model).items():
        num_cores = layer.num_cores
        r = round_idx % (num_cores - 2) + 2
        frozen |= {f"{name}.cores.{j - 1}" for j in range(1, num_cores + 1) if j not in (1, r, num_cores)}
        if not biases:
            frozen.add(f"{name}.bias")
    return set(trainable) - frozen


def test_fedtt_plus_uploads_exactly_the_trained_cores_and_keeps_frozen_ones_identical(
        toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    train, eval_ = toy_files
    raw = tiny_raw_config(train, eval_, tmp_path / "run", method="fedtt_plus", rounds=3, adapter=SMALL_MODES,
                          strategy={"name": "fedavg", "selection": "all", "clients_per_round": None},
                          partition={"kind": "iid", "num_clients": 3},
                          task={"max_train_examples": 48, "max_eval_examples": 16})
    exp = prepare(build_config(raw))
    model = exp.backbone.model
    assert all(layer.num_cores == 5 for layer in tt_layers(model).values())
    trainable = list(exp.slot.trainable)
    client_states: dict[int, list[State]] = {}
    global_states: list[State] = [dict(exp.initial_state)]
    algorithm = exp.algorithm
    original_update, original_aggregate = algorithm.client_update, algorithm.aggregate

    def recording_update(slot: Any, data: Any, shard: Any, task: Any, seed: int, count_flops: bool) -> Any:
        result, stats = original_update(slot, data, shard, task, seed, count_flops)
        client_states.setdefault(len(global_states), []).append(slot.read())  # after local training
        return result, stats

    def recording_aggregate(round_idx: int, state: State, results: Sequence[ClientResult]) -> State:
        new_state = original_aggregate(round_idx, state, results)
        global_states.append({k: v.clone() for k, v in new_state.items()})
        return new_state

    algorithm.client_update = recording_update  # type: ignore[method-assign]
    algorithm.aggregate = recording_aggregate  # type: ignore[method-assign]
    records = LocalEngine(exp, tmp_path / "run").run()

    for t, record in enumerate(records, start=1):
        keys = expected_upload_keys(model, trainable, t)
        assert len(keys) < len(trainable)
        assert {k for k in keys if ".cores." not in k} == {k for k in trainable if ".adapter" not in k}  # the head
        start = global_states[t - 1]
        message = exp.up_codec.encode({k: start[k] for k in sorted(keys)})
        assert record["bytes_up"] == [len(message)] * 3  # exactly those cores + head
        assert record["method"]["trained_params"] == sum(start[k].numel() for k in keys)
        frozen = set(trainable) - keys
        for state in client_states[t]:  # every client, after its local training
            for key in frozen:
                assert torch.equal(state[key], start[key]), (t, key)
            assert any(not torch.equal(state[k], start[k]) for k in keys if ".cores." in k)
        for key in frozen:  # the server leaves a frozen core as it was
            assert torch.equal(global_states[t][key], start[key])
    # and the core frozen in round 1 but trained in round 2 did move
    moved = expected_upload_keys(model, trainable, 2) - expected_upload_keys(model, trainable, 1)
    assert moved and all(not torch.equal(global_states[2][k], global_states[1][k]) for k in moved)


def test_fedtt_plus_cross_silo_download_sends_only_what_changed(toy_files: tuple[Path, Path],
                                                                 tmp_path: Path) -> None:
    """Alg. 2 line 11: after round 1 a client downloads only the cores and head of the previous
    round; it trains exactly the model a full download gives (same weights, same losses)."""
    train, eval_ = toy_files
    runs = {}
    for partial in (True, False):
        raw = tiny_raw_config(train, eval_, tmp_path / str(partial), method="fedtt_plus", rounds=3,
                              adapter=SMALL_MODES, partition={"kind": "iid", "num_clients": 3},
                              strategy={"name": "fedavg", "selection": "all", "clients_per_round": None,
                                        "partial_download": partial})
        exp = prepare(build_config(raw))
        engine = LocalEngine(exp, tmp_path / str(partial))
        runs[partial] = (exp, engine.run(), engine.final_state)
    exp, records, final = runs[True]
    _, full_records, full_final = runs[False]
    assert all(torch.equal(final[k], full_final[k]) for k in final)
    assert [r["client_losses"] for r in records] == [r["client_losses"] for r in full_records]
    initial = exp.initial_state
    assert records[0]["bytes_down"] == [len(exp.down_codec.encode(initial))] * 3  # first contact: everything
    for t, record in enumerate(records[1:], start=2):
        changed = exp.algorithm.round_keys(t - 1)  # the previous round's G_1, G_r, G_J and the head
        expected = len(exp.down_codec.encode({k: initial[k] for k in sorted(changed)}))
        assert record["bytes_down"] == [expected] * 3, t
        assert expected < full_records[t - 1]["bytes_down"][0]


@pytest.mark.parametrize("biases", [False, True])
def test_fedtt_plus_adapter_biases_frozen_unless_asked(toy_files: tuple[Path, Path], tmp_path: Path,
                                                       biases: bool) -> None:
    train, eval_ = toy_files
    raw = tiny_raw_config(train, eval_, tmp_path / "run", method="fedtt_plus", adapter=SMALL_MODES,
                          strategy={"name": "fedavg", "selection": "all", "clients_per_round": None,
                                    "train_adapter_biases": biases},
                          partition={"kind": "iid", "num_clients": 3})
    exp = prepare(build_config(raw))
    trainable = list(exp.slot.trainable)
    adapter_biases = {k for k in trainable if ".adapter" in k and k.endswith(".bias")}
    assert adapter_biases
    for t in (1, 2, 3):
        keys = exp.algorithm.round_keys(t)
        assert keys == expected_upload_keys(exp.backbone.model, trainable, t, biases=biases)
        assert adapter_biases & keys == (adapter_biases if biases else set())


def test_fedtt_plus_rejects_a_mistyped_option(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    train, eval_ = toy_files
    raw = tiny_raw_config(train, eval_, tmp_path / "run", method="fedtt_plus", adapter=SMALL_MODES,
                          strategy={"name": "fedavg", "train_adapter_biases": "sometimes"})
    with pytest.raises(ConfigError, match=r"strategy\.train_adapter_biases"):
        prepare(build_config(raw))


@pytest.mark.parametrize("method", ["fedtt", "fedtt_plus"])
def test_learns_on_a_tiny_model(toy_files: tuple[Path, Path], tmp_path: Path, method: str) -> None:
    train, eval_ = toy_files
    # tiny-llama: its input adapters see every token; on the tiny random BERT (attention saturated
    # by the wide init) per-token adapters barely move the [CLS] representation.
    raw = tiny_raw_config(train, eval_, tmp_path / "run", method=method, rounds=8, model={"name": "tiny-llama"},
                          adapter={**SMALL_MODES, "bottleneck_size": 16, "tt_rank": 4},
                          client={"optimizer": "adam", "lr": 0.01, "batch_size": 8, "local_epochs": 2})
    records = LocalEngine(prepare(build_config(raw)), tmp_path / "run").run()
    assert records[-1]["train_loss"] < 0.6 * records[0]["train_loss"]
    # chance is 0.5 on 64 balanced examples (standard deviation 0.0625): 0.7 is > 3 of them above
    assert max(r["eval"]["accuracy"] for r in records[-3:]) >= 0.7


def test_fedtt_plus_needs_tt_adapters(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    train, eval_ = toy_files
    raw = tiny_raw_config(train, eval_, tmp_path / "run", method="fedtt_plus", adapter={"kind": "lora"})
    with pytest.raises(ConfigError) as err:
        prepare(build_config(raw))
    assert err.value.field == "adapter.kind"


def test_presets_expand_under_the_users_values(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    train, eval_ = toy_files
    raw = tiny_raw_config(train, eval_, tmp_path / "run", method="fedtt_plus",
                          partition={"preset": "fedtt_appb_severe_2class"},
                          strategy={"name": "fedavg", "selection": "all", "clients_per_round": None})
    raw["partition"] = {"preset": "fedtt_appb_severe_2class"}
    cfg = build_config(raw)
    assert cfg.partition.kind == "label_proportions" and cfg.partition.num_clients == 3
    assert cfg.partition.label_proportions == [[0.05, 0.95], [0.95, 0.05], [0.5, 0.5]]
    assert cfg.client.local_steps == 10
    task, shards = load_data(cfg)
    labels = np.asarray([task.train[i].label for i in range(len(task.train))])
    # label ids follow the toy file's label order (neg = 0, pos = 1)
    fractions = [float(np.mean(labels[shard] == 1)) for shard in shards]
    assert fractions == pytest.approx([0.95, 0.05, 0.5], abs=0.03)

    raw["client"] = {**raw["client"], "local_steps": 3}
    raw["partition"] = {"preset": "fedtt_severe", "num_clients": 5}
    cfg = build_config(raw)
    assert (cfg.partition.num_clients, cfg.client.local_steps) == (5, 3)  # the user's values win

    raw["partition"] = {"preset": "fedtt_extreme"}
    with pytest.raises(ConfigError) as err:
        build_config(raw)
    assert err.value.field == "partition.preset"
    assert {"fedtt_iid", "fedtt_mild", "fedtt_severe", "fedtt_appb_severe_3class"} <= set(PRESETS)


@pytest.mark.parametrize("method", ["fedtt", "fedtt_plus"])
def test_server_averages_clients_uniformly(toy_files: tuple[Path, Path], tmp_path: Path, method: str) -> None:
    """Alg. 1 line 8 / Alg. 2 line 10: the new global state is the old one plus the plain 1/N mean of
    the clients' updates, whatever their shard sizes (a sample-weighted mean would differ here)."""
    train, eval_ = toy_files
    raw = tiny_raw_config(train, eval_, tmp_path / "run", method=method, rounds=1, adapter=SMALL_MODES,
                          partition={"kind": "quantity_skew", "num_clients": 3, "alpha": 0.5},
                          strategy={"name": "fedavg", "selection": "all", "clients_per_round": None},
                          task={"max_train_examples": 64, "max_eval_examples": 16})
    exp = prepare(build_config(raw))
    assert exp.cfg.strategy.weighting == "uniform"  # the recipe's own choice: the test sets none
    seen: list[tuple[State, list[ClientResult], State]] = []
    aggregate = exp.algorithm.aggregate

    def recording(round_idx: int, state: State, results: Sequence[ClientResult]) -> State:
        new_state = aggregate(round_idx, state, results)
        seen.append((state, list(results), new_state))
        return new_state

    exp.algorithm.aggregate = recording  # type: ignore[method-assign]
    LocalEngine(exp, tmp_path / "run").run()
    (start, results, new_state), = seen
    sizes = [r.num_samples for r in results]
    assert len(results) == 3 and len(set(sizes)) > 1
    for key in results[0].update:
        deltas = torch.stack([r.update[key] for r in results])
        torch.testing.assert_close(new_state[key], start[key] + deltas.mean(dim=0), rtol=0, atol=1e-6)
    moved = [k for k in results[0].update if not torch.equal(results[0].update[k], results[1].update[k])]
    weighted = {k: start[k] + sum(r.num_samples * r.update[k] for r in results) / sum(sizes) for k in moved}
    assert any((new_state[k] - weighted[k]).abs().max() > 1e-6 for k in moved)


def test_fedtt_plus_cross_device_trains_and_sends_the_round_robin_cores(toy_files: tuple[Path, Path],
                                                                        tmp_path: Path) -> None:
    """Cross-device (2 of 4 clients a round): every selected client downloads the whole TT state (no
    device state: partial_download is off), and trains and uploads exactly G_1, G_r, G_J + the head."""
    train, eval_ = toy_files
    raw = tiny_raw_config(train, eval_, tmp_path / "run", method="fedtt_plus", rounds=3, adapter=SMALL_MODES,
                          strategy={"name": "fedavg", "selection": "uniform", "clients_per_round": 2},
                          task={"max_train_examples": 64, "max_eval_examples": 16})
    exp = prepare(build_config(raw))
    assert not exp.algorithm.partial_download
    trainable = list(exp.slot.trainable)
    records = LocalEngine(exp, tmp_path / "run").run()
    full = len(exp.down_codec.encode(exp.initial_state))
    for t, record in enumerate(records, start=1):
        keys = expected_upload_keys(exp.backbone.model, trainable, t)
        assert exp.algorithm.round_keys(t) == keys and len(record["clients"]) == 2
        assert record["bytes_down"] == [full, full]  # the whole state, frozen cores included
        upload = len(exp.up_codec.encode({k: exp.initial_state[k] for k in sorted(keys)}))
        assert record["bytes_up"] == [upload, upload]
    assert exp.algorithm.known == {}  # nothing kept on the devices
    assert len({c for r in records for c in r["clients"]}) > 2  # different clients across rounds
