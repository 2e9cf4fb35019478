"""Generation tasks: ROUGE, the E2E and file tasks, decoding, and text-to-text learning on tiny models."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from fedpeft.config import ConfigError, TaskConfig, build_config
from fedpeft.data.tasks import load_task
from fedpeft.engines.local import LocalEngine
from fedpeft.experiment import prepare
from fedpeft.metrics.rouge import rouge_scores
from fedpeft.models.generation import generate_texts
from tests.conftest import SHARED_DATA

NAMES = ["alimentum", "aromi", "bibimbap", "clowns", "cocum", "giraffe"]
FOODS = ["chinese", "english", "french", "indian", "italian", "japanese"]


def write_toy_generation(path: Path, n: int, seed: int, refs_per_input: int = 1) -> Path:
    """``name[X], food[Y]`` -> ``X serves Y food .`` (a copy task a tiny model can learn)."""
    rng = random.Random(seed)
    lines = ["mr,ref"]
    for _ in range(n):
        name, food = rng.choice(NAMES), rng.choice(FOODS)
        for variant in range(refs_per_input):
            ref = f"{name} serves {food} food ." if variant == 0 else f"{food} food at {name} ."
            lines.append(f'"name[{name}], food[{food}]","{ref}"')
    path.write_text("\n".join(lines) + "\n")
    return path


def generation_raw(tmp_path: Path, arch: str, method: str = "lora", **sections: object) -> dict:
    tmp_path.mkdir(parents=True, exist_ok=True)
    train = write_toy_generation(tmp_path / "train.csv", 96, 0)
    eval_ = write_toy_generation(tmp_path / "eval.csv", 8, 1, refs_per_input=2)
    raw: dict = {
        "method": method, "seed": 0, "rounds": 2,
        "task": {"name": "file", "train_file": str(train), "eval_file": str(eval_), "problem_type": "generation",
                 "text_columns": ["mr"], "label_column": "ref", "max_length": 24},
        "partition": {"kind": "iid", "num_clients": 4},
        "model": {"name": f"tiny-{arch}"},
        "adapter": {"kind": "lora", "r": 4, "alpha": 8},
        "client": {"optimizer": "adam", "lr": 0.01, "batch_size": 8},
        "strategy": {"name": "fedavg", "clients_per_round": 2},
        "evaluation": {"max_new_tokens": 8, "batch_size": 8},
        "output": {"run_dir": str(tmp_path / "run"), "progress": False},
    }
    for key, value in sections.items():
        raw[key] = {**raw[key], **value} if isinstance(value, dict) else value
    return raw


def test_rouge_on_a_known_example() -> None:
    scores = rouge_scores(["the cat sat"], [["a dog barked", "the cat sat on the mat"]])
    # vs the 2nd reference: unigrams 3/3 precision, 3/6 recall; bigrams 2/2, 2/5; LCS 3
    assert scores["rouge1"] == pytest.approx(2 * 1 * 0.5 / 1.5)
    assert scores["rouge2"] == pytest.approx(2 * 1 * 0.4 / 1.4)
    assert scores["rougeL"] == pytest.approx(2 * 1 * 0.5 / 1.5)
    two = rouge_scores(["the cat sat", "nothing here"], [["the cat sat"], ["a dog"]], names=["rouge1"])
    assert two == {"rouge1": pytest.approx(0.5)}
    with pytest.raises(ValueError, match="rouge3"):
        rouge_scores(["a"], [["a"]], names=["rouge3"])
    with pytest.raises(ValueError, match="no reference"):
        rouge_scores(["a"], [[]])


def test_file_generation_task_groups_references(tmp_path: Path) -> None:
    train = write_toy_generation(tmp_path / "train.csv", 10, 0)
    eval_ = write_toy_generation(tmp_path / "eval.csv", 3, 1, refs_per_input=2)
    cfg = TaskConfig(name="file", train_file=str(train), eval_file=str(eval_), problem_type="generation",
                     text_columns=["mr"], label_column="ref")
    task = load_task(cfg)
    assert task.problem_type == "generation" and task.metrics == ("rouge1", "rouge2", "rougeL")
    assert len(task.train) == 10 and all(len(ex.references) == 1 for ex in task.train)
    assert all(len(ex.references) == 2 for ex in task.eval)
    with pytest.raises(ConfigError, match=r"task\.metrics"):
        load_task(cfg.model_copy(update={"metrics": ["accuracy"]}))


@pytest.mark.real
@pytest.mark.skipif(not (SHARED_DATA / "e2e_nlg").is_dir(), reason="needs ../shared/data/e2e_nlg")
def test_e2e_task_has_all_references_per_meaning_representation() -> None:
    task = load_task(TaskConfig(name="e2e_nlg"), SHARED_DATA)
    assert len(task.train) == 4672 and len(task.eval) == 630
    assert sum(len(ex.references) for ex in task.eval) == 4693
    assert task.eval[0].texts == ("name[Blue Spice], eatType[coffee shop], area[city centre]",)


def test_generation_needs_a_generative_model(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"model\.head"):
        prepare(build_config(generation_raw(tmp_path, "bert")))


def test_batched_decoding_equals_one_by_one(tmp_path: Path) -> None:
    for arch in ("gpt2", "t5"):  # left padding (decoder) and right padding (encoder-decoder)
        exp = prepare(build_config(generation_raw(tmp_path / arch, arch, evaluation={"num_beams": 2})))
        model, data = exp.backbone.model.eval(), exp.eval_data
        batched = generate_texts(model, data, [0, 1, 2])
        single = [generate_texts(model, data, [i])[0] for i in range(3)]
        assert batched == single, arch
        assert all(isinstance(text, str) for text in batched)


@pytest.mark.parametrize(("arch", "method"), [("t5", "headprune"), ("gpt2", "lora")])
def test_text_to_text_learns(tmp_path: Path, arch: str, method: str) -> None:
    raw = generation_raw(tmp_path, arch, method, rounds=4, client={"local_epochs": 2, "lr": 0.02},
                         strategy={"head_sparsity": 0.5} if method == "headprune" else {},
                         evaluation={"every": 4})
    records = LocalEngine(prepare(build_config(raw)), tmp_path / "run").run()
    assert records[-1]["train_loss"] < 0.85 * records[0]["train_loss"]  # ln(vocab) ~ 10.3 at the start
    rouge = records[-1]["eval"]
    assert set(rouge) == {"rouge1", "rouge2", "rougeL"} and all(0.0 <= v <= 1.0 for v in rouge.values())
