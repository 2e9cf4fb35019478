"""ROUGE-1/2/L of generated texts, each against all of its references (the ``rouge-score`` package).

Per example the F-measure against the best-matching reference (``RougeScorer.score_multi``: for
each metric, the reference with the highest F-measure), then the mean over examples: the
multi-reference convention of the E2E NLG challenge. Texts are tokenized by rouge-score's default
tokenizer (lower-cased, non-alphanumerics dropped) with its Porter stemmer, as in most
summarization papers; values are fractions in [0, 1].
"""

from __future__ import annotations

from collections.abc import Sequence

ROUGE_METRICS: tuple[str, ...] = ("rouge1", "rouge2", "rougeL")


def rouge_scores(predictions: Sequence[str], references: Sequence[Sequence[str]],
                 names: Sequence[str] = ROUGE_METRICS, use_stemmer: bool = True) -> dict[str, float]:
    """Mean over examples of the best F-measure against each example's references, per metric."""
    unknown = [name for name in names if name not in ROUGE_METRICS]
    if unknown:
        raise ValueError(f"unknown ROUGE metric {unknown[0]!r}; allowed: {', '.join(ROUGE_METRICS)}")
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions but {len(references)} reference lists")
    if not predictions:
        raise ValueError("cannot compute ROUGE on zero examples")
    from rouge_score import rouge_scorer  # with nltk, half a second of start-up that only generation needs

    scorer = rouge_scorer.RougeScorer(list(names), use_stemmer=use_stemmer)
    totals = dict.fromkeys(names, 0.0)
    for index, (prediction, refs) in enumerate(zip(predictions, references, strict=True)):
        if not refs:
            raise ValueError(f"example {index} has no reference text")
        scores = scorer.score_multi(list(refs), prediction)
        for name in names:
            totals[name] += scores[name].fmeasure
    return {name: totals[name] / len(predictions) for name in names}
