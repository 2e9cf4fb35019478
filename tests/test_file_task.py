"""Generic file tasks (task.name: file) on small files in every supported format."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from fedpeft.config import ConfigError, TaskConfig
from fedpeft.data.tasks import load_task, resolve_data_dir


def _task(**fields: object) -> TaskConfig:
    return TaskConfig(name="file", **fields)


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def test_csv_with_header_one_text_column_string_labels(tmp_path: Path) -> None:
    _write(tmp_path / "train.csv", 'text,label\n"great, really",pos\nawful,neg\n"so ""so""",neutral\n')
    _write(tmp_path / "eval.csv", "text,label\nfine,pos\n")
    task = load_task(_task(train_file="train.csv", eval_file="eval.csv"), data_dir=tmp_path)
    assert task.name == "file" and task.problem_type == "classification"
    assert task.label_names == ("neg", "neutral", "pos")  # sorted unique train labels
    assert [(example.texts, example.label) for example in task.train] == [
        (("great, really",), 2),
        (("awful",), 0),
        (('so "so"',), 1),
    ]
    assert task.eval[0].label == 2
    assert task.metrics == ("accuracy", "f1")


def test_tsv_without_header_columns_by_position(tmp_path: Path) -> None:
    # like CoLA: source, label, original label, sentence; quote characters are plain text in TSV
    _write(tmp_path / "train.tsv", 'src\t1\t\tHe said "hi.\nsrc\t0\t*\tHim went .\n')
    _write(tmp_path / "dev.tsv", "src\t1\t\tShe left .\n")
    cfg = _task(train_file="train.tsv", eval_file="dev.tsv", header=False, text_columns=[3], label_column=1)
    task = load_task(cfg, data_dir=tmp_path)
    assert [(example.texts, example.label) for example in task.train] == [
        (('He said "hi.',), 1),
        (("Him went .",), 0),
    ]
    assert task.label_names == ("0", "1")
    # digits as strings address positions too in a headerless file
    same = load_task(cfg.model_copy(update={"text_columns": ["3"], "label_column": "1"}), data_dir=tmp_path)
    assert same.train == task.train


def test_tsv_with_header_and_bom_pair_of_texts(tmp_path: Path) -> None:
    text = "\ufeffQuality\t#1 String\t#2 String\n1\tA cat .\tA feline .\n0\tA dog .\tA car .\n"
    _write(tmp_path / "train.tsv", text)
    _write(tmp_path / "dev.tsv", text)
    cfg = _task(
        train_file="train.tsv",
        eval_file="dev.tsv",
        text_columns=["#1 String"],
        text_pair_columns=["#2 String"],
        label_column="Quality",
        label_names=["not_equivalent", "equivalent"],
    )
    task = load_task(cfg, data_dir=tmp_path)
    assert task.train[0].texts == ("A cat .", "A feline .")
    assert [example.label for example in task.train] == [1, 0]  # ints taken as ids into label_names
    assert task.label_names == ("not_equivalent", "equivalent")


def test_joined_columns_and_groups_from_json_list(tmp_path: Path) -> None:
    records = [
        {"title": "Hello", "body": "first post", "topic": "a", "user": "u1"},
        {"title": "Bye", "body": "second post", "topic": "b", "user": "u2"},
    ]
    _write(tmp_path / "train.json", json.dumps(records))
    _write(tmp_path / "eval.json", json.dumps(records[:1]))
    cfg = _task(
        train_file="train.json",
        eval_file="eval.json",
        text_columns=["title", "body"],
        join_with=". ",
        label_column="topic",
        group_column="user",
    )
    task = load_task(cfg, data_dir=tmp_path)
    assert task.train[0].texts == ("Hello. first post",)
    assert [example.group for example in task.train] == ["u1", "u2"]


def test_json_object_of_records_like_glue_subsets(tmp_path: Path) -> None:
    records = {
        "0": {"text_a": "q1", "text_b": "s1", "label": "1"},
        "1": {"text_a": "q2", "text_b": "s2", "label": "0"},
    }
    _write(tmp_path / "train.json", json.dumps(records))
    _write(tmp_path / "dev.json", json.dumps(records))
    cfg = _task(
        train_file="train.json", eval_file="dev.json", text_columns=["text_a"], text_pair_columns=["text_b"]
    )
    task = load_task(cfg, data_dir=tmp_path)
    assert [(example.texts, example.label) for example in task.train] == [
        (("q1", "s1"), 1),
        (("q2", "s2"), 0),
    ]


def test_jsonl_ints_starting_at_one(tmp_path: Path) -> None:
    lines = [{"sentence": f"review {index}", "stars": index % 5 + 1} for index in range(10)]
    _write(tmp_path / "train.jsonl", "\n".join(json.dumps(line) for line in lines) + "\n")
    _write(tmp_path / "eval.jsonl", json.dumps({"sentence": "x", "stars": 5}) + "\n")
    task = load_task(_task(train_file="train.jsonl", eval_file="eval.jsonl", label_column="stars"), tmp_path)
    assert task.label_names == ("1", "2", "3", "4", "5")
    assert [example.label for example in task.train[:5]] == [0, 1, 2, 3, 4]
    assert task.eval[0].label == 4
    assert task.train[0].texts == ("review 0",)  # default text column "sentence"


def test_parquet_booleans(tmp_path: Path) -> None:
    frame = pd.DataFrame({"text": ["yes", "no", "maybe"], "is_spam": [True, False, True]})
    frame.to_parquet(tmp_path / "train.parquet")
    frame.to_parquet(tmp_path / "eval.parquet")
    task = load_task(
        _task(train_file="train.parquet", eval_file="eval.parquet", label_column="is_spam"), tmp_path
    )
    assert task.label_names == ("false", "true")
    assert [example.label for example in task.train] == [1, 0, 1]


def test_csv_booleans_with_label_map(tmp_path: Path) -> None:
    _write(tmp_path / "train.csv", "text,spam\na,True\nb,False\n")
    cfg = _task(
        train_file=str(tmp_path / "train.csv"),  # absolute path
        eval_file=str(tmp_path / "train.csv"),
        label_column="spam",
        label_map={"false": 0, "true": 1},
        label_names=["ham", "spam"],
    )
    task = load_task(cfg)
    assert task.label_names == ("ham", "spam")
    assert [example.label for example in task.train] == [1, 0]


def test_label_map_many_to_one(tmp_path: Path) -> None:
    _write(tmp_path / "train.csv", "text,label\na,good\nb,great\nc,bad\n")
    cfg = _task(train_file="train.csv", eval_file="train.csv", label_map={"bad": 0, "good": 1, "great": 1})
    task = load_task(cfg, tmp_path)
    assert task.label_names == ("bad", "good")
    assert [example.label for example in task.train] == [1, 1, 0]


def test_regression_floats(tmp_path: Path) -> None:
    _write(tmp_path / "train.tsv", "s1\ts2\tscore\na\tb\t3.8\nc\td\t0.0\n")
    _write(tmp_path / "dev.tsv", "s1\ts2\tscore\na\tb\t5.000\n")
    cfg = _task(
        train_file="train.tsv",
        eval_file="dev.tsv",
        text_columns=["s1"],
        text_pair_columns=["s2"],
        label_column=2,
    )
    task = load_task(cfg, tmp_path)
    assert task.problem_type == "regression" and task.label_names == ()
    assert [example.label for example in task.train] == [3.8, 0.0]
    assert task.eval[0].label == 5.0
    assert task.metrics == ("pearson", "spearman")
    explicit = load_task(
        cfg.model_copy(update={"problem_type": "regression", "metrics": ["spearman"]}), tmp_path
    )
    assert explicit.metrics == ("spearman",)


def test_eval_label_not_in_label_set(tmp_path: Path) -> None:
    _write(tmp_path / "train.csv", "text,label\na,pos\nb,neg\n")
    _write(tmp_path / "eval.csv", "text,label\nc,neutral\n")
    with pytest.raises(
        ConfigError, match="'neutral' is not in the label set; allowed: 'neg', 'pos'"
    ) as caught:
        load_task(_task(train_file="train.csv", eval_file="eval.csv"), tmp_path)
    assert caught.value.field == "task.label_names"


def test_train_label_not_in_given_names(tmp_path: Path) -> None:
    _write(tmp_path / "train.csv", "text,label\na,pos\nb,meh\n")
    cfg = _task(train_file="train.csv", eval_file="train.csv", label_names=["neg", "pos"])
    with pytest.raises(ConfigError, match="'meh'") as caught:
        load_task(cfg, tmp_path)
    assert caught.value.field == "task.label_names"


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"file not found: nope\.csv") as caught:
        load_task(_task(train_file="nope.csv", eval_file="nope.csv"), tmp_path)
    assert caught.value.field == "task.train_file"


def test_unknown_column_lists_available(tmp_path: Path) -> None:
    _write(tmp_path / "train.csv", "review,label\na,1\n")
    with pytest.raises(ConfigError, match=r"unknown column 'text' .* columns 'review', 'label'") as caught:
        load_task(_task(train_file="train.csv", eval_file="train.csv", text_columns=["text"]), tmp_path)
    assert caught.value.field == "task.text_columns"
    with pytest.raises(ConfigError, match="unknown column 5") as caught:
        load_task(
            _task(train_file="train.csv", eval_file="train.csv", text_columns=[0], label_column=5), tmp_path
        )
    assert caught.value.field == "task.label_column"


def test_unknown_metric_and_format(tmp_path: Path) -> None:
    _write(tmp_path / "train.csv", "text,label\na,1\n")
    _write(tmp_path / "train.xml", "<a/>")
    with pytest.raises(ConfigError, match="allowed: accuracy") as caught:
        load_task(_task(train_file="train.csv", eval_file="train.csv", metrics=["bleu"]), tmp_path)
    assert caught.value.field == "task.metrics"
    with pytest.raises(ConfigError, match=r"set task\.format") as caught:
        load_task(_task(train_file="train.xml", eval_file="train.xml"), tmp_path)
    assert caught.value.field == "task.format"


def test_max_examples_subsample_is_fixed_and_sees_every_class(tmp_path: Path) -> None:
    rows = [f"t{index},{'a' if index < 95 else 'b'}" for index in range(100)]  # sorted by label
    _write(tmp_path / "train.csv", "text,label\n" + "\n".join(rows) + "\n")
    cfg = _task(train_file="train.csv", eval_file="train.csv", max_train_examples=4, max_eval_examples=2)
    first = load_task(cfg, tmp_path)
    assert len(first.train) == 4 and len(first.eval) == 2
    assert {example.label for example in first.train} == {0, 1}
    assert {example.label for example in first.eval} == {0, 1}
    assert load_task(cfg, tmp_path).train == first.train


def test_unknown_task_name() -> None:
    with pytest.raises(ConfigError, match="unknown task 'sst3'; allowed: sst2, cola") as caught:
        load_task(TaskConfig(name="sst3"), Path("."))
    assert caught.value.field == "task.name"


def test_hf_without_datasets_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "datasets", None)  # import fails even when installed
    with pytest.raises(ConfigError, match="pip install datasets"):
        load_task(TaskConfig(name="hf", hf_dataset="glue", hf_config="sst2"))


def test_resolve_data_dir_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    explicit, from_env = tmp_path / "explicit", tmp_path / "env"
    explicit.mkdir()
    from_env.mkdir()
    monkeypatch.setenv("FEDPEFT_DATA", str(from_env))
    assert resolve_data_dir(str(explicit)) == explicit.resolve()
    assert resolve_data_dir() == from_env.resolve()
    with pytest.raises(ConfigError, match="does not exist") as caught:
        resolve_data_dir(str(tmp_path / "missing"))
    assert caught.value.field == "task.data_dir"
