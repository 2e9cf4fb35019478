"""Plain data containers shared by tasks, partitioners and the engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

ProblemType = Literal["classification", "regression", "multiple_choice", "generation"]


@dataclass(frozen=True)
class Example:
    """One labelled example.

    ``texts`` holds one text or a pair. For multiple choice, ``texts[0]`` is the context and
    ``choices`` the candidate continuations; ``label`` is the index of the right one.
    ``group`` names the example's natural client (``partition.kind: natural``) when known.
    For generation, ``label`` is None and ``references`` holds the target text(s): training
    uses the first, evaluation scores a generated text against all of them.
    """

    texts: tuple[str, ...]
    label: int | float | None
    choices: tuple[str, ...] = ()
    group: str | None = None
    references: tuple[str, ...] = ()


@dataclass
class TaskData:
    """A loaded task: its meaning (labels, metrics) and its train/eval examples."""

    name: str
    problem_type: ProblemType
    label_names: tuple[str, ...]
    metrics: tuple[str, ...]
    train: list[Example] = field(default_factory=list)
    eval: list[Example] = field(default_factory=list)

    @property
    def num_labels(self) -> int:
        """Outputs of the head: classes, 1 for regression, 1 score per choice (unused for generation)."""
        if self.problem_type == "classification":
            return len(self.label_names)
        return 1

    @property
    def primary_metric(self) -> str:
        return self.metrics[0]
