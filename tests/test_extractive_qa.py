"""Extractive QA: SQuAD files, the title split and XQuAD guard, windows with offsets, post-processing,
SQuAD's EM/F1, and learning on a tiny encoder."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedpeft.config import ConfigError, TaskConfig, build_config
from fedpeft.data.squad import read_squad, split_by_title
from fedpeft.data.tasks import load_task
from fedpeft.data.types import Example
from fedpeft.engines.local import LocalEngine
from fedpeft.experiment import prepare
from fedpeft.metrics.squad import exact_match, normalize_answer, squad_scores, token_f1
from fedpeft.models.span_qa import NOT_CONTEXT, SpanAnswers, best_span, encode_qa, span_targets
from tests.conftest import SHARED_DATA, tiny_per_token_config

pytestmark = pytest.mark.usefixtures("single_torch_thread")

THINGS = ["car", "house", "boat", "kite", "hat", "lamp", "door"]
COLORS = ["red", "green", "blue", "yellow", "black", "white"]


def toy_articles(n: int, seed: int, prefix: str, articles: int = 4) -> list[dict[str, Any]]:
    """SQuAD-format articles: each paragraph says the colour of three things; a question asks one."""
    rng = random.Random(seed)
    data: list[dict[str, Any]] = [{"title": f"{prefix}{a}", "paragraphs": []} for a in range(articles)]
    seen: set[str] = set()
    while sum(len(article["paragraphs"]) for article in data) < n:
        things = rng.sample(THINGS, 3)
        colors = [rng.choice(COLORS) for _ in things]
        context = f"{prefix} story . " + " ".join(f"the {t} is {c} ." for t, c in zip(things, colors))
        if context in seen:
            continue
        seen.add(context)
        k = rng.randrange(3)
        start = context.index(f"the {things[k]} is ") + len(f"the {things[k]} is ")
        qa = {"id": f"{prefix}{len(seen)}", "question": f"what color is the {things[k]} ?",
              "answers": [{"text": colors[k], "answer_start": start}]}
        data[len(seen) % articles]["paragraphs"].append({"context": context, "qas": [qa]})
    return data


def write_squad(path: Path, articles: list[dict[str, Any]]) -> Path:
    path.write_text(json.dumps({"version": "1.1", "data": articles}), encoding="utf-8")
    return path


def qa_raw(tmp_path: Path, method: str = "full", **sections: Any) -> dict[str, Any]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    task = {"problem_type": "extractive_qa", "doc_stride": 6,
            "train_file": str(write_squad(tmp_path / "train.json", toy_articles(160, 0, "train"))),
            "eval_file": str(write_squad(tmp_path / "eval.json", toy_articles(40, 1, "eval")))}
    return tiny_per_token_config(tmp_path, method, task, **sections)


def _example(question: str, context: str, answers: list[str]) -> Example:
    return Example(texts=(question, context), label=None, group="t", references=tuple(answers),
                   answer_starts=tuple(context.index(answer) for answer in answers))


# ---------------------------------------------------------------------------------------------
# SQuAD v1.1 metric


def test_official_normalisation_cases() -> None:
    assert normalize_answer("The Denver Broncos!") == "denver broncos"
    assert normalize_answer("  an   apple,  a day ") == "apple day"
    assert normalize_answer("Theatre and anthem") == "theatre and anthem"  # articles only as whole words
    assert normalize_answer("Saint-Denis (1998)") == "saintdenis 1998"  # punctuation removed, not spaced
    assert normalize_answer("A") == ""
    assert exact_match("the Denver Broncos", "Denver Broncos") == 1.0
    assert exact_match("Denver", "Denver Broncos") == 0.0
    # prediction "denver broncos team" vs gold "denver broncos": precision 2/3, recall 1
    assert token_f1("Denver Broncos team", "Denver Broncos") == pytest.approx(0.8)
    assert token_f1("the", "a") == 0.0  # both normalise to nothing: no common word
    assert token_f1("Broncos Broncos", "Broncos") == pytest.approx(2 * 0.5 * 1 / 1.5)  # bag of words counts
    scores = squad_scores(["Denver Broncos", "Carolina"], [["Broncos", "Denver Broncos"], ["Carolina Panthers"]])
    assert scores["exact_match"] == pytest.approx(0.5)  # max over gold answers
    assert scores["squad_f1"] == pytest.approx((1.0 + 2 * 1 * 0.5 / 1.5) / 2)
    with pytest.raises(ValueError, match="no gold answer"):
        squad_scores(["x"], [[]])


# ---------------------------------------------------------------------------------------------
# Files, split, overlap


def test_read_squad_checks_answers(tmp_path: Path) -> None:
    articles = toy_articles(6, 0, "a", articles=2)
    examples = read_squad(write_squad(tmp_path / "ok.json", articles), "task.train_file")
    assert len(examples) == 6 and {e.group for e in examples} == {"a0", "a1"}
    assert all(e.texts[1][e.answer_starts[0]:].startswith(e.references[0]) for e in examples)
    articles[0]["paragraphs"][0]["qas"][0]["answers"][0]["answer_start"] += 1
    with pytest.raises(ConfigError, match="not a non-empty text of the context") as caught:
        read_squad(write_squad(tmp_path / "bad.json", articles), "task.train_file")
    assert caught.value.field == "task.train_file"
    articles[0]["paragraphs"][0]["qas"][0]["answers"] = []
    with pytest.raises(ConfigError, match="unanswerable"):
        read_squad(write_squad(tmp_path / "v2.json", articles), "task.train_file")


def test_split_by_title_holds_out_every_fifth_article() -> None:
    examples = [Example(texts=("q", "c"), label=None, group=title) for title in "JIHGFEDCBA" for _ in range(2)]
    train, evaluation = split_by_title(examples)
    assert sorted({e.group for e in evaluation}) == ["E", "J"]
    assert len(train) == 16 and len(evaluation) == 4


def test_file_task_refuses_shared_contexts_and_classes_are_titles(tmp_path: Path) -> None:
    train = write_squad(tmp_path / "train.json", toy_articles(20, 0, "train"))
    task = load_task(TaskConfig(name="file", problem_type="extractive_qa", train_file=str(train),
                                eval_file=str(write_squad(tmp_path / "eval.json", toy_articles(8, 1, "eval")))))
    assert task.metrics == ("exact_match", "squad_f1") and task.num_labels == 2
    assert all(task.example_classes[e.label] == e.group for e in task.train + task.eval)
    with pytest.raises(ConfigError, match="context paragraphs") as caught:
        load_task(TaskConfig(name="file", problem_type="extractive_qa", train_file=str(train), eval_file=str(train)))
    assert caught.value.field == "task.eval_file"


def test_xquad_never_trains_on_squad_dev_articles(tmp_path: Path) -> None:
    data = tmp_path / "data"
    (data / "qa" / "xquad").mkdir(parents=True)
    (data / "qa" / "squad_v1.1").mkdir(parents=True)
    dev = toy_articles(30, 0, "dev", articles=10)
    write_squad(data / "qa" / "squad_v1.1" / "dev-v1.1.json", dev)
    subset = [{"title": a["title"], "paragraphs": a["paragraphs"][:1]} for a in dev]  # XQuAD: some paragraphs
    write_squad(data / "qa" / "xquad" / "xquad.en.json", subset)
    squad = load_task(TaskConfig(name="squad"), data)
    assert {e.group for e in squad.eval} == {"dev4", "dev9"}
    with pytest.raises(ConfigError, match="XQuAD is a subset") as caught:
        load_task(TaskConfig(name="squad", eval_split="xquad"), data)
    assert caught.value.field == "task.eval_split"
    with pytest.raises(ConfigError, match="evaluation-only") as caught:
        load_task(TaskConfig(name="xquad"), data)
    assert caught.value.field == "task.train_file"
    with pytest.raises(ConfigError, match="context paragraphs"):  # SQuAD dev as training data
        load_task(TaskConfig(name="xquad", train_file="qa/squad_v1.1/dev-v1.1.json"), data)
    other_paragraphs = [{"title": a["title"], "paragraphs": a["paragraphs"][1:]} for a in dev]
    write_squad(tmp_path / "same_articles.json", other_paragraphs)
    with pytest.raises(ConfigError, match="shares 10 article"):  # same articles, other paragraphs
        load_task(TaskConfig(name="xquad", train_file=str(tmp_path / "same_articles.json")), data)
    write_squad(tmp_path / "other.json", toy_articles(12, 5, "other"))
    task = load_task(TaskConfig(name="xquad", train_file=str(tmp_path / "other.json")), data)
    assert (len(task.train), len(task.eval)) == (12, 10)


# ---------------------------------------------------------------------------------------------
# Windows and post-processing


def test_windows_keep_every_answer_inside_one(minilm_tokenizer: Any) -> None:
    rng = random.Random(3)
    examples = []
    for _ in range(30):
        words = [rng.choice(THINGS + COLORS + ["the", "and", "of"]) for _ in range(rng.randint(20, 80))]
        begin = rng.randrange(len(words) - 3)
        answer = " ".join(words[begin : begin + rng.randint(1, 3)])
        context = " ".join(words)
        start = len(" ".join(words[:begin])) + (1 if begin else 0)
        examples.append(Example(texts=("which colour is it ?", context), label=None, group="t",
                                references=(answer,), answer_starts=(start,)))
    features, spans = encode_qa(examples, minilm_tokenizer, max_length=24, doc_stride=6)
    assert len(features) > 2 * len(examples)  # long contexts really are cut into several windows
    found = set()
    for row, feature in enumerate(features):
        example = examples[spans.example_of[row]]
        assert len(feature["input_ids"]) <= 24
        first, last = feature["start_positions"][0], feature["end_positions"][0]
        if (first, last) != (0, 0):
            offsets = spans.offsets[row]
            assert example.texts[1][offsets[first, 0] : offsets[last, 1]] == example.references[0]
            found.add(spans.example_of[row])
    assert found == set(range(len(examples)))
    # consecutive windows of one context overlap by doc_stride context tokens
    rows = [r for r, e in enumerate(spans.example_of) if e == 0]
    context_tokens = [[tuple(o) for o in spans.offsets[r] if o[0] != NOT_CONTEXT] for r in rows]
    for before, after in itertools.pairwise(context_tokens):
        assert before[-6:] == after[:6]


def test_span_targets_and_too_large_stride(minilm_tokenizer: Any) -> None:
    offsets = np.array([[NOT_CONTEXT] * 2, [0, 3], [4, 9], [10, 12], [NOT_CONTEXT] * 2])
    assert span_targets(offsets, 4, 12) == (2, 3)
    assert span_targets(offsets, 5, 8) == (2, 2)  # an answer inside one token
    assert span_targets(offsets, 10, 20) == (0, 0)  # runs past the window: [CLS]
    with pytest.raises(ConfigError, match="must be below") as caught:
        encode_qa([_example("q ?", "a b c", ["b"])], minilm_tokenizer, max_length=24, doc_stride=12)
    assert caught.value.field == "task.doc_stride"


def test_post_processing_recovers_gold_spans_from_perfect_logits(minilm_tokenizer: Any) -> None:
    context = " ".join(f"the {t} is {c} ." for t, c in zip(THINGS, COLORS)) + " the hat is very dark green ."
    examples = [_example("what color is the boat ?", context, ["blue"]),
                _example("what color is the hat ?", context, ["very dark green", "green"])]
    features, spans = encode_qa(examples, minilm_tokenizer, max_length=24, doc_stride=8)
    scores = []
    for feature in features:
        logits = np.full((len(feature["input_ids"]), 2), -5.0)
        logits[feature["start_positions"][0], 0] = logits[feature["end_positions"][0], 1] = 5.0
        logits[0] = -10.0  # [CLS] is never an answer; windows without the answer peak elsewhere at random
        scores.append(logits)
    rows = list(range(len(features)))
    assert len(rows) > len(examples)
    assert spans.predict(rows, scores) == {0: "blue", 1: "very dark green"}
    assert spans.score(rows, scores, ("exact_match", "squad_f1")) == {"exact_match": 1.0, "squad_f1": 1.0}
    short = SpanAnswers(spans.example_of, spans.offsets, spans.contexts, spans.answers, max_answer_length=2)
    assert short.predict(rows, scores)[1] != "very dark green"  # 3 tokens exceed max_answer_length


def test_best_span_rules() -> None:
    offsets = np.array([[NOT_CONTEXT] * 2, [NOT_CONTEXT] * 2, [0, 3], [4, 7], [8, 11], [NOT_CONTEXT] * 2])
    start = np.array([9.0, 8.0, 1.0, 2.0, 0.0, 9.0])
    end = np.array([9.0, 9.0, 0.0, 1.0, 3.0, 9.0])
    # question / special tokens never count; end >= start; best sum among context pairs: start 3, end 4
    assert best_span(start, end, offsets, n_best_size=20, max_answer_length=30) == (5.0, 4, 11)
    assert best_span(start, end, offsets, n_best_size=20, max_answer_length=1) == (3.0, 4, 7)
    assert best_span(start, end, offsets, n_best_size=2, max_answer_length=30) is None  # top-2 are not context


# ---------------------------------------------------------------------------------------------
# End to end


def test_tiny_encoder_learns_toy_qa(tmp_path: Path) -> None:
    exp = prepare(build_config(qa_raw(tmp_path, evaluation={"per_client": True})))
    assert exp.backbone.head == "question_answering"
    assert len(exp.train_data) > len(exp.task.train)  # windows: several rows for some questions
    assert sum(len(rows) for rows in exp.train_rows) == len(exp.train_data)
    records = LocalEngine(exp, tmp_path / "run").run()
    losses = [r["train_loss"] for r in records if r["round"] > 0]
    assert losses[-1] < 0.7 * losses[0]
    assert sum(records[-1]["num_samples"]) == len(exp.train_data)  # clients train on windows
    assert records[-1]["eval"]["squad_f1"] > records[0]["eval"]["squad_f1"]
    # per-client evaluation scores each client's own training questions (all windows of each)
    assert set(records[-1]["client_eval"]) == {"0", "1"}
    assert all(0.0 <= m["exact_match"] <= 1.0 for m in records[-1]["client_eval"].values())


def test_soft_prompt_shifts_span_targets_and_cuts_span_logits(tmp_path: Path) -> None:
    import torch
    import torch.nn.functional as F

    from fedpeft.models.encoding import model_inputs, training_batch

    prompt = 5
    exp = prepare(build_config(qa_raw(tmp_path, "prompt_tuning", adapter={"num_virtual_tokens": prompt})))
    model = exp.backbone.model
    captured: list[torch.Tensor] = []
    model.qa_outputs.register_forward_hook(lambda module, args, out: captured.append(out))
    batch = training_batch(exp.train_data, [0, 1])
    with torch.no_grad():
        output = model(**batch)
    raw = captured[-1]  # (batch, prompt + tokens, 2): what the head saw
    assert raw.shape[1] == prompt + batch["input_ids"].shape[1]
    assert torch.equal(output.start_logits, raw[:, prompt:, 0])  # the prompt's positions are cut off
    # the loss is the cross-entropy at the gold positions shifted past the prompt
    expected = (F.cross_entropy(raw[..., 0], batch["start_positions"] + prompt)
                + F.cross_entropy(raw[..., 1], batch["end_positions"] + prompt)) / 2
    assert float(output.loss) == pytest.approx(float(expected), rel=1e-6)
    assert model(**model_inputs(batch)).loss is None


# ---------------------------------------------------------------------------------------------
# Real data


@pytest.mark.real
@pytest.mark.skipif(not (SHARED_DATA / "qa" / "squad_v1.1").is_dir(), reason="no SQuAD files")
def test_squad_split_and_windows_on_the_real_file(minilm_tokenizer: Any) -> None:
    task = load_task(TaskConfig(name="squad"), SHARED_DATA)
    assert (len(task.train), len(task.eval)) == (9_231, 1_339)
    assert (len({e.group for e in task.train}), len({e.group for e in task.eval})) == (39, 9)
    assert sum(len(e.references) for e in task.train + task.eval) == 34_726  # 1-6 gold answers per question
    with pytest.raises(ConfigError, match="context paragraphs"):
        load_task(TaskConfig(name="xquad", train_file=str(SHARED_DATA / "qa" / "squad_v1.1" / "dev-v1.1.json")),
                  SHARED_DATA)
    sample = task.eval[:400]
    features, spans = encode_qa(sample, minilm_tokenizer, max_length=384, doc_stride=128)
    inside = {spans.example_of[row] for row, f in enumerate(features) if f["start_positions"][0] != 0}
    assert inside == set(range(len(sample)))
