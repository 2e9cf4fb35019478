"""``fedpeft predict``: a trained model's predictions for the rows of a data file.

The file is read by the file task's readers (CSV, TSV, JSON, JSON lines, Parquet), its texts are
encoded as the run encoded its examples (the run's ``task.max_length``, text and pair columns
joined with ``task.join_with``), and each row gets: the label name and its probability
(classification; a generative head's probability is the softmax over the label texts'
log-likelihoods), the value (regression), or the generated text (generation).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from fedpeft.data.tasks import DEFAULT_TEXT_COLUMNS, file_format, read_table, resolve_column
from fedpeft.data.types import Example
from fedpeft.export import LoadedModel
from fedpeft.metrics.recorder import ExportError
from fedpeft.models.encoding import EncodedData, GenerationSettings, encode_examples, output_scores
from fedpeft.models.generation import generate_texts

PREDICTABLE = ("classification", "regression", "generation")
"""Problem types ``predict`` serves (token classification, QA and multiple choice need inputs
beyond text columns and are not served yet)."""
OUTPUT_FORMATS = {".csv": "csv", ".tsv": "tsv", ".jsonl": "jsonl", ".json": "jsonl"}


def text_columns(frame: pd.DataFrame, loaded: LoadedModel, given: Sequence[str], source: str
                 ) -> tuple[list[Hashable], list[Hashable]]:
    """The (text, pair) columns: ``given`` (``--text-column``), else the run's ``task.text_columns``
    and ``task.text_pair_columns``, else the first of :data:`DEFAULT_TEXT_COLUMNS` the file has."""
    task_cfg = loaded.cfg.task
    specs: list[str | int] = list(given) or list(task_cfg.text_columns)
    if not specs:
        default = next((name for name in DEFAULT_TEXT_COLUMNS if name in frame.columns), None)
        if default is None:
            raise ExportError(f"--text-column: {source} has none of the columns {', '.join(DEFAULT_TEXT_COLUMNS)}; "
                              f"it has {', '.join(map(str, frame.columns))}")
        specs = [default]
    texts = [resolve_column(frame, spec, "--text-column", source) for spec in specs]
    pairs = [] if given else [resolve_column(frame, spec, "--text-column", source)
                              for spec in task_cfg.text_pair_columns]
    return texts, pairs


def read_examples(path: Path, loaded: LoadedModel, given_columns: Sequence[str]) -> tuple[pd.DataFrame, list[Example]]:
    """The input table, and one unlabelled example per row."""
    if not path.exists():
        raise ExportError(f"--input: no file {path}")
    frame = read_table(path, file_format(path, "auto"))
    texts, pairs = text_columns(frame, loaded, given_columns, path.name)
    join = loaded.cfg.task.join_with

    def joined(columns: Sequence[Hashable]) -> list[str]:
        return [join.join("" if pd.isna(cell) else str(cell) for cell in row)
                for row in zip(*(frame[column].tolist() for column in columns))]

    first = joined(texts)
    second = joined(pairs) if pairs else None
    # generation encodes a training target from the first reference; predicting only reads the prompt
    references = ("",) if loaded.task.problem_type == "generation" else ()
    examples = [Example(texts=(first[i],) if second is None else (first[i], second[i]), label=None,
                        references=references) for i in range(len(frame))]
    return frame[texts + pairs], examples


def encode(loaded: LoadedModel, examples: Sequence[Example]) -> EncodedData:
    problem = loaded.task.problem_type
    if problem not in PREDICTABLE:
        raise ExportError(f"predict supports {', '.join(PREDICTABLE)} tasks; this model's task "
                          f"{loaded.task.name!r} is {problem}")
    data = encode_examples(examples, loaded.tokenizer, loaded.head, loaded.task, loaded.cfg.task.max_length,
                           template=loaded.template)
    if problem == "generation":
        data.generation = GenerationSettings(loaded.tokenizer, loaded.cfg.evaluation.max_new_tokens,
                                             loaded.cfg.evaluation.num_beams)
    return data


@torch.no_grad()
def predict_batch(loaded: LoadedModel, data: EncodedData, idx: Sequence[int]) -> list[dict[str, Any]]:
    """One output record per example ``idx``."""
    problem = loaded.task.problem_type
    if problem == "generation":
        return [{"generated_text": text} for text in generate_texts(loaded.model, data, idx)]
    scores = output_scores(loaded.model, data, idx).float()
    if problem == "regression":
        return [{"predicted_value": float(value)} for value in scores[:, 0]]
    probabilities = torch.softmax(scores, dim=-1)
    best = probabilities.argmax(dim=-1)
    return [{"predicted_label": loaded.label_names[int(k)], "probability": float(probabilities[i, k])}
            for i, k in enumerate(best)]


def read_input(loaded: LoadedModel, path: Path, given_columns: Sequence[str]) -> tuple[pd.DataFrame, EncodedData]:
    """The input's text columns and their rows encoded for ``loaded`` (every input error raises here)."""
    inputs, examples = read_examples(path, loaded, given_columns)
    if not examples:
        raise ExportError(f"--input: {path} has no rows")
    return inputs, encode(loaded, examples)


def predict_rows(loaded: LoadedModel, inputs: pd.DataFrame, data: EncodedData, batch_size: int,
                 advance: Callable[[int, int], None] | None = None) -> pd.DataFrame:
    """``inputs`` with each row's prediction; ``advance(done, total)`` after each batch."""
    records: list[dict[str, Any]] = []
    for start in range(0, len(data), batch_size):
        records.extend(predict_batch(loaded, data, range(start, min(start + batch_size, len(data)))))
        if advance is not None:
            advance(len(records), len(data))
    return pd.concat([inputs.reset_index(drop=True), pd.DataFrame.from_records(records)], axis=1)


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
        table.to_csv(target, index=False, sep="\t" if fmt == "tsv" else ",")
