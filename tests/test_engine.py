"""End to end on tiny models: learning, exact accounting, resume, memory-independent slot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fedpeft.cli import main
from fedpeft.config import build_config
from fedpeft.engines.local import LocalEngine
from fedpeft.experiment import prepare
from fedpeft.metrics.recorder import CheckpointError, load_metrics
from tests.conftest import tiny_raw_config, without_timing


def run(raw: dict, resume: bool = False) -> tuple[LocalEngine, list[dict]]:
    exp = prepare(build_config(raw))
    engine = LocalEngine(exp, Path(raw["output"]["run_dir"]))
    records = engine.run(resume=resume)
    return engine, records


def test_tiny_model_learns_separable_task(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    train, eval_ = toy_files
    raw = tiny_raw_config(train, eval_, tmp_path / "run", rounds=10, client={"local_epochs": 2})
    _, records = run(raw)
    accuracies = [r["eval"]["accuracy"] for r in records]
    assert records[-1]["train_loss"] < 0.8 * records[0]["train_loss"]
    assert max(accuracies[-3:]) >= 0.75, accuracies  # chance is 0.5 on 64 balanced examples


def test_a_run_that_has_not_learned_says_so_and_what_to_try(toy_files: tuple[Path, Path], tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """The toy eval split is balanced (32 of 64 per class): 0.5 + 1.96 * sqrt(0.25 / 64) = 0.622 is the majority
    class's level with its noise. At lr 1e-7 nothing moves and the run says so; trained, it does not."""
    import yaml

    train, eval_ = toy_files
    config = tmp_path / "exp.yaml"
    config.write_text(yaml.safe_dump(tiny_raw_config(train, eval_, tmp_path / "still", rounds=1,
                                                     client={"lr": 1.0e-7})))
    assert main(["run", str(config)]) == 0
    summary = json.loads((tmp_path / "still" / "summary.json").read_text())
    assert summary["majority_rate"] == 0.5
    assert summary["not_learned"].startswith("accuracy never rose above")
    said = summary["not_learned"]
    assert "0.622 with its noise" in said and "fedpeft tune CONFIG --trials 8" in said
    assert "not learned: accuracy never rose" in " ".join(capsys.readouterr().out.split())
    assert "clients hold 90%" not in said  # iid: no label skew to blame
    config.write_text(yaml.safe_dump(tiny_raw_config(train, eval_, tmp_path / "skewed", rounds=1,
                                                     client={"lr": 1.0e-7},
                                                     partition={"kind": "dirichlet", "alpha": 0.01})))
    assert main(["run", str(config)]) == 0
    said = json.loads((tmp_path / "skewed" / "summary.json").read_text())["not_learned"]
    assert "clients hold 90% or more of one class" in said and "more rounds first, then `fedpeft tune" in said
    capsys.readouterr()
    config.write_text(yaml.safe_dump(tiny_raw_config(train, eval_, tmp_path / "learns", rounds=10,
                                                     client={"local_epochs": 2})))
    assert main(["run", str(config)]) == 0
    summary = json.loads((tmp_path / "learns" / "summary.json").read_text())
    assert summary["final_metric"] > 0.622 and summary["not_learned"] is None
    assert "not learned" not in capsys.readouterr().out


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_bytes_recorded_equal_message_lengths(toy_files: tuple[Path, Path], tmp_path: Path, dtype: str) -> None:
    train, eval_ = toy_files
    raw = tiny_raw_config(train, eval_, tmp_path / "run", rounds=1, codec={"down": {"dtype": dtype},
                                                                            "up": {"dtype": dtype}})
    engine, records = run(raw)
    exp = engine.exp
    expected_down = len(exp.down_codec.encode(exp.initial_state))
    assert records[0]["bytes_down"] == [expected_down] * 2
    # the uplink message holds exactly the trainable keys, so it has the same size
    assert records[0]["bytes_up"] == [expected_down] * 2
    width = 4 if dtype == "fp32" else 2
    header = int.from_bytes(exp.down_codec.encode(exp.initial_state)[:8], "little")
    assert expected_down == 8 + header + width * exp.trainable_params
    assert records[0]["cum_bytes_up"] == sum(records[0]["bytes_up"])


def test_resume_is_bit_identical(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    train, eval_ = toy_files
    full_raw = tiny_raw_config(train, eval_, tmp_path / "full", rounds=4, strategy={"name": "fedadam",
                                                                                      "server_lr": 0.01},
                               adapter={"dropout": 0.1})
    full_engine, full_records = run(full_raw)

    part_raw = tiny_raw_config(train, eval_, tmp_path / "part", rounds=2, strategy={"name": "fedadam",
                                                                                      "server_lr": 0.01},
                               adapter={"dropout": 0.1})
    run(part_raw)
    part_raw["rounds"] = 4
    resumed_engine, resumed_records = run(part_raw, resume=True)

    assert without_timing(resumed_records) == without_timing(full_records)
    assert without_timing(load_metrics(tmp_path / "part")) == without_timing(full_records)
    for key, value in full_engine.final_state.items():
        assert torch.equal(value, resumed_engine.final_state[key]), key


def test_resume_rejects_other_config_and_corrupt_checkpoint(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    train, eval_ = toy_files
    raw = tiny_raw_config(train, eval_, tmp_path / "run", rounds=1)
    run(raw)
    other = tiny_raw_config(train, eval_, tmp_path / "run", rounds=2, adapter={"r": 2}, engine={"threads": 2})
    with pytest.raises(CheckpointError, match="different experiment config") as err:
        run(other, resume=True)
    # the message names what differs (rounds and the transport may change, so they are not listed)
    assert "adapter.r (4 in the run, 2 given)" in str(err.value)
    assert "rounds (" not in str(err.value) and "threads" not in str(err.value)
    (tmp_path / "run" / "checkpoint.pt").write_bytes(b"not a checkpoint")
    raw["rounds"] = 2
    with pytest.raises(CheckpointError, match="corrupt"):
        run(raw, resume=True)


def test_a_run_from_before_model_pooling_exports_and_resumes(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    """Runs written before ``model.pooling`` existed trained with the head; their config.yaml lacks the key
    and their fingerprint was hashed without it. They still export and resume (given the head)."""
    import hashlib

    import yaml

    from fedpeft.export import read_run
    from fedpeft.metrics.recorder import resume_fields

    train, eval_ = toy_files
    raw = tiny_raw_config(train, eval_, tmp_path / "run", rounds=1, model={"pooling": "head"})
    engine, _ = run(raw)
    run_dir = tmp_path / "run"
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    del saved["model"]["pooling"]  # what the code of that time wrote
    (run_dir / "config.yaml").write_text(yaml.safe_dump(saved))
    old_fields = resume_fields(build_config(raw))
    del old_fields["model"]["pooling"]
    checkpoint = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    checkpoint["fingerprint"] = hashlib.sha256(json.dumps(old_fields, sort_keys=True).encode()).hexdigest()
    torch.save(checkpoint, run_dir / "checkpoint.pt")

    loaded = read_run(run_dir)
    assert loaded.cfg.model.pooling == "head" and loaded.backbone.pooling == "head"
    for key, value in engine.final_state.items():
        assert torch.equal(loaded.backbone.model.state_dict()[key], value), key
    today = dict(raw, model={k: v for k, v in raw["model"].items() if k != "pooling"}, rounds=2)
    with pytest.raises(CheckpointError, match=r"model.pooling \('head' in the run, 'auto' given\)"):
        run(today, resume=True)  # a config without the key means auto today: named, not silently resumed
    _, records = run(dict(raw, rounds=2), resume=True)
    assert [r["round"] for r in records] == [1, 2]


def test_cli_run_and_refuse_overwrite(toy_files: tuple[Path, Path], tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    import yaml

    train, eval_ = toy_files
    raw = tiny_raw_config(train, eval_, tmp_path / "run", rounds=2)
    config = tmp_path / "exp.yaml"
    config.write_text(yaml.safe_dump(raw))
    overrides = ["--set", "strategy.name=fedprox", "--set", "strategy.proximal_mu=0.01"]
    assert main(["run", str(config), "--plot", *overrides]) == 0
    assert (tmp_path / "run" / "metric.png").stat().st_size > 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["rounds"] == 2 and summary["metric"] == "accuracy"
    assert summary["pooling"] == "head"  # auto on a random tiny BERT: not a sentence encoder
    assert "classifier reads the first token (head)" in " ".join(capsys.readouterr().out.split())
    assert main(["run", str(config)]) == 2  # refuses to overwrite
    assert "already holds a run" in " ".join(capsys.readouterr().out.split())
    assert main(["run", "--resume", str(tmp_path / "run"), "--set", "rounds=3"]) == 0
    assert [r["round"] for r in load_metrics(tmp_path / "run")] == [1, 2, 3]


def test_cross_silo_selects_everyone(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    train, eval_ = toy_files
    raw = tiny_raw_config(train, eval_, tmp_path / "run", rounds=1, strategy={"selection": "all",
                                                                               "clients_per_round": None})
    _, records = run(raw)
    assert records[0]["clients"] == [0, 1, 2, 3]
    assert sum(records[0]["num_samples"]) == 160
