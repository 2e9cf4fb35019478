"""``fedpeft predict``: a trained model's predictions for the rows of a data file.

The file is read by the file task's readers (CSV, TSV, JSON, JSON lines, Parquet), its texts are
encoded as the run encoded its examples (the run's ``task.max_length``, text and pair columns
joined with ``task.join_with``), and each row gets: the label name and its probability
(classification; a generative head's probability is the softmax over the label texts'
log-likelihoods), the value (regression), or the generated text (generation).

Token classification and extractive QA are decoded by the evaluation's own code
(:class:`~fedpeft.models.token_tagging.TokenTagging`, :class:`~fedpeft.models.span_qa.SpanAnswers`,
with the run's ``task.doc_stride``, ``evaluation.bio_decoding``, ``n_best_size`` and
``max_answer_length``), so a row's prediction is what the run's evaluation predicted for it:

- token classification reads one column (``--text-column``, else ``tokens``, ``words``, ``text``,
  ``sentence`` or ``content``): a list cell (JSON, JSON lines, Parquet) is the sentence's words,
  any other cell a text split on white space (as CoNLL files are split into words). Each row gets
  ``predicted_tags`` (one BIO tag per word; a word cut off by ``task.max_length`` is ``O``) and
  ``entities``: the chunks seqeval's metrics count (:func:`~fedpeft.metrics.entity.entity_spans`),
  each ``{type, start, end, start_char, end_char, text}``: words ``start`` to ``end`` (exclusive)
  and their characters in the row's text (a list cell's text is its words joined by spaces).
- extractive QA reads a question and a context column (two ``--text-column``, question first,
  else ``question`` and ``context``); each row gets ``answer`` (the best span's context text),
  ``answer_start`` (its first character) and ``answer_score`` (start + end logit, as evaluation
  ranks spans); a question without a valid span answers ``""`` at ``-1`` with no score.

CSV and TSV outputs hold lists (words, tags, entities) as JSON text.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from fedpeft.data.tasks import DEFAULT_TEXT_COLUMNS, file_format, joined_texts, read_table, resolve_column
from fedpeft.data.types import Example
from fedpeft.export import LoadedModel
from fedpeft.metrics.entity import entity_spans
from fedpeft.metrics.recorder import ExportError
from fedpeft.models.encoding import (
    EncodedData,
    GenerationSettings,
    SpanSettings,
    encode_examples,
    output_scores,
    token_scores,
)
from fedpeft.models.generation import generate_texts
from fedpeft.models.span_qa import SpanAnswers
from fedpeft.models.token_tagging import TokenTagging

PREDICTABLE = ("classification", "regression", "generation", "token_classification", "extractive_qa")
"""Problem types ``predict`` serves (multiple choice needs candidate columns and is not served yet)."""
WORD_COLUMNS = ("tokens", "words")
"""Columns of pre-split words a token-classification input is looked for in first."""
QA_COLUMNS = ("question", "context")
"""An extractive-QA input's default columns (SQuAD's and Hugging Face's names)."""
OUTPUT_FORMATS = {".csv": "csv", ".tsv": "tsv", ".jsonl": "jsonl", ".json": "jsonl"}


def text_columns(frame: pd.DataFrame, loaded: LoadedModel, given: Sequence[str], source: str
                 ) -> tuple[list[Hashable], list[Hashable]]:
    """The (text, pair) columns: ``given`` (``--text-column``), else the run's ``task.text_columns``
    and ``task.text_pair_columns``, else the first of :data:`DEFAULT_TEXT_COLUMNS` the file has."""
    task_cfg = loaded.cfg.task
    specs: list[str | int] = list(given) or list(task_cfg.text_columns)
    if not specs:
        specs = [first_column(frame, DEFAULT_TEXT_COLUMNS, source)]
    texts = [resolve_column(frame, spec, "--text-column", source) for spec in specs]
    pairs = [] if given else [resolve_column(frame, spec, "--text-column", source)
                              for spec in task_cfg.text_pair_columns]
    return texts, pairs


def read_examples(path: Path, loaded: LoadedModel, given_columns: Sequence[str]) -> tuple[pd.DataFrame, list[Example]]:
    """The input columns (as the output repeats them), and one unlabelled example per row."""
    if not path.exists():
        raise ExportError(f"--input: no file {path}")
    frame = read_table(path, file_format(path, "auto"))
    problem = loaded.task.problem_type
    if problem == "token_classification":
        return sentence_examples(frame, given_columns, path.name)
    if problem == "extractive_qa":
        return question_examples(frame, given_columns, path.name)
    texts, pairs = text_columns(frame, loaded, given_columns, path.name)
    join = loaded.cfg.task.join_with
    first = joined_texts(frame, texts, join)
    second = joined_texts(frame, pairs, join) if pairs else None
    # generation encodes a training target from the first reference; predicting only reads the prompt
    references = ("",) if problem == "generation" else ()
    examples = [Example(texts=(first[i],) if second is None else (first[i], second[i]), label=None,
                        references=references) for i in range(len(frame))]
    return frame[texts + pairs], examples


def _columns_message(frame: pd.DataFrame) -> str:
    return f"it has {', '.join(map(str, frame.columns))}"


def first_column(frame: pd.DataFrame, candidates: Sequence[str], source: str) -> str:
    """The first of ``candidates`` that ``frame`` has (an input's default column)."""
    found = next((name for name in candidates if name in frame.columns), None)
    if found is None:
        raise ExportError(f"--text-column: {source} has none of the columns {', '.join(candidates)}; "
                          f"{_columns_message(frame)}")
    return found


def sentence(cell: Any) -> tuple[str, tuple[str, ...]]:
    """A row's text and words: a list cell is the words (its text: them joined by spaces), any other
    cell a text split on white space."""
    if isinstance(cell, (list, tuple, np.ndarray)):
        words = tuple(str(word) for word in cell)
        return " ".join(words), words
    text = "" if cell is None or pd.isna(cell) else str(cell)
    return text, tuple(text.split())


def sentence_examples(frame: pd.DataFrame, given: Sequence[str], source: str) -> tuple[pd.DataFrame, list[Example]]:
    """Token classification: one sentence per row, from ``given`` or the first of
    :data:`WORD_COLUMNS` and :data:`DEFAULT_TEXT_COLUMNS` the file has (see the module docstring)."""
    if len(given) > 1:
        raise ExportError(f"--text-column: token classification reads one column (words or a text), not {len(given)}")
    column = (resolve_column(frame, given[0], "--text-column", source) if given
              else first_column(frame, (*WORD_COLUMNS, *DEFAULT_TEXT_COLUMNS), source))
    examples = []
    for cell in frame[column].tolist():
        text, words = sentence(cell)
        examples.append(Example(texts=(text,), label=None, words=words))
    return frame[[column]], examples


def question_examples(frame: pd.DataFrame, given: Sequence[str], source: str) -> tuple[pd.DataFrame, list[Example]]:
    """Extractive QA: one (question, context) pair per row, from two ``given`` columns or
    :data:`QA_COLUMNS`."""
    if given and len(given) != 2:
        raise ExportError(f"--text-column: extractive QA reads two columns, the question then the context, "
                          f"not {len(given)}")
    if given:
        columns = [resolve_column(frame, spec, "--text-column", source) for spec in given]
    else:
        missing = [name for name in QA_COLUMNS if name not in frame.columns]
        if missing:
            raise ExportError(f"--input: {source} has no {' and no '.join(map(repr, missing))} column (extractive QA "
                              f"reads question and context, or two --text-column); {_columns_message(frame)}")
        columns = list(QA_COLUMNS)
    cells = [joined_texts(frame, [column], "") for column in columns]
    examples = [Example(texts=(question, context), label=None) for question, context in zip(*cells)]
    return frame[columns], examples


def encode(loaded: LoadedModel, examples: Sequence[Example]) -> EncodedData:
    problem = loaded.task.problem_type
    if problem not in PREDICTABLE:
        raise ExportError(f"predict supports {', '.join(PREDICTABLE)} tasks; this model's task "
                          f"{loaded.task.name!r} is {problem}")
    data = encode_examples(examples, loaded.tokenizer, loaded.head, loaded.task, loaded.cfg.task.max_length,
                           template=loaded.template, spans=SpanSettings.from_config(loaded.cfg))
    if problem == "generation":
        data.generation = GenerationSettings(loaded.tokenizer, loaded.cfg.evaluation.max_new_tokens,
                                             loaded.cfg.evaluation.num_beams)
    return data


@dataclass
class PredictInput:
    """An input file read for a model: the input ``columns`` the output repeats, one example per
    row and their encoding (several rows per example for QA windows)."""

    columns: pd.DataFrame
    examples: list[Example]
    data: EncodedData

    def __len__(self) -> int:
        return len(self.examples)


def word_offsets(text: str, words: Sequence[str]) -> list[tuple[int, int]]:
    """Each word's ``(start, end)`` characters in ``text``, which holds the words in order."""
    offsets, position = [], 0
    for word in words:
        start = text.index(word, position)
        position = start + len(word)
        offsets.append((start, position))
    return offsets


def entity_records(example: Example, tags: Sequence[str]) -> list[dict[str, Any]]:
    """The entities of a sentence's predicted tags, with their words' and characters' positions."""
    text = example.texts[0]
    offsets = word_offsets(text, example.words)
    records = []
    for kind, start, end in entity_spans(tags):
        first, last = offsets[start][0], offsets[end - 1][1]
        records.append({"type": kind, "start": start, "end": end, "start_char": first, "end_char": last,
                        "text": text[first:last]})
    return records


def span_records(loaded: LoadedModel, batch: PredictInput, idx: Sequence[int]) -> list[dict[str, Any]]:
    """Token classification and QA: the evaluation's decoding of the per-token scores of ``idx``."""
    data = batch.data
    rows = data.rows_of(idx).tolist()
    scores = token_scores(loaded.model, data, rows, len(rows))
    if isinstance(data.scorer, TokenTagging):
        tags = [data.scorer.predict(row, row_scores) for row, row_scores in zip(rows, scores, strict=True)]
        return [{"predicted_tags": row_tags, "entities": entity_records(batch.examples[i], row_tags)}
                for i, row_tags in zip(idx, tags, strict=True)]
    assert isinstance(data.scorer, SpanAnswers)
    best = data.scorer.best_spans(rows, scores)
    records = []
    for i in idx:
        score, start, end = best[i]
        found = bool(np.isfinite(score))
        records.append({"answer": batch.examples[i].texts[1][start:end], "answer_start": start if found else -1,
                        "answer_score": float(score) if found else None})
    return records


@torch.no_grad()
def predict_batch(loaded: LoadedModel, batch: PredictInput, idx: Sequence[int]) -> list[dict[str, Any]]:
    """One output record per example ``idx``."""
    problem, data = loaded.task.problem_type, batch.data
    if problem in ("token_classification", "extractive_qa"):
        return span_records(loaded, batch, idx)
    if problem == "generation":
        return [{"generated_text": text} for text in generate_texts(loaded.model, data, idx)]
    scores = output_scores(loaded.model, data, idx).float()
    if problem == "regression":
        return [{"predicted_value": float(value)} for value in scores[:, 0]]
    probabilities = torch.softmax(scores, dim=-1)
    best = probabilities.argmax(dim=-1)
    return [{"predicted_label": loaded.label_names[int(k)], "probability": float(probabilities[i, k])}
            for i, k in enumerate(best)]


def read_input(loaded: LoadedModel, path: Path, given_columns: Sequence[str]) -> PredictInput:
    """The input's columns and their rows encoded for ``loaded`` (every input error raises here)."""
    columns, examples = read_examples(path, loaded, given_columns)
    if not examples:
        raise ExportError(f"--input: {path} has no rows")
    return PredictInput(columns, examples, encode(loaded, examples))


def predict_rows(loaded: LoadedModel, batch: PredictInput, batch_size: int,
                 advance: Callable[[int, int], None] | None = None) -> pd.DataFrame:
    """The input columns with each row's prediction; ``advance(done, total)`` after each batch
    (of ``batch_size`` input rows)."""
    records: list[dict[str, Any]] = []
    for start in range(0, len(batch), batch_size):
        records.extend(predict_batch(loaded, batch, range(start, min(start + batch_size, len(batch)))))
        if advance is not None:
            advance(len(records), len(batch))
    return pd.concat([batch.columns.reset_index(drop=True), pd.DataFrame.from_records(records)], axis=1)


def output_format(path: Path | None) -> str:
    if path is None:
        return "csv"
    fmt = OUTPUT_FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise ExportError(f"--output: cannot tell the format of {path.name}; use one of "
                          f"{', '.join(OUTPUT_FORMATS)}")
    return fmt


def write_predictions(table: pd.DataFrame, path: Path | None) -> None:
    """CSV/TSV or JSON lines by ``path``'s extension; CSV on stdout without a path."""
    fmt = output_format(path)
    target: Any = sys.stdout if path is None else path
    if fmt == "jsonl":
        table.to_json(target, orient="records", lines=True, force_ascii=False)
    else:
        lists_as_json(table).to_csv(target, index=False, sep="\t" if fmt == "tsv" else ",")


def lists_as_json(table: pd.DataFrame) -> pd.DataFrame:
    """``table`` with list cells (words, tags, entities) written as JSON text: a CSV cell holds text."""
    def cell_text(cell: Any) -> Any:
        if isinstance(cell, np.ndarray):
            cell = cell.tolist()
        return json.dumps(cell, ensure_ascii=False) if isinstance(cell, (list, tuple)) else cell

    return table.apply(lambda column: column.map(cell_text) if column.dtype == object else column)
