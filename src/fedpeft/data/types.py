"""Plain data containers shared by tasks, partitioners and the engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

ProblemType = Literal[
    "classification", "regression", "multiple_choice", "generation", "token_classification", "extractive_qa"
]

SPAN_PROBLEMS: tuple[ProblemType, ...] = ("token_classification", "extractive_qa")
"""Problem types whose label is not the head's output but the example's class for label-skewed
partitions (FeDeRA App. A.2); their supervision lives in ``tags`` / ``answer_starts``."""


@dataclass(frozen=True)
class Example:
    """One labelled example.

    ``texts`` holds one text or a pair. For multiple choice, ``texts[0]`` is the context and
    ``choices`` the candidate continuations; ``label`` is the index of the right one.
    ``group`` names the example's natural client (``partition.kind: natural``) when known.
    For generation, ``label`` is None and ``references`` holds the target text(s): training
    uses the first, evaluation scores a generated text against all of them.

    Token classification: ``words`` are the sentence's words and ``tags`` their tag ids (into
    :attr:`TaskData.label_names`); ``texts`` is the words joined by spaces (for display).
    Extractive QA: ``texts`` is ``(question, context)``, ``references`` the gold answer texts and
    ``answer_starts`` their character offsets in the context; ``group`` is the article title.
    For both, ``label`` is the example's *class* for label-skewed partitions (an id into
    :attr:`TaskData.example_classes`): the set of tags it contains (NER) or its article (QA).
    """

    texts: tuple[str, ...]
    label: int | float | None
    choices: tuple[str, ...] = ()
    group: str | None = None
    references: tuple[str, ...] = ()
    words: tuple[str, ...] = ()
    tags: tuple[int, ...] = ()
    answer_starts: tuple[int, ...] = ()


@dataclass
class TaskData:
    """A loaded task: its meaning (labels, metrics) and its train/eval examples.

    ``label_names`` are the head's classes (the tags for token classification, empty for QA);
    ``example_classes`` names the values of ``Example.label`` when those are not head outputs
    (token classification and QA, see :class:`Example`). ``validation`` is the split carved out
    of the training data (or read from ``task.validation_file``) for tuning; empty when none.
    """

    name: str
    problem_type: ProblemType
    label_names: tuple[str, ...]
    metrics: tuple[str, ...]
    train: list[Example] = field(default_factory=list)
    eval: list[Example] = field(default_factory=list)
    example_classes: tuple[str, ...] = ()
    validation: list[Example] = field(default_factory=list)

    @property
    def num_labels(self) -> int:
        """Outputs of the head: classes (tags), 2 for QA (start, end), 1 for regression or a
        choice's score (unused for generation)."""
        if self.problem_type in ("classification", "token_classification"):
            return len(self.label_names)
        if self.problem_type == "extractive_qa":
            return 2
        return 1

    @property
    def class_names(self) -> tuple[str, ...]:
        """Names of the classes ``Example.label`` holds, as partitions and their summaries see them."""
        return self.example_classes if self.problem_type in SPAN_PROBLEMS else self.label_names

    @property
    def primary_metric(self) -> str:
        return self.metrics[0]
