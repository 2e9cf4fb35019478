"""The validation split: carved from training data before partitioning, stratified, fixed; the
centralised partition; 1-based labels; `fedpeft data CONFIG`."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import yaml

from fedpeft.config import ConfigError, build_config
from fedpeft.data.validation import validation_indices
from fedpeft.experiment import load_data
from tests.conftest import tiny_raw_config


def _texts(examples: list) -> set[str]:
    return {ex.texts[0] for ex in examples}


def test_validation_rows_never_reach_a_shard_nor_the_eval_split(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    train, eval_ = toy_files
    raw = tiny_raw_config(train, eval_, tmp_path / "run", task={"validation_fraction": 0.25})
    task, shards = load_data(build_config(raw))
    assert len(task.validation) == 40 and len(task.train) == 120  # 25% of 160, stratified
    in_shards = {i for shard in shards for i in shard.tolist()}
    assert in_shards == set(range(len(task.train)))  # every shard index points into the remaining train set
    shard_texts = [task.train[i].texts[0] for i in in_shards]
    held = [ex.texts[0] for ex in task.validation]
    # the toy files repeat sentences, so compare multisets of the original rows, not strings
    full = load_data(build_config(tiny_raw_config(train, eval_, tmp_path / "r2")))[0]
    assert Counter(shard_texts) + Counter(held) == Counter(ex.texts[0] for ex in full.train)
    assert [ex.texts for ex in task.eval] == [ex.texts for ex in full.eval]  # eval untouched


def test_validation_split_is_stratified_and_deterministic() -> None:
    labels = [0] * 90 + [1] * 30 + [2] * 10
    first = validation_indices(labels, 0.2)
    assert Counter(labels[i] for i in first) == {0: 18, 1: 6, 2: 2}
    assert np.array_equal(first, validation_indices(labels, 0.2))
    assert not np.array_equal(first, validation_indices(labels, 0.2, seed=1))


def test_validation_fraction_bad_values() -> None:
    for bad in (0, 1, 1.5, -0.1):
        with pytest.raises(ConfigError, match=r"task\.validation_fraction"):
            build_config({"task": {"name": "sst2", "validation_fraction": bad}})
    with pytest.raises(ConfigError, match=r"task.validation_fraction: .* class 1 leaves it no training example"):
        validation_indices([0, 0, 0, 0, 1], 0.6)
    with pytest.raises(ConfigError, match=r"task\.validation_file"):
        build_config({"task": {"name": "file", "validation_fraction": 0.1, "validation_file": "v.csv"}})
    with pytest.raises(ConfigError, match=r"evaluation\.splits"):
        build_config({"evaluation": {"splits": ["validation"]}})


def test_validation_file_uses_the_training_label_set(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    train, eval_ = toy_files
    raw = tiny_raw_config(train, eval_, tmp_path / "run", task={"validation_file": str(eval_)})
    task, _ = load_data(build_config(raw))
    assert len(task.validation) == 64 and len(task.train) == 160
    bad = tmp_path / "bad.csv"
    bad.write_text("text,label\nfoo,maybe\n")
    raw = tiny_raw_config(train, eval_, tmp_path / "run", task={"validation_file": str(bad)})
    with pytest.raises(ConfigError, match=r"task\.label_names"):
        load_data(build_config(raw))


def test_run_scores_validation_each_round(toy_files: tuple[Path, Path], tmp_path: Path, single_torch_thread: None
                                          ) -> None:
    from rich.console import Console

    from fedpeft.engines import run_and_report
    from fedpeft.engines.local import LocalEngine
    from fedpeft.experiment import prepare

    train, eval_ = toy_files
    raw = tiny_raw_config(train, eval_, tmp_path / "run", rounds=2, task={"validation_fraction": 0.25})
    cfg = build_config(raw)
    engine = LocalEngine(prepare(cfg), tmp_path / "run", Console(quiet=True))
    run_and_report(engine, Console(quiet=True))
    records = engine.recorder.records
    assert all(set(r["validation"]) == {"accuracy", "f1"} and r["validation_examples"] == 40 for r in records)
    assert all(r["eval_examples"] == 64 for r in records)
    only = build_config({**raw, "evaluation": {"splits": ["validation"]},
                         "output": {"run_dir": str(tmp_path / "v"), "progress": False}})
    engine = LocalEngine(prepare(only), tmp_path / "v", Console(quiet=True))
    records = engine.run()
    assert all(r["eval"] == {} and "validation" in r for r in records)


def test_centralized_partition_is_one_client_one_epoch(toy_files: tuple[Path, Path], tmp_path: Path) -> None:
    train, eval_ = toy_files
    raw = tiny_raw_config(train, eval_, tmp_path / "run", partition={"kind": "centralized", "num_clients": 4},
                          client={"local_steps": 3}, strategy={"fraction": 0.5})
    cfg = build_config(raw)
    assert cfg.partition.num_clients == 1 and cfg.clients_per_round() == 1
    assert cfg.client.local_steps is None and cfg.client.local_epochs == 1
    task, shards = load_data(cfg)
    assert len(shards) == 1 and len(shards[0]) == len(task.train)
    # a recipe asking for 10 clients per round still gets its centralised reference
    assert build_config({"method": "flasc", "partition": {"kind": "centralized"}}).clients_per_round() == 1


def test_one_based_integer_labels_map_to_names(tmp_path: Path) -> None:
    from fedpeft.data.tasks import load_task

    for name in ("train.csv", "eval.csv"):
        (tmp_path / name).write_text("text,label\n" + "".join(f"t{i},{1 + i % 3}\n" for i in range(9)))
    cfg = build_config({"task": {"name": "file", "train_file": str(tmp_path / "train.csv"),
                                 "eval_file": str(tmp_path / "eval.csv"), "text_columns": ["text"],
                                 "label_column": "label", "label_names": ["a", "b", "c"]}})
    task = load_task(cfg.task)
    assert [ex.label for ex in task.train[:4]] == [0, 1, 2, 0]
    assert task.label_names == ("a", "b", "c")


def test_data_command_accepts_a_config(toy_files: tuple[Path, Path], tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    from fedpeft.cli import main

    train, eval_ = toy_files
    raw = tiny_raw_config(train, eval_, tmp_path / "run", partition={"kind": "dirichlet", "alpha": 0.3,
                                                                     "num_clients": 5},
                          task={"validation_fraction": 0.1})
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert main(["data", str(path)]) == 0
    out = capsys.readouterr().out
    assert "144 train / 64 eval / 16 validation" in out
    assert "dirichlet" in out
    assert main(["data", str(path), "--set", "partition.num_clients=500"]) == 2
