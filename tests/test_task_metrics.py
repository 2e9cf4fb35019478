"""Each metric against a value computed by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedpeft.metrics.task_metrics import compute_metrics

# references  1 1 1 0 0 0
# predictions 1 1 0 1 0 0  -> TP 2, FN 1, FP 1, TN 2
REFERENCES = np.array([1, 1, 1, 0, 0, 0])
PREDICTIONS = np.array([1, 1, 0, 1, 0, 0])


def test_accuracy() -> None:
    assert compute_metrics(["accuracy"], PREDICTIONS, REFERENCES) == {"accuracy": pytest.approx(4 / 6)}


def test_binary_f1_is_f1_of_class_one() -> None:
    references = np.array([1, 1, 1, 0, 0, 0, 0])
    predictions = np.array([1, 0, 0, 1, 0, 0, 0])  # TP 1, FN 2, FP 1: P 1/2, R 1/3
    f1 = 2 * (1 / 2) * (1 / 3) / (1 / 2 + 1 / 3)
    assert compute_metrics(["f1"], predictions, references)["f1"] == pytest.approx(f1)


def test_multiclass_f1_is_macro() -> None:
    references = np.array([0, 0, 1, 1, 2, 2])
    predictions = np.array([0, 1, 1, 1, 2, 0])
    # class 0: P 1/2 R 1/2 F 1/2; class 1: P 2/3 R 1 F 4/5; class 2: P 1 R 1/2 F 2/3
    macro = (1 / 2 + 4 / 5 + 2 / 3) / 3
    result = compute_metrics(["f1", "macro_f1"], predictions, references)
    assert result == {"f1": pytest.approx(macro), "macro_f1": pytest.approx(macro)}


def test_num_labels_decides_binary() -> None:
    references = np.array([0, 1, 1, 0])
    predictions = np.array([0, 1, 0, 0])
    # as 3-class macro-F1: class 0 F 4/5, class 1 F 2/3 (class 2 never seen)
    result = compute_metrics(["f1"], predictions, references, num_labels=3)
    assert result["f1"] == pytest.approx((4 / 5 + 2 / 3) / 2)


def test_matthews() -> None:
    # (TP*TN - FP*FN) / sqrt((TP+FP)(TP+FN)(TN+FP)(TN+FN)) = (4 - 1) / sqrt(3*3*3*3) = 1/3
    assert compute_metrics(["matthews"], PREDICTIONS, REFERENCES)["matthews"] == pytest.approx(1 / 3)


def test_pearson_and_spearman() -> None:
    references = np.array([1.0, 2.0, 3.0, 4.0])
    predictions = np.array([1.0, 2.0, 4.0, 3.0])
    # Pearson: deviations (-1.5,-0.5,0.5,1.5) vs (-1.5,-0.5,1.5,0.5): 4 / 5 = 0.8
    # Spearman: rank differences d = (0,0,1,-1): 1 - 6*2 / (4*15) = 0.8
    result = compute_metrics(["pearson", "spearman"], predictions, references)
    assert result == {"pearson": pytest.approx(0.8), "spearman": pytest.approx(0.8)}
    monotone = compute_metrics(["pearson", "spearman"], np.array([1.0, 2.0, 3.0, 10.0]), references)
    assert monotone["spearman"] == pytest.approx(1.0) and monotone["pearson"] < 1.0


def test_constant_prediction_correlation_is_zero() -> None:
    result = compute_metrics(["pearson", "spearman"], np.full(4, 2.5), np.array([1.0, 2.0, 3.0, 4.0]))
    assert result == {"pearson": 0.0, "spearman": 0.0}
    assert not any(math.isnan(value) for value in result.values())


def test_logits_are_reduced_by_argmax() -> None:
    logits = np.array([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7]])
    assert compute_metrics(["accuracy"], logits, np.array([1, 0, 0]))["accuracy"] == pytest.approx(2 / 3)


def test_unknown_metric_lists_allowed() -> None:
    with pytest.raises(ValueError, match="unknown metric 'bleu'; allowed: accuracy, f1"):
        compute_metrics(["bleu"], PREDICTIONS, REFERENCES)


def test_length_mismatch() -> None:
    with pytest.raises(ValueError, match="differ in length"):
        compute_metrics(["accuracy"], PREDICTIONS[:3], REFERENCES)


def test_constant_score_is_the_best_one_class_answer() -> None:
    """72 negatives, 28 positives: accuracy 0.72; binary F1 answers the positive class, 2 * 0.28 / 1.28;
    macro-F1 answers the majority, (2 * 0.72 / 1.72) / 2; Matthews 0; regression has no such level."""
    from fedpeft.metrics.task_metrics import constant_score

    references = [0] * 72 + [1] * 28
    assert constant_score("accuracy", references) == pytest.approx(0.72)
    assert constant_score("f1", references) == pytest.approx(2 * 0.28 / 1.28)
    assert constant_score("macro_f1", references) == pytest.approx(0.72 / 1.72)
    assert constant_score("matthews", references) == 0.0
    assert constant_score("pearson", references) is None and constant_score("accuracy", []) is None
    # three classes, 50/30/20: macro-F1 of answering class 0 is (2 * 0.5 / 1.5) / 3
    assert constant_score("macro_f1", [0] * 50 + [1] * 30 + [2] * 20) == pytest.approx(2 / 9)
