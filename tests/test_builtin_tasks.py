"""Every built-in task loads its real file with the row counts of data/README.md."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from fedpeft.config import ConfigError, TaskConfig
from fedpeft.data.tasks import (
    BUILTIN_TASKS,
    NEWSGROUPS,
    WNUT17_TAGS,
    load_task,
    resolve_data_dir,
    strip_newsgroup_metadata,
)

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def data_dir() -> Path:
    try:
        return resolve_data_dir()
    except ConfigError as err:
        pytest.skip(f"benchmark data folder not found ({err}); set FEDPEFT_DATA to run these tests")


# (task, eval_split) -> (train rows, eval rows, number of distinct train labels, or the problem type)
EXPECTED = {
    ("sst2", None): (67_349, 872, 2),
    ("cola", None): (8_551, 1_043, 2),
    ("mrpc", None): (3_667, 408, 2),  # train.tsv lacks one pair of the standard 3,668
    ("rte", None): (2_490, 277, 2),
    ("stsb", None): (5_749, 1_500, "regression"),
    ("mnli", None): (8_999, 1_000, 3),
    ("mnli", "official_dev"): (8_999, 9_815, 3),
    ("qnli", None): (8_999, 1_000, 2),
    ("qnli", "official_dev"): (8_999, 5_463, 2),
    ("qqp", None): (8_999, 1_000, 2),
    ("snli", None): (8_999, 1_000, 3),
    ("20newsgroups", None): (11_314, 7_532, 20),
    ("mr", None): (7_795, 867, 2),
    ("mr", "test"): (7_795, 2_000, 2),
    ("mpqa", None): (7_742, 861, 2),
    ("mpqa", "test"): (7_742, 2_000, 2),
    ("sst5", None): (7_689, 855, 5),
    ("sst5", "test"): (7_689, 2_210, 5),
    ("cb", None): (250, 56, 3),
    ("copa", None): (400, 100, 2),
    ("superglue_rte", None): (2_490, 277, 2),
    # E2E: one training row per (MR, reference); one evaluation row per MR, scored against all its references
    ("e2e_nlg", None): (4_672, 630, "generation"),
    # sentences of the CoNLL files
    ("wnut17", None): (3_394, 1_009, "token_classification"),
    ("wnut17", "test"): (3_394, 1_287, "token_classification"),
    # questions: the 48 articles of SQuAD v1.1 dev, 39 train / 9 eval by title; XQuAD's 1,190 (the 3 training
    # questions are a tiny SQuAD-format file of other articles, written by the test: xquad reads task.train_file)
    ("squad", None): (9_231, 1_339, "extractive_qa"),
    ("xquad", None): (3, 1_190, "extractive_qa"),
}


def _other_articles(path: Path) -> str:
    """A SQuAD-format training file sharing nothing with SQuAD dev / XQuAD (for the xquad task)."""
    context = "Kepler launched in 2009 and watched one patch of sky."
    qas = [{"id": str(i), "question": question, "answers": [{"text": answer, "answer_start": context.index(answer)}]}
           for i, (question, answer) in enumerate([("When did Kepler launch?", "2009"), ("What launched?", "Kepler"),
                                                   ("What did it watch?", "one patch of sky")])]
    path.write_text(json.dumps({"data": [{"title": "Kepler", "paragraphs": [{"context": context, "qas": qas}]}]}))
    return str(path)


def test_every_builtin_task_is_covered() -> None:
    assert {name for name, _split in EXPECTED} == set(BUILTIN_TASKS)


@pytest.mark.parametrize(("name", "eval_split"), list(EXPECTED), ids=lambda value: str(value))
def test_builtin_task_row_counts(data_dir: Path, tmp_path: Path, name: str, eval_split: str | None) -> None:
    train_rows, eval_rows, num_classes = EXPECTED[(name, eval_split)]
    train_file = _other_articles(tmp_path / "train.json") if name == "xquad" else None
    task = load_task(TaskConfig(name=name, eval_split=eval_split, train_file=train_file), data_dir)
    assert (len(task.train), len(task.eval)) == (train_rows, eval_rows)
    assert task.metrics == BUILTIN_TASKS[name].metrics
    if num_classes == "regression":
        assert task.problem_type == "regression"
        assert all(0.0 <= example.label <= 5.0 for example in task.train + task.eval)
    elif num_classes == "generation":
        assert task.problem_type == "generation"
        assert sum(len(example.references) for example in task.eval) == 4_693  # every reference of the test set
        assert all(len(example.references) == 1 for example in task.train)
    elif num_classes == "token_classification":
        assert task.label_names == WNUT17_TAGS
        assert all(len(example.words) == len(example.tags) > 0 for example in task.train + task.eval)
        assert all(0 <= example.label < len(task.example_classes) for example in task.train + task.eval)
    elif num_classes == "extractive_qa":
        assert all(example.texts[1][start : start + len(text)] == text for example in task.train + task.eval
                   for text, start in zip(example.references, example.answer_starts, strict=True))
        assert {example.group for example in task.train}.isdisjoint({example.group for example in task.eval})
    else:
        assert len(Counter(example.label for example in task.train)) == num_classes
        assert all(0 <= example.label < len(task.label_names) for example in task.train + task.eval)
    assert all(
        example.texts and all(isinstance(text, str) for text in example.texts) for example in task.train
    )


def test_glue_label_mapping(data_dir: Path) -> None:
    rte = load_task(TaskConfig(name="rte"), data_dir)
    assert rte.train[0].texts[0] == "No Weapons of Mass Destruction Found in Iraq Yet."
    assert rte.label_names[rte.train[0].label] == "not_entailment"
    mnli = load_task(TaskConfig(name="mnli", eval_split="official_dev"), data_dir)
    assert Counter(mnli.label_names[example.label] for example in mnli.eval) == {
        "entailment": 3479,
        "contradiction": 3213,
        "neutral": 3123,
    }
    qqp = load_task(TaskConfig(name="qqp"), data_dir)
    assert Counter(example.label for example in qqp.train) == {0: 5747, 1: 3252}


def test_stsb_keeps_quote_characters(data_dir: Path) -> None:
    task = load_task(TaskConfig(name="stsb"), data_dir)
    assert task.train[0].texts == ("A plane is taking off.", "An air plane is taking off.")
    assert task.train[0].label == 5.0
    assert any('"' in text for example in task.train for text in example.texts)


def test_copa_is_multiple_choice(data_dir: Path) -> None:
    task = load_task(TaskConfig(name="copa"), data_dir)
    first = task.train[0]
    assert task.problem_type == "multiple_choice"
    assert first.texts == ("My body cast a shadow over the grass because",)
    assert first.choices == ("the sun was rising.", "the grass was cut.")
    assert first.label == 0


def test_newsgroups_stripping_and_subsample(data_dir: Path) -> None:
    limits = {"max_train_examples": 40, "max_eval_examples": 50}
    stripped = load_task(TaskConfig(name="20newsgroups", **limits), data_dir)
    raw = load_task(TaskConfig(name="20newsgroups", strip_newsgroup_metadata=False, **limits), data_dir)
    assert stripped.label_names == NEWSGROUPS
    assert len(stripped.train) == 40 and len(stripped.eval) == 50
    assert len({example.label for example in stripped.train}) == 20  # the subsample sees every class
    assert all(
        "\nSubject:" in example.texts[0] or example.texts[0].startswith("Subject:") for example in raw.eval
    )
    assert [example.label for example in raw.eval] == [example.label for example in stripped.eval]
    assert [strip_newsgroup_metadata(example.texts[0]) for example in raw.eval] == [
        example.texts[0] for example in stripped.eval
    ]


def test_unknown_eval_split(data_dir: Path) -> None:
    with pytest.raises(ConfigError, match="allowed: dev, official_dev") as caught:
        load_task(TaskConfig(name="mnli", eval_split="test"), data_dir)
    assert caught.value.field == "task.eval_split"
