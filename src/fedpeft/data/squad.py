"""SQuAD-format extractive QA files, the title split of the SQuAD v1.1 dev file, and XQuAD's overlap guard.

A SQuAD file is ``{"data": [{"title", "paragraphs": [{"context", "qas": [{"id", "question",
"answers": [{"text", "answer_start"}, ...]}]}]}]}``. Each question becomes one example whose
``texts`` are ``(question, context)``, ``references`` the gold answer texts, ``answer_starts``
their character offsets, and ``group`` the article title (the natural client of FeDeRA-style
partitions; see :mod:`fedpeft.data.partition`). Every answer must be the context's text at its
offset; unanswerable questions (SQuAD 2.0) are not supported.

Only SQuAD v1.1's dev file is in the data folder, so the built-in ``squad`` task splits its 48
articles by title (:func:`split_by_title`): titles sorted, every fifth one (positions 4, 9, ...,
44; Python's string order) held out for evaluation. That gives 39 training articles (1,760
paragraphs, 9,231 questions) and 9 evaluation articles (307 paragraphs, 1,339 questions):
Black_Death, Ctenophora, French_and_Indian_War, Huguenot, "Jacksonville,_Florida", Normans,
Private_school, Steam_engine and "Victoria_(Australia)".

XQuAD's English part is 240 paragraphs of the very same dev file, from all 48 articles: any
model trained on SQuAD dev articles has seen them. :func:`check_no_overlap` refuses a training
set that shares an article title or a context paragraph with the evaluation set.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fedpeft.config import ConfigError
from fedpeft.data.types import Example

EVAL_EVERY = 5
"""The ``squad`` task evaluates on every fifth article (by sorted title)."""


def read_squad(path: Path, field: str) -> list[Example]:
    """One example per question of a SQuAD-format file (label None: classes come later)."""
    try:
        document = json.loads(path.read_text(encoding="utf-8-sig"))
    except json.JSONDecodeError as err:
        raise ConfigError(field, f"{path} is not valid JSON: {err}") from err
    articles = document.get("data") if isinstance(document, dict) else None
    if not isinstance(articles, list):
        raise ConfigError(field, f"{path}: expected SQuAD format, an object with a 'data' list of articles")
    examples = []
    for number, article in enumerate(articles):
        title = str(article.get("title", f"article {number}"))
        for paragraph in _items(article, "paragraphs", f"{path}: article {title!r}", field):
            context = paragraph.get("context")
            if not isinstance(context, str):
                raise ConfigError(field, f"{path}: a paragraph of article {title!r} has no 'context' text")
            for qa in _items(paragraph, "qas", f"{path}: a paragraph of {title!r}", field):
                examples.append(_question(qa, context, title, f"{path}: question {qa.get('id', '?')!r}", field))
    if not examples:
        raise ConfigError(field, f"{path}: no questions found")
    return examples


def _items(node: dict[str, Any], key: str, where: str, field: str) -> list[dict[str, Any]]:
    items = node.get(key)
    if not isinstance(items, list) or not all(isinstance(item, dict) for item in items):
        raise ConfigError(field, f"{where} has no '{key}' list")
    return items


def _question(qa: dict[str, Any], context: str, title: str, where: str, field: str) -> Example:
    question, answers = qa.get("question"), qa.get("answers")
    if not isinstance(question, str) or not isinstance(answers, list):
        raise ConfigError(field, f"{where}: needs a 'question' text and an 'answers' list")
    if not answers:
        raise ConfigError(field, f"{where} has no answer; unanswerable questions (SQuAD 2.0) are not supported")
    texts, starts = [], []
    for answer in answers:
        text, start = answer.get("text"), answer.get("answer_start")
        if (not isinstance(text, str) or not text.strip() or not isinstance(start, int)
                or context[start : start + len(text)] != text):
            raise ConfigError(field, f"{where}: answer {answer!r} is not a non-empty text of the context at its "
                              "answer_start")
        texts.append(text)
        starts.append(start)
    return Example(texts=(question, context), label=None, group=title, references=tuple(texts),
                   answer_starts=tuple(starts))


def split_by_title(examples: Sequence[Example], every: int = EVAL_EVERY) -> tuple[list[Example], list[Example]]:
    """(train, eval): the articles at positions ``every-1, 2*every-1, ...`` of the sorted titles
    are evaluation articles, the rest training ones; question order is kept."""
    titles = sorted({example.group for example in examples if example.group is not None})
    held_out = {title for position, title in enumerate(titles) if position % every == every - 1}
    train = [example for example in examples if example.group not in held_out]
    evaluation = [example for example in examples if example.group in held_out]
    return train, evaluation


def check_no_overlap(train: Sequence[Example], evaluation: Sequence[Example], field: str, by_title: bool) -> None:
    """Refuse to evaluate on contexts (and, with ``by_title``, articles) that training also holds."""
    contexts = {example.texts[1] for example in train}
    shared = {example.texts[1] for example in evaluation} & contexts
    if shared:
        raise ConfigError(field, f"the training data holds {len(shared)} of the evaluation set's context paragraphs; "
                          "training on them would leak the answers into evaluation")
    if by_title:
        titles = {example.group for example in train} & {example.group for example in evaluation}
        if titles:
            raise ConfigError(field, f"the training data shares {len(titles)} article(s) with the evaluation set "
                              f"(e.g. {sorted(titles)[0]!r}); XQuAD is a subset of SQuAD v1.1 dev, so train on "
                              "other articles (e.g. SQuAD v1.1 train)")
