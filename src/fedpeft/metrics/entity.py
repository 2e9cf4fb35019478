"""Entity-level precision, recall and F1 of BIO tag sequences (``seqeval``, conlleval's rules).

An entity is a maximal chunk ``B-X I-X ... I-X``; a prediction counts only when its type and both
boundaries match a gold entity exactly. Scores are micro-averaged over all entities of the split
(the WNUT 2017 / CoNLL convention), computed by ``seqeval`` in its default, conlleval-compatible
mode: an ``I-X`` that does not continue an ``X`` chunk starts a new one. ``tag_accuracy`` is the
fraction of words whose tag is right (``O`` included). Values are fractions in [0, 1].
:func:`entity_spans` lists one sentence's entities by the same rules (what ``fedpeft predict``
writes), so a predicted span is exactly an entity the metrics count.
"""

from __future__ import annotations

from collections.abc import Sequence

from seqeval.metrics import accuracy_score, f1_score, precision_score, recall_score
from seqeval.metrics.sequence_labeling import get_entities

ENTITY_METRICS: tuple[str, ...] = ("entity_f1", "entity_precision", "entity_recall", "tag_accuracy")


def entity_scores(gold: Sequence[Sequence[str]], predicted: Sequence[Sequence[str]],
                  names: Sequence[str] = ENTITY_METRICS) -> dict[str, float]:
    """The metrics ``names`` of predicted tag sequences against gold ones (one list per sentence)."""
    unknown = [name for name in names if name not in ENTITY_METRICS]
    if unknown:
        raise ValueError(f"unknown entity metric {unknown[0]!r}; allowed: {', '.join(ENTITY_METRICS)}")
    if len(gold) != len(predicted):
        raise ValueError(f"{len(gold)} gold sentences but {len(predicted)} predicted ones")
    for index, (g, p) in enumerate(zip(gold, predicted)):
        if len(g) != len(p):
            raise ValueError(f"sentence {index}: {len(g)} gold tags but {len(p)} predicted ones")
    if not gold:
        raise ValueError("cannot compute entity metrics on zero sentences")
    y_true, y_pred = [list(g) for g in gold], [list(p) for p in predicted]
    functions = {
        "entity_f1": lambda: f1_score(y_true, y_pred, zero_division=0),
        "entity_precision": lambda: precision_score(y_true, y_pred, zero_division=0),
        "entity_recall": lambda: recall_score(y_true, y_pred, zero_division=0),
        "tag_accuracy": lambda: accuracy_score(y_true, y_pred),
    }
    return {name: float(functions[name]()) for name in names}


def entity_spans(tags: Sequence[str]) -> list[tuple[str, int, int]]:
    """The entities of one sentence's BIO tags as ``(type, first word, last word + 1)``, chunked by
    ``seqeval``'s default rules, the ones :func:`entity_scores` counts with."""
    return [(kind, start, end + 1) for kind, start, end in get_entities(list(tags))]
