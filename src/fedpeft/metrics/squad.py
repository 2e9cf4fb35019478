"""SQuAD v1.1's exact match and F1, as the official evaluation script (``evaluate-v1.1.py``) computes them.

Both compare normalised answers: lower case, punctuation (``string.punctuation``) removed, the
articles ``a``/``an``/``the`` removed as whole words, white space collapsed (in that order, as the
script's ``normalize_answer``). F1 is the harmonic mean of precision and recall of the normalised
answers' bags of words. A question with several gold answers scores the maximum over them; the
split's score is the mean over questions. The official script reports percentages; here they are
fractions in [0, 1] like every other metric of the framework.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence

SQUAD_METRICS: tuple[str, ...] = ("exact_match", "squad_f1")

_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(text: str) -> str:
    """Lower case, drop punctuation, drop articles, collapse white space (the script's order)."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def exact_match(prediction: str, gold: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(gold))


def token_f1(prediction: str, gold: str) -> float:
    """F1 of the normalised answers' bags of words (0 when they share no word)."""
    predicted_tokens = normalize_answer(prediction).split()
    gold_tokens = normalize_answer(gold).split()
    same = sum((Counter(predicted_tokens) & Counter(gold_tokens)).values())
    if same == 0:
        return 0.0
    precision = same / len(predicted_tokens)
    recall = same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def squad_scores(predictions: Sequence[str], golds: Sequence[Sequence[str]],
                 names: Sequence[str] = SQUAD_METRICS) -> dict[str, float]:
    """Mean over questions of the best score against each question's gold answers."""
    unknown = [name for name in names if name not in SQUAD_METRICS]
    if unknown:
        raise ValueError(f"unknown QA metric {unknown[0]!r}; allowed: {', '.join(SQUAD_METRICS)}")
    if len(predictions) != len(golds):
        raise ValueError(f"{len(predictions)} predictions but {len(golds)} gold answer lists")
    if not predictions:
        raise ValueError("cannot compute QA metrics on zero questions")
    functions = {"exact_match": exact_match, "squad_f1": token_f1}
    totals = dict.fromkeys(names, 0.0)
    for index, (prediction, answers) in enumerate(zip(predictions, golds)):
        if not answers:
            raise ValueError(f"question {index} has no gold answer")
        for name in names:
            totals[name] += max(functions[name](prediction, answer) for answer in answers)
    return {name: totals[name] / len(predictions) for name in names}
