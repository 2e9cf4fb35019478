"""Export, load and predict: plain PEFT/transformers (in a process without fedpeft) compute the logits
fedpeft's evaluation computes; bundles round-trip; predict writes one row per input; errors are one line."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch

import fedpeft
from fedpeft.cli import main
from fedpeft.config import build_config
from fedpeft.engines.local import LocalEngine
from fedpeft.experiment import Experiment, prepare
from fedpeft.export import METADATA, export_run
from fedpeft.metrics.entity import entity_scores
from fedpeft.metrics.squad import squad_scores
from fedpeft.models.encoding import output_scores, predict, token_scores
from tests.conftest import tiny_raw_config, write_toy_sentiment

RECIPES: dict[str, dict[str, Any]] = {
    "lora": {"adapter": {"kind": "lora", "r": 4, "alpha": 8}},
    "federa": {"adapter": {"kind": "lora", "init": "svd", "r": 4}},
    "ia3": {"adapter": {"kind": "ia3"}},
    "p_tuning_v2": {"adapter": {"kind": "p_tuning_v2", "num_virtual_tokens": 4}},
    "prompt_tuning": {"adapter": {"kind": "prompt_tuning", "num_virtual_tokens": 4}},
    "full": {"adapter": {"kind": "full"}, "client": {"lr": 0.001}},
    "fedtt": {"adapter": {"kind": "tt", "tt_rank": 2, "bottleneck_size": 8}},
    "ffa_lora": {"adapter": {"kind": "ffa_lora", "r": 4, "alpha": 8}},
    "hetlora": {"method": "hetlora", "strategy": {"name": "fedadam", "rank_tiers": [1, 4], "server_lr": 0.01}},
    "flasc": {"method": "flasc", "strategy": {"name": "fedadamw", "server_lr": 0.01, "down_density": 0.5,
                                              "up_density": 0.5}, "codec": {"down": {"kind": "topk"},
                                                                            "up": {"kind": "topk"}}},
    "fedpeptao": {"method": "fedpeptao", "adapter": {"kind": "p_tuning_v2", "num_virtual_tokens": 4},
                  "strategy": {"server_lr": 0.01, "selection_round": 1, "lanczos_iterations": 4}},
    "bitfit": {"adapter": {"kind": "bitfit"}},
    # classifiers reading the encoder's mean: exported, loaded back by fedpeft.load and apply_pooling
    "lora_mean_no_pooler": {"adapter": {"kind": "lora", "r": 4, "alpha": 8}, "model": {"pooling": "mean_no_pooler"}},
    "p_tuning_v2_mean": {"adapter": {"kind": "p_tuning_v2", "num_virtual_tokens": 4}, "model": {"pooling": "mean"}},
    "prompt_tuning_mean_no_pooler": {"adapter": {"kind": "prompt_tuning", "num_virtual_tokens": 4},
                                     "model": {"pooling": "mean_no_pooler"}},
}
POOLED = ("lora_mean_no_pooler", "p_tuning_v2_mean", "prompt_tuning_mean_no_pooler")
FORMATS = {"lora": ("peft", "merged"), "federa": ("peft", "merged"), "ia3": ("peft", "merged"),
           "p_tuning_v2": ("peft",), "prompt_tuning": ("peft",), "full": ("merged",), "fedtt": ("bundle",),
           "ffa_lora": ("peft",), "hetlora": ("peft",), "flasc": ("peft", "merged"), "fedpeptao": ("peft",),
           "bitfit": ("merged",), "lora_mean_no_pooler": ("peft", "merged"), "p_tuning_v2_mean": ("peft",),
           "prompt_tuning_mean_no_pooler": ("peft",)}

# Runs with nothing from fedpeft importable: the export must stand on transformers + PEFT alone.
PLAIN_LOADER = r'''
import json, sys
import torch
from peft import PeftModel, PrefixTuningConfig
from transformers import AutoModelForSequenceClassification, AutoTokenizer

jobs = json.loads(sys.argv[1])
out = {}
for job in jobs:
    folder = job["dir"]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    batch = tokenizer(job["texts"], padding=True, truncation=True, max_length=job["max_length"], return_tensors="pt")
    if job["format"] == "merged":
        model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
        logits = model(**batch).logits
    else:
        base = AutoModelForSequenceClassification.from_pretrained(folder + "/base")
        model = PeftModel.from_pretrained(base, folder).eval()
        if isinstance(model.peft_config["default"], PrefixTuningConfig):
            # PEFT's prefix forward, by hand: PEFT 0.21 looks for `past_key_values` in the signature,
            # which transformers 5 models call `cache`
            tokens = model.peft_config["default"].num_virtual_tokens
            mask = torch.cat([torch.ones(len(job["texts"]), tokens, dtype=torch.long), batch["attention_mask"]], 1)
            logits = model.base_model(**{**batch, "attention_mask": mask},
                                      past_key_values=model.get_prompt(len(job["texts"]))).logits
        else:
            logits = model(**batch).logits
    out[job["name"]] = logits.detach().tolist()
assert not any(name == "fedpeft" or name.startswith("fedpeft.") for name in sys.modules), "fedpeft was imported"
print(json.dumps(out))
'''


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_run(root: Path, name: str, sections: dict[str, Any], train: Path, eval_: Path) -> Path:
    """One round of ``sections`` on the toy task; returns the run directory."""
    run_dir = root / name
    raw = tiny_raw_config(train, eval_, run_dir, rounds=1, partition={"kind": "iid", "num_clients": 2}, **sections)
    LocalEngine(prepare(build_config(raw)), run_dir).run()
    return run_dir


def trained_experiment(run_dir: Path) -> Experiment:
    """The run's experiment with its final global state loaded, in eval mode: what its evaluation scored."""
    exp = prepare(build_config(_config(run_dir)))
    exp.slot.load(torch.load(run_dir / "checkpoint.pt", weights_only=True)["global_state"])
    exp.slot.model.eval()
    return exp


def evaluation_logits(run_dir: Path) -> torch.Tensor:
    """The scores fedpeft's evaluation computes for the eval split with the run's final global state."""
    exp = trained_experiment(run_dir)
    return output_scores(exp.slot.model, exp.eval_data, range(len(exp.eval_data)))


def _config(run_dir: Path) -> dict[str, Any]:
    import yaml

    return yaml.safe_load((run_dir / "config.yaml").read_text())


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every recipe run, exported in its formats, and the plain-PEFT logits of each export."""
    root = tmp_path_factory.mktemp("export")
    train = write_toy_sentiment(root / "train.csv", 40, 0)
    eval_ = write_toy_sentiment(root / "eval.csv", 12, 1)
    texts = pd.read_csv(eval_)["text"].tolist()
    runs, jobs = {}, []
    for name, sections in RECIPES.items():
        runs[name] = tiny_run(root, name, sections, train, eval_)
        for fmt in FORMATS[name]:
            folder = export_run(runs[name], root / f"{name}_{fmt}", fmt)
            if fmt != "bundle":
                jobs.append({"name": f"{name}_{fmt}", "dir": str(folder), "format": fmt, "texts": texts,
                             "max_length": 32})
    done = subprocess.run([sys.executable, "-c", PLAIN_LOADER, json.dumps(jobs)], capture_output=True, text=True,
                          env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "TOKENIZERS_PARALLELISM": "false",
                               "OMP_NUM_THREADS": "1"}, cwd=root, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    plain = {name: torch.tensor(logits) for name, logits in json.loads(done.stdout.splitlines()[-1]).items()}
    return {"root": root, "runs": runs, "plain": plain, "eval": eval_, "train": train}


@pytest.mark.parametrize("recipe", ["lora", "federa", "ia3", "p_tuning_v2", "prompt_tuning", "full", "ffa_lora",
                                    "hetlora", "flasc", "fedpeptao", "bitfit"])
def test_plain_peft_and_transformers_compute_fedpeft_evaluation_logits(exported: dict[str, Any], recipe: str) -> None:
    expected = evaluation_logits(exported["runs"][recipe])
    assert expected.shape == (12, 2)
    for fmt in FORMATS[recipe]:
        torch.testing.assert_close(exported["plain"][f"{recipe}_{fmt}"], expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("recipe", ["lora", "federa", "ia3"])
def test_merged_equals_peft(exported: dict[str, Any], recipe: str) -> None:
    plain = exported["plain"]
    torch.testing.assert_close(plain[f"{recipe}_merged"], plain[f"{recipe}_peft"], atol=1e-5, rtol=0)


def test_federa_export_is_a_delta_on_the_pretrained_weights(exported: dict[str, Any]) -> None:
    """Rank 2r, and the base it is loaded on holds the original W0, not FeDeRA's residual."""
    from safetensors.torch import load_file

    folder = exported["root"] / "federa_peft"
    config = json.loads((folder / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (8, 16)  # r 4, alpha 8: both doubled, the scale kept
    weights = load_file(str(folder / "adapter_model.safetensors"))
    assert any(k.endswith("query.lora_A.weight") and v.shape[0] == 8 for k, v in weights.items())
    base = load_file(str(folder / "base" / "model.safetensors"))
    exp = prepare(build_config(_config(exported["runs"]["federa"])))
    residual = dict(exp.slot.model.named_parameters())["bert.encoder.layer.0.attention.self.query.base_layer.weight"]
    assert not torch.allclose(base["bert.encoder.layer.0.attention.self.query.weight"], residual)


def test_metadata_records_labels_task_base_and_version(exported: dict[str, Any]) -> None:
    meta = json.loads((exported["root"] / "lora_peft" / METADATA).read_text())
    assert meta["task"]["label_names"] == ["neg", "pos"] and meta["task"]["problem_type"] == "classification"
    assert meta["base_model"] == {"name": "tiny-bert", "path": "base"}
    assert (meta["format"], meta["method"], meta["fedpeft_version"]) == ("peft", "lora", fedpeft.__version__)


@pytest.mark.parametrize("source", ["run", "fedtt_bundle", "lora_peft", "p_tuning_v2_peft", "lora_merged",
                                    "lora_mean_no_pooler_peft", "lora_mean_no_pooler_merged", "p_tuning_v2_mean_peft",
                                    "prompt_tuning_mean_no_pooler_peft"])
def test_fedpeft_load_gives_the_evaluated_model(exported: dict[str, Any], source: str) -> None:
    recipe = "fedtt" if source == "run" else source.rsplit("_", 1)[0]
    if recipe in POOLED:
        meta = json.loads((exported["root"] / source / METADATA).read_text())
        assert meta["pooling"] == RECIPES[recipe]["model"]["pooling"]
    path = exported["runs"][recipe] if source == "run" else exported["root"] / source
    loaded = fedpeft.load(path)
    assert loaded.label_names == ("neg", "pos") and not loaded.model.training
    texts = pd.read_csv(exported["eval"])["text"].tolist()
    batch = loaded.tokenizer(texts, padding=True, truncation=True, max_length=32, return_tensors="pt")
    with torch.no_grad():
        logits = loaded.model(**batch).logits
    torch.testing.assert_close(logits, evaluation_logits(exported["runs"][recipe]), atol=1e-5, rtol=0)


def test_predict_writes_one_row_per_input_with_label_names(exported: dict[str, Any], tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = exported["runs"]["lora"]
    out = tmp_path / "predictions.csv"
    assert main(["predict", str(exported["root"] / "lora_peft"), "--input", str(exported["eval"]), "--output", str(out),
                 "--batch-size", "5"]) == 0
    table = pd.read_csv(out)
    exp = trained_experiment(run_dir)
    expected = [exp.task.label_names[int(k)] for k in predict(exp.slot.model, exp.eval_data, range(12))]
    assert list(table.columns) == ["text", "predicted_label", "probability"]
    assert table["text"].tolist() == pd.read_csv(exported["eval"])["text"].tolist()
    assert table["predicted_label"].tolist() == expected
    assert table["probability"].between(0.5, 1.0).all()
    assert main(["predict", str(run_dir), "--input", str(exported["eval"])]) == 0  # CSV on stdout
    stdout = capsys.readouterr().out
    assert stdout.splitlines()[0] == "text,predicted_label,probability" and len(stdout.splitlines()) == 13


def test_predict_regression_writes_floats(tmp_path: Path) -> None:
    rows = ["text,score"] + [f"{'good great' if i % 2 else 'bad awful'} movie {i},{0.5 + (i % 2) * 2.25 + i / 100}"
                             for i in range(24)]
    data = tmp_path / "scores.csv"
    data.write_text("\n".join(rows) + "\n")
    run_dir = tiny_run(tmp_path, "regression", {"task": {"label_column": "score"}}, data, data)
    out = tmp_path / "predictions.jsonl"
    assert main(["predict", str(run_dir), "--input", str(data), "--output", str(out)]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 24 and all(isinstance(r["predicted_value"], float) for r in records)
    exp = trained_experiment(run_dir)
    assert exp.task.problem_type == "regression"
    expected = predict(exp.slot.model, exp.eval_data, range(24)).tolist()
    assert [r["predicted_value"] for r in records] == pytest.approx(expected, abs=1e-6)


def _one_line_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_bad_input_is_one_line_on_stderr(exported: dict[str, Any], tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    runs = exported["runs"]
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    (unfinished / "config.yaml").write_text((runs["lora"] / "config.yaml").read_text())
    assert "no checkpoint.pt" in _one_line_error(["export", str(unfinished), "--out", str(tmp_path / "x")], capsys)
    (unfinished / "checkpoint.pt").write_bytes((runs["lora"] / "checkpoint.pt").read_bytes())
    (unfinished / "config.yaml").write_text((runs["lora"] / "config.yaml").read_text().replace("seed: 0", "seed: 1"))
    line = _one_line_error(["export", str(unfinished), "--out", str(tmp_path / "x")], capsys)
    assert "another experiment config" in line
    line = _one_line_error(["export", str(runs["lora"]), "--out", str(tmp_path / "x"), "--format", "onnx"], capsys)
    assert "--format" in line and "onnx" in line and "bundle" in line
    line = _one_line_error(["export", str(runs["p_tuning_v2"]), "--out", str(tmp_path / "x"), "--format", "merged"],
                           capsys)
    assert "merged" in line and "p_tuning_v2" in line
    line = _one_line_error(["export", str(runs["fedtt"]), "--out", str(tmp_path / "x"), "--format", "peft"], capsys)
    assert "'tt'" in line and "--format bundle" in line
    no_text = tmp_path / "no_text.csv"
    no_text.write_text("review\ngood film\n")
    line = _one_line_error(["predict", str(runs["lora"]), "--input", str(no_text)], capsys)
    assert "--text-column" in line and "'text'" in line and "review" in line
    line = _one_line_error(["export", str(runs["lora"]), "--out", str(tmp_path / "x"), "--push-to-hub", "me/model"],
                           capsys)
    assert "HF_HUB_OFFLINE" in line


def test_predict_generation_writes_the_texts_fedpeft_generates(tmp_path: Path) -> None:
    from fedpeft.models.generation import generate_texts
    from tests.test_generation import generation_raw

    raw = generation_raw(tmp_path, "gpt2", rounds=1)
    LocalEngine(prepare(build_config(raw)), tmp_path / "run").run()
    exp = trained_experiment(tmp_path / "run")
    expected = generate_texts(exp.slot.model, exp.eval_data, range(len(exp.eval_data)))
    export_run(tmp_path / "run", tmp_path / "peft", "peft")
    inputs = tmp_path / "inputs.jsonl"  # the eval split's inputs, one per example (the file repeats them per reference)
    pd.DataFrame({"mr": [ex.texts[0] for ex in exp.task.eval]}).to_json(inputs, orient="records", lines=True)
    for source in ("run", "peft"):
        out = tmp_path / f"{source}.jsonl"
        assert main(["predict", str(tmp_path / source), "--input", str(inputs), "--output", str(out)]) == 0
        records = [json.loads(line) for line in out.read_text().splitlines()]
        assert [r["generated_text"] for r in records] == expected, source


def test_predict_token_classification_writes_the_entities_evaluation_counts(tmp_path: Path,
                                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """One round on toy NER: predict's tags are the evaluation's (with the run's constrained BIO
    decoding), for pre-split words (JSONL) and
    whitespace-split text (CSV); its entities are the chunks seqeval scores, inside their text."""
    from tests.test_token_classification import ner_raw

    # a near-random model (lr 1e-6) tags many words as entities, some of them stray I-X ones
    raw = ner_raw(tmp_path, rounds=1, task={"max_train_examples": 32}, client={"lr": 1e-6, "local_epochs": 1},
                  evaluation={"at_start": False, "bio_decoding": "constrained"})
    records = LocalEngine(prepare(build_config(raw)), tmp_path / "run").run()
    exp = trained_experiment(tmp_path / "run")
    rows = list(range(len(exp.eval_data)))
    scorer = exp.eval_data.scorer
    expected = [scorer.predict(row, scores) for row, scores in zip(rows, token_scores(exp.slot.model, exp.eval_data,
                                                                                        rows, 16))]
    sentences = [list(example.words) for example in exp.task.eval]
    pd.DataFrame({"tokens": sentences}).to_json(tmp_path / "words.jsonl", orient="records", lines=True)
    pd.DataFrame({"text": ["  " + "  ".join(words) for words in sentences]}).to_csv(tmp_path / "text.csv", index=False)
    assert main(["predict", str(tmp_path / "run"), "--input", str(tmp_path / "words.jsonl"), "--output",
                 str(tmp_path / "words_out.jsonl"), "--batch-size", "7"]) == 0
    assert main(["predict", str(tmp_path / "run"), "--input", str(tmp_path / "text.csv"), "--output",
                 str(tmp_path / "text_out.csv")]) == 0
    by_words = [json.loads(line) for line in (tmp_path / "words_out.jsonl").read_text().splitlines()]
    by_text = pd.read_csv(tmp_path / "text_out.csv")
    assert len(by_words) == len(by_text) == len(sentences) == 40
    assert [record["predicted_tags"] for record in by_words] == expected
    assert [json.loads(tags) for tags in by_text["predicted_tags"]] == expected
    # the run's own evaluation of these sentences, recomputed from predict's tags
    assert entity_scores(scorer.gold, expected) == pytest.approx(records[-1]["eval"])
    types = {name[2:] for name in exp.task.label_names if name != "O"}
    found = 0
    for words, record, text, cell in zip(sentences, by_words, by_text["text"], by_text["entities"], strict=True):
        rebuilt = ["O"] * len(words)
        for entity in record["entities"]:
            assert entity["type"] in types and 0 <= entity["start"] < entity["end"] <= len(words)
            assert entity["text"] == " ".join(words[entity["start"]:entity["end"]])
            assert " ".join(words)[entity["start_char"]:entity["end_char"]] == entity["text"]
            rebuilt[entity["start"]:entity["end"]] = [f"I-{entity['type']}"] * (entity["end"] - entity["start"])
            rebuilt[entity["start"]] = f"B-{entity['type']}"
        found += len(record["entities"])
        if record["entities"]:  # exactly the entities seqeval counts in the predicted tags
            assert entity_scores([record["predicted_tags"]], [rebuilt], ("entity_f1",))["entity_f1"] == 1.0
        from_text = json.loads(cell)  # the same entities, their text a slice of the (double-spaced) input text
        assert [(e["type"], e["start"], e["end"]) for e in from_text] == \
            [(e["type"], e["start"], e["end"]) for e in record["entities"]]
        assert all(text[e["start_char"]:e["end_char"]] == e["text"] and e["text"].split() == words[e["start"]:e["end"]]
                   for e in from_text)
    assert found > 0
    capsys.readouterr()
    (tmp_path / "no_words.csv").write_text("review\nrome is far\n")
    line = _one_line_error(["predict", str(tmp_path / "run"), "--input", str(tmp_path / "no_words.csv")], capsys)
    assert "--text-column" in line and "tokens" in line and "review" in line


def test_predict_extractive_qa_writes_the_answers_evaluation_scores(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """One round on toy QA with windows and non-default n-best / answer length: predict's answers,
    starts and scores are the evaluation's post-processing of the same windows, from a run and its
    PEFT export."""
    from tests.test_extractive_qa import qa_raw

    raw = qa_raw(tmp_path, "lora", rounds=1, evaluation={"at_start": False, "n_best_size": 4,
                                                         "max_answer_length": 2})
    records = LocalEngine(prepare(build_config(raw)), tmp_path / "run").run()
    exp = trained_experiment(tmp_path / "run")
    assert len(exp.eval_data) > len(exp.task.eval)  # long contexts: several windows per question
    rows = list(range(len(exp.eval_data)))
    best = exp.eval_data.scorer.best_spans(rows, token_scores(exp.slot.model, exp.eval_data, rows, 16))
    questions = pd.DataFrame({"question": [e.texts[0] for e in exp.task.eval], "context": [e.texts[1] for e in
                                                                                          exp.task.eval]})
    questions.to_json(tmp_path / "questions.jsonl", orient="records", lines=True)
    export_run(tmp_path / "run", tmp_path / "peft", "peft")
    for source in ("run", "peft"):
        out = tmp_path / f"{source}.jsonl"
        assert main(["predict", str(tmp_path / source), "--input", str(tmp_path / "questions.jsonl"), "--output",
                     str(out), "--batch-size", "6"]) == 0
        answers = [json.loads(line) for line in out.read_text().splitlines()]
        assert len(answers) == len(questions)
        for i, answer in enumerate(answers):
            score, start, end = best[i]
            context = questions["context"][i]
            assert (answer["answer"], answer["answer_start"]) == (context[start:end], start), (source, i)
            assert answer["answer_score"] == pytest.approx(score, abs=1e-4)
            assert context[answer["answer_start"]:].startswith(answer["answer"]) and answer["answer"]
        # the run's own evaluation, recomputed from predict's answers
        golds = [example.references for example in exp.task.eval]
        assert squad_scores([a["answer"] for a in answers], golds) == pytest.approx(records[-1]["eval"])
    capsys.readouterr()
    questions[["question"]].to_csv(tmp_path / "no_context.csv", index=False)
    line = _one_line_error(["predict", str(tmp_path / "run"), "--input", str(tmp_path / "no_context.csv")], capsys)
    assert "'context'" in line and "question" in line


@pytest.mark.parametrize("source", ["lora_mean_no_pooler_peft", "lora_mean_no_pooler_merged", "p_tuning_v2_mean_peft",
                                    "prompt_tuning_mean_no_pooler_peft"])
def test_a_plain_load_of_a_mean_pooled_export_needs_apply_pooling(exported: dict[str, Any], source: str,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """transformers' class reads the first token, so a plain load scores other logits; the one line
    ``fedpeft export`` prints (apply_pooling with the metadata's pooling) makes it the evaluated model."""
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from fedpeft.export import PrefixTuned, pooling_note
    from fedpeft.models.pooling import apply_pooling

    recipe, fmt = source.rsplit("_", 1)
    expected = evaluation_logits(exported["runs"][recipe])
    assert not torch.allclose(exported["plain"][source], expected, atol=1e-3)
    folder = exported["root"] / source
    pooling = json.loads((folder / METADATA).read_text())["pooling"]
    assert f"apply_pooling(model, {pooling!r})" in pooling_note(folder)
    if fmt == "merged":
        model = AutoModelForSequenceClassification.from_pretrained(folder)
        apply_pooling(model, pooling)
    else:
        base = AutoModelForSequenceClassification.from_pretrained(folder / "base")
        apply_pooling(base, pooling)
        model = PeftModel.from_pretrained(base, folder)
        if recipe.startswith("p_tuning_v2"):
            model = PrefixTuned(model)
    model.eval()
    texts = pd.read_csv(exported["eval"])["text"].tolist()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    batch = tokenizer(texts, padding=True, truncation=True, max_length=32, return_tensors="pt")
    with torch.no_grad():
        logits = model(**batch).logits
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0)
    main(["export", str(exported["runs"][recipe]), "--out", str(exported["root"] / f"{source}_again"),
          "--format", fmt])
    assert "apply_pooling" in capsys.readouterr().err  # export messages go to stderr


def test_a_head_pooled_export_needs_nothing_added(exported: dict[str, Any]) -> None:
    from fedpeft.export import pooling_note

    assert json.loads((exported["root"] / "lora_peft" / METADATA).read_text())["pooling"] == "head"
    assert pooling_note(exported["root"] / "lora_peft") is None
