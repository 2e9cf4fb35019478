"""Token classification: CoNLL reading, sub-token alignment, BIO decoding, seqeval metrics, partition
classes (FeDeRA App. A.2), learning on a tiny encoder, and the recipes that cannot apply."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedpeft.config import ConfigError, TaskConfig, build_config
from fedpeft.data.conll import read_conll, sentence_class
from fedpeft.data.partition import partition_indices
from fedpeft.data.tasks import WNUT17_TAGS, load_task
from fedpeft.engines.local import LocalEngine
from fedpeft.experiment import prepare
from fedpeft.metrics.entity import entity_scores
from fedpeft.models.token_tagging import (
    IGNORE_INDEX,
    TokenTagging,
    align_labels,
    continuation_tags,
    encode_tagging,
    first_subtoken_scores,
    greedy_bio_decode,
)
from tests.conftest import SHARED_DATA, tiny_per_token_config

pytestmark = pytest.mark.usefixtures("single_torch_thread")

TAGS = ("O", "B-location", "I-location", "B-person", "I-person")
PEOPLE = [["alice"], ["bob", "smith"], ["carol"], ["dave", "lee"], ["erin"]]
PLACES = [["new", "york"], ["paris"], ["los", "angeles"], ["rome"]]
FILLER = ["i", "met", "today", "in", "the", "park", "and", "went", "home", "with", "later", "saw"]


def write_toy_conll(path: Path, n: int, seed: int) -> Path:
    """Sentences of filler words, person names (B-person) and places (B-/I-location), CoNLL style
    (a sentence ends at an empty line or, as in WNUT's train file, a line holding one tab)."""
    rng = random.Random(seed)
    lines = []
    for index in range(n):
        for _ in range(rng.randint(3, 7)):
            draw = rng.random()
            if draw < 0.35:
                kind, words = ("person", rng.choice(PEOPLE)) if draw < 0.2 else ("location", rng.choice(PLACES))
                lines += [f"{word}\t{'B' if i == 0 else 'I'}-{kind}" for i, word in enumerate(words)]
            else:
                lines.append(f"{rng.choice(FILLER)}\tO")
        lines.append("\t" if index % 2 else "")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def ner_raw(tmp_path: Path, method: str = "full", **sections: Any) -> dict[str, Any]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    task = {"problem_type": "token_classification",
            "train_file": str(write_toy_conll(tmp_path / "train.conll", 160, 0)),
            "eval_file": str(write_toy_conll(tmp_path / "eval.conll", 40, 1))}
    return tiny_per_token_config(tmp_path, method, task, **sections)


# ---------------------------------------------------------------------------------------------
# Reading CoNLL files


def test_read_conll_blank_and_tab_lines_docstart_and_columns(tmp_path: Path) -> None:
    path = tmp_path / "a.conll"
    path.write_text("-DOCSTART- -X- O O\n\nEU NNP B-NP B-ORG\nrejects VBZ B-VP O\n \nPeter NNP B-NP B-PER\n"
                    "\t\nBlackburn NNP B-NP B-LOC\n", encoding="utf-8")
    assert read_conll(path, "task.train_file") == [
        (["EU", "rejects"], ["B-ORG", "O"]), (["Peter"], ["B-PER"]), (["Blackburn"], ["B-LOC"])]
    assert read_conll(path, "task.train_file", tag_column=1)[0][1] == ["NNP", "VBZ"]
    with pytest.raises(ConfigError, match="column 7") as caught:
        read_conll(path, "task.train_file", tag_column=7)
    assert caught.value.field == "task.train_file"


def test_file_task_tag_set_and_bad_tags(tmp_path: Path) -> None:
    train = write_toy_conll(tmp_path / "train.conll", 30, 0)
    task = load_task(TaskConfig(name="file", problem_type="token_classification", train_file=str(train),
                                eval_file=str(train)))
    assert task.label_names == TAGS  # O first, then by type, B- before I-
    assert task.metrics[0] == "entity_f1" and task.num_labels == 5
    assert all(len(example.words) == len(example.tags) for example in task.train)
    (tmp_path / "bad.conll").write_text("rome\tB-city\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="'B-city' is not in the tag set") as caught:
        load_task(TaskConfig(name="file", problem_type="token_classification", train_file=str(train),
                             eval_file=str(tmp_path / "bad.conll")))
    assert caught.value.field == "task.label_names"
    (tmp_path / "iobes.conll").write_text("rome\tS-LOC\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="not BIO"):
        load_task(TaskConfig(name="file", problem_type="token_classification", train_file=str(tmp_path / "iobes.conll"),
                             eval_file=str(train)))
    with pytest.raises(ConfigError, match="CoNLL") as caught:
        load_task(TaskConfig(name="file", problem_type="token_classification", train_file=str(train),
                             eval_file=str(train), format="csv"))
    assert caught.value.field == "task.format"


# ---------------------------------------------------------------------------------------------
# Sub-token alignment


def test_align_labels_first_subtoken_and_all_subtokens() -> None:
    tags = [1, 3, 0]  # B-location, B-person, O
    word_ids = [None, 0, 0, 1, 1, 1, 2, None]
    assert align_labels(word_ids, tags) == [IGNORE_INDEX, 1, IGNORE_INDEX, 3, IGNORE_INDEX, IGNORE_INDEX, 0,
                                            IGNORE_INDEX]
    continuation = continuation_tags(TAGS)
    assert continuation == [0, 2, 2, 4, 4]  # B-X -> I-X, everything else unchanged
    assert align_labels(word_ids, tags, label_all=True, continuation=continuation) == [
        IGNORE_INDEX, 1, 2, 3, 4, 4, 0, IGNORE_INDEX]


def test_alignment_on_hand_made_sentences(minilm_tokenizer: Any) -> None:
    from fedpeft.data.types import Example

    sentences = [(["Pxleyes", "loves", "New", "York"], [3, 0, 1, 2]), (["Toy", "story", "3"], [0, 0, 0])]
    examples = [Example(texts=(" ".join(w),), label=None, words=tuple(w), tags=tuple(t)) for w, t in sentences]
    features, tagging = encode_tagging(examples, minilm_tokenizer, TAGS, max_length=16)
    tokens = minilm_tokenizer.convert_ids_to_tokens(features[0]["input_ids"])
    assert tokens == ["[CLS]", "p", "##xley", "##es", "loves", "new", "york", "[SEP]"]
    assert features[0]["labels"] == [IGNORE_INDEX, 3, IGNORE_INDEX, IGNORE_INDEX, 0, 1, 2, IGNORE_INDEX]
    assert features[1]["labels"] == [IGNORE_INDEX, 0, 0, 0, IGNORE_INDEX]
    assert tagging.gold[0] == ["B-person", "O", "B-location", "I-location"]
    every, _ = encode_tagging(examples, minilm_tokenizer, TAGS, max_length=16, label_all=True)
    assert every[0]["labels"] == [IGNORE_INDEX, 3, 4, 4, 0, 1, 2, IGNORE_INDEX]
    # truncation drops the last words' tokens; they are scored as O against the full gold sequence
    short, cut = encode_tagging(examples, minilm_tokenizer, TAGS, max_length=5)
    assert short[0]["labels"] == [IGNORE_INDEX, 3, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX]
    scores = np.zeros((5, len(TAGS)))
    scores[1, 3] = 5.0
    assert cut.predict(0, scores) == ["B-person", "O", "O", "O"]


# ---------------------------------------------------------------------------------------------
# Decoding and metrics


def test_seqeval_entity_scores_on_a_known_example() -> None:
    gold = [["O", "O", "B-MISC", "I-MISC", "B-MISC", "O", "O"], ["B-PER", "I-PER", "O"]]
    predicted = [["O", "O", "B-MISC", "I-MISC", "B-MISC", "I-MISC", "O"], ["B-PER", "I-PER", "O"]]
    scores = entity_scores(gold, predicted)
    # gold entities MISC[2:4], MISC[4:5], PER[0:2]; predicted MISC[2:4], MISC[4:6], PER[0:2]: 2 of 3 right
    assert scores["entity_precision"] == pytest.approx(2 / 3)
    assert scores["entity_recall"] == pytest.approx(2 / 3)
    assert scores["entity_f1"] == pytest.approx(2 / 3)
    assert scores["tag_accuracy"] == pytest.approx(9 / 10)
    # a stray I- starts an entity (conlleval): I-PER alone is the PER entity
    assert entity_scores([["B-PER", "O"]], [["I-PER", "O"]])["entity_f1"] == 1.0
    assert entity_scores([["B-PER", "O"]], [["O", "O"]])["entity_f1"] == 0.0


def test_greedy_bio_decoding_argmax_and_constrained() -> None:
    nan = np.full(len(TAGS), np.nan)
    scores = np.array([
        [0.0, 0.0, 0.0, 0.0, 2.0],  # I-person after O: argmax keeps it, constrained picks the best allowed
        [0.0, 1.0, 0.0, 0.0, 0.0],  # B-location
        [0.0, 0.0, 3.0, 0.0, 0.0],  # I-location after B-location: allowed
        [1.0, 0.0, 0.0, 0.0, 4.0],  # I-person after I-location: not allowed -> O (1.0) over B-* (0.0)
        nan,                         # a word without tokens
    ])
    assert greedy_bio_decode(scores, TAGS) == ["I-person", "B-location", "I-location", "I-person", "O"]
    assert greedy_bio_decode(scores, TAGS, "constrained") == ["O", "B-location", "I-location", "O", "O"]


def test_first_subtoken_scores_pick_each_words_first_token() -> None:
    scores = np.arange(6 * 2, dtype=float).reshape(6, 2)
    words = first_subtoken_scores(scores, [None, 0, 0, 1, 2, None], num_words=4)
    assert words[:3].tolist() == [[2.0, 3.0], [6.0, 7.0], [8.0, 9.0]]
    assert np.isnan(words[3]).all()
    tagging = TokenTagging(("O", "B-X"), [[None, 0, 0, 1, None]], [2], [["B-X", "O"]])
    perfect = np.array([[0, 0], [0, 9], [9, 0], [9, 0], [0, 0]], dtype=float)
    assert tagging.score([0], [perfect], ("entity_f1",)) == {"entity_f1": 1.0}


# ---------------------------------------------------------------------------------------------
# Partition classes (FeDeRA App. A.2)


def test_sentence_classes_follow_table_6() -> None:
    assert sentence_class(["O"] * 9) == "O"
    assert sentence_class(["B-corporation"] + ["O"] * 11) == "B-corporation"
    assert sentence_class(["B-creative-work", "I-creative-work", "I-creative-work", "O"]) == \
        "B-creative-work I-creative-work"
    tags = ["O", "B-person", "I-person", "O", "B-location", "I-location", "B-person"]
    assert sentence_class(tags) == "B-location I-location B-person I-person"
    assert sentence_class(tags, "entity_types") == "location person"


def test_dirichlet_split_over_label_set_classes(tmp_path: Path) -> None:
    train = write_toy_conll(tmp_path / "train.conll", 200, 0)
    task = load_task(TaskConfig(name="file", problem_type="token_classification", train_file=str(train),
                                eval_file=str(train)))
    assert task.example_classes[0] == "O"
    for example in task.train:
        assert task.example_classes[example.label] == sentence_class([task.label_names[t] for t in example.tags])
    from fedpeft.config import PartitionConfig

    labels = [example.label for example in task.train]
    skewed = partition_indices(labels, PartitionConfig(kind="dirichlet", alpha=0.05, num_clients=5), seed=0)
    assert sorted(np.concatenate(skewed).tolist()) == list(range(len(labels)))
    # with a small alpha most classes live on one or two clients
    holders = [sum(1 for shard in skewed if any(labels[i] == c for i in shard)) for c in set(labels)]
    assert np.mean(holders) < 2.5
    by_type = load_task(TaskConfig(name="file", problem_type="token_classification", train_file=str(train),
                                   eval_file=str(train), token_class_by="entity_types"))
    assert set(by_type.example_classes) <= {"O", "location", "person", "location person"}


# ---------------------------------------------------------------------------------------------
# End to end


def test_tiny_encoder_learns_toy_ner(tmp_path: Path) -> None:
    exp = prepare(build_config(ner_raw(tmp_path)))
    assert exp.backbone.head == "token_classification"
    records = LocalEngine(exp, tmp_path / "run").run()
    losses = [r["train_loss"] for r in records if r["round"] > 0]
    assert losses[-1] < 0.5 * losses[0]
    assert records[-1]["eval"]["entity_f1"] > records[0]["eval"]["entity_f1"] + 0.4
    assert set(records[-1]["eval"]) == {"entity_f1", "entity_precision", "entity_recall", "tag_accuracy"}


def test_recipes_that_cannot_apply_say_so(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="hidden x hidden head layer") as caught:
        prepare(build_config(ner_raw(tmp_path, "fedtt", adapter={"tt_classifier": True})))
    assert caught.value.field == "adapter.tt_classifier"
    with pytest.raises(ConfigError, match="needs the token_classification head") as caught:
        prepare(build_config(ner_raw(tmp_path, "lora", model={"head": "masked_lm"})))
    assert caught.value.field == "model.head"
    with pytest.raises(ConfigError, match="needs an encoder model") as caught:
        prepare(build_config(ner_raw(tmp_path, "lora", model={"name": "tiny-gpt2"})))
    assert caught.value.field == "model.name"
    with pytest.raises(ConfigError, match="reads CoNLL") as caught:
        prepare(build_config(ner_raw(tmp_path, task={"name": "hf", "hf_dataset": "wnut_17"})))
    assert caught.value.field == "task.problem_type"


# ---------------------------------------------------------------------------------------------
# Real data


@pytest.mark.real
@pytest.mark.skipif(not (SHARED_DATA / "ner" / "wnut17").is_dir(), reason="no WNUT 2017 files")
def test_wnut17_files_tags_and_classes() -> None:
    task = load_task(TaskConfig(name="wnut17"), SHARED_DATA)
    assert (len(task.train), len(task.eval)) == (3_394, 1_009)
    assert task.label_names == WNUT17_TAGS and len(WNUT17_TAGS) == 13
    counts = Counter(WNUT17_TAGS[tag] for example in task.train for tag in example.tags)
    assert counts["B-person"] == 660 and counts["O"] == 59_570 and sum(counts.values()) == 62_730
    train_classes = {example.label for example in task.train}
    assert len(train_classes) == 79
    assert Counter(task.example_classes[example.label] for example in task.train)["O"] == 2_166
    by_type = load_task(TaskConfig(name="wnut17", token_class_by="entity_types"), SHARED_DATA)
    assert len({example.label for example in by_type.train}) == 31
    test = load_task(TaskConfig(name="wnut17", eval_split="test"), SHARED_DATA)
    assert len(test.eval) == 1_287
