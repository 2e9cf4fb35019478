"""Every recipe trains a token classifier (NER) and a QA head: one round on toy files, tiny BERT."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fedpeft.config import build_config
from fedpeft.engines.local import LocalEngine
from fedpeft.experiment import prepare
from fedpeft.recipes import RECIPES
from tests.test_extractive_qa import qa_raw
from tests.test_token_classification import ner_raw

pytestmark = pytest.mark.usefixtures("single_torch_thread")

PROBLEMS = {"ner": (ner_raw, "entity_f1", "classifier."), "qa": (qa_raw, "exact_match", "qa_outputs.")}


@pytest.mark.parametrize("problem", sorted(PROBLEMS))
@pytest.mark.parametrize("method", sorted(RECIPES))
def test_recipe_runs_on_per_token_task(tmp_path: Path, method: str, problem: str) -> None:
    build_raw, metric, head = PROBLEMS[problem]
    raw = build_raw(tmp_path, method, rounds=1, task={"max_train_examples": 16, "max_eval_examples": 8},
                    client={"local_steps": 1}, evaluation={"at_start": False})
    exp = prepare(build_config(raw))
    records = LocalEngine(exp, tmp_path / "run").run()
    assert np.isfinite(records[-1]["train_loss"])
    assert 0.0 <= records[-1]["eval"][metric] <= 1.0
    assert any(name.startswith(head) for name in exp.slot.trainable)
