"""Tasks: where the data is, how to read it, and what its labels and metrics mean.

Three kinds of task, picked by ``task.name``:

- a **built-in** task (:data:`BUILTIN_TASKS`: ``sst2``, ``mnli``, ``20newsgroups``, ...) reads the
  benchmark files described in ``data/README.md`` from the data folder (:func:`resolve_data_dir`),
  in the format each one ships in (GLUE TSV, JSON objects of records, SuperGLUE JSONL, the
  20 Newsgroups tarball, ...);
- ``file`` reads a user's own CSV / TSV / JSON / JSONL / Parquet files, described by the
  ``task.*`` fields (text columns, label column, label set, problem type, metrics); with
  ``problem_type: token_classification`` CoNLL files (:mod:`fedpeft.data.conll`), with
  ``extractive_qa`` SQuAD-format JSON (:mod:`fedpeft.data.squad`);
- ``hf`` reads a Hugging Face dataset id with ``datasets.load_dataset`` (optional dependency).

:func:`load_task` dispatches and returns a :class:`~fedpeft.data.types.TaskData`. Every bad value
raises :class:`~fedpeft.config.ConfigError` naming the ``task.*`` field and what is allowed.
"""

from __future__ import annotations

import csv
import json
import math
import os
import tarfile
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from fedpeft.config import ConfigError, TaskConfig
from fedpeft.data.conll import Sentence, read_conll, sentence_class, tag_ids, tag_set
from fedpeft.data.question_clusters import Embedder, minilm_embeddings, question_classes
from fedpeft.data.squad import check_no_overlap, read_squad, split_by_title
from fedpeft.data.types import SPAN_PROBLEMS, Example, ProblemType, TaskData
from fedpeft.data.validation import split_validation
from fedpeft.metrics.entity import ENTITY_METRICS
from fedpeft.metrics.rouge import ROUGE_METRICS
from fedpeft.metrics.squad import SQUAD_METRICS
from fedpeft.metrics.task_metrics import METRIC_NAMES

SUBSAMPLE_SEED = 0
"""Seed of the permutation behind ``max_train_examples`` / ``max_eval_examples``: fixed (not the
experiment seed) so that every run and every method sees the same subsample."""

DATA_ENV_VAR = "FEDPEFT_DATA"

Split = tuple[list[Example], list[Example]]
Loader = Callable[[Path, TaskConfig, str], Split]
"""A built-in loader: ``(data_dir, cfg, eval_split) -> (train, eval)``."""


# --------------------------------------------------------------------------------------------
# Where the data is


def resolve_data_dir(explicit: str | None = None) -> Path:
    """The folder holding the benchmark data.

    In order: ``explicit`` (the CLI's ``--data-dir`` or ``task.data_dir``), the ``FEDPEFT_DATA``
    environment variable, ``../shared/data`` from the current directory, and ``../shared/data``
    beside the repository this file lives in (an editable install). An explicit value or
    environment variable that names a missing folder is an error rather than silently skipped.
    """
    if explicit:
        return _existing_dir(Path(explicit).expanduser(), "task.data_dir", "--data-dir / task.data_dir")
    from_env = os.environ.get(DATA_ENV_VAR)
    if from_env:
        return _existing_dir(Path(from_env).expanduser(), "task.data_dir", f"${DATA_ENV_VAR}")
    repo_root = Path(__file__).resolve().parents[3]
    for candidate in (Path.cwd() / ".." / "shared" / "data", repo_root / ".." / "shared" / "data"):
        if candidate.is_dir():
            return candidate.resolve()
    raise ConfigError(
        "task.data_dir",
        f"no data folder found; pass --data-dir, set task.data_dir or the {DATA_ENV_VAR} environment "
        "variable, or place the data at ../shared/data",
    )


def _existing_dir(path: Path, field: str, source: str) -> Path:
    if not path.is_dir():
        raise ConfigError(field, f"data folder {path} (from {source}) does not exist")
    return path.resolve()


# --------------------------------------------------------------------------------------------
# Reading tables


def read_delimited(
    path: Path, sep: str, header: bool, quoting: int, dtype: type | None = None
) -> pd.DataFrame:
    """Read a CSV/TSV file. A UTF-8 BOM is dropped; only empty cells count as missing.

    Without a header the columns are the integer positions ``0..n-1``. GLUE-style TSV files are
    read with ``quoting=csv.QUOTE_NONE`` because their sentences contain bare quote characters.
    """
    return pd.read_csv(
        path,
        sep=sep,
        header=0 if header else None,
        quoting=quoting,
        encoding="utf-8-sig",
        keep_default_na=False,
        na_values=[""],
        dtype=dtype,
    )


def read_json_records(path: Path) -> pd.DataFrame:
    """Read a JSON file holding a list of records or an object of records (``{"0": {...}, ...}``).

    An object of equal-length lists is read as columns, and a file that turns out to hold one
    record per line is read as JSON lines.
    """
    text = path.read_text(encoding="utf-8-sig")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        if err.msg == "Extra data":
            return read_json_lines(path)
        raise ConfigError("task.format", f"{path} is not valid JSON: {err}") from err
    if isinstance(data, list) and all(isinstance(record, dict) for record in data):
        return pd.DataFrame.from_records(data)
    if isinstance(data, dict) and all(isinstance(record, dict) for record in data.values()):
        return pd.DataFrame.from_records(list(data.values()))
    if isinstance(data, dict) and all(isinstance(column, list) for column in data.values()):
        return pd.DataFrame(data)
    raise ConfigError(
        "task.format",
        f"{path}: expected a list of records, an object of records or an object of columns",
    )


def read_json_lines(path: Path) -> pd.DataFrame:
    """Read one JSON record per line, keeping each value's JSON type (no dtype guessing)."""
    try:
        return pd.read_json(path, lines=True, dtype=False, encoding="utf-8-sig")
    except ValueError as err:
        raise ConfigError("task.format", f"cannot read {path} as JSON lines: {err}") from err


FILE_FORMATS = ("csv", "tsv", "json", "jsonl", "parquet")
_COMPRESSION_SUFFIXES = (".gz", ".bz2", ".xz", ".zip", ".zst")


def file_format(path: Path, declared: str) -> str:
    """The format of ``path``: ``declared`` unless it is ``auto``, else from the extension
    (``.csv``, ``.tsv``, ``.json``, ``.jsonl``/``.ndjson``, ``.parquet``/``.pq``; a compression
    suffix such as ``.gz`` is looked through)."""
    if declared != "auto":
        return declared
    name = path.name.lower()
    for suffix in _COMPRESSION_SUFFIXES:
        name = name.removesuffix(suffix)
    extension = Path(name).suffix.lstrip(".")
    aliases = {"ndjson": "jsonl", "pq": "parquet", "txt": "tsv"}
    extension = aliases.get(extension, extension)
    if extension not in FILE_FORMATS:
        raise ConfigError(
            "task.format",
            f"cannot tell the format of {path.name} from its extension; set task.format to one of "
            f"{', '.join(FILE_FORMATS)}",
        )
    return extension


def read_table(path: Path, fmt: str, header: bool = True) -> pd.DataFrame:
    """Read a user's data file into a DataFrame (types inferred, as each format stores them)."""
    if fmt == "csv":
        return read_delimited(path, ",", header, csv.QUOTE_MINIMAL)
    if fmt == "tsv":
        return read_delimited(path, "\t", header, csv.QUOTE_NONE)
    if fmt == "json":
        return read_json_records(path)
    if fmt == "jsonl":
        return read_json_lines(path)
    if fmt == "parquet":
        return pd.read_parquet(path)
    raise ConfigError("task.format", f"unknown format {fmt!r}; allowed: {', '.join(FILE_FORMATS)}")


# --------------------------------------------------------------------------------------------
# Built-in tasks


@dataclass(frozen=True)
class TaskSpec:
    """A built-in task: what it is, its label set and metrics (first = primary), its loader.

    ``eval_splits`` lists the values ``task.eval_split`` accepts; the first is the default.
    ``reads_train_file``: an evaluation-only task whose training data is ``task.train_file``.
    ``refused_splits`` pairs a split that must not be used with the reason why.
    """

    name: str
    description: str
    problem_type: ProblemType
    label_names: tuple[str, ...]
    metrics: tuple[str, ...]
    loader: Loader
    eval_splits: tuple[str, ...] = ("dev",)
    reads_train_file: bool = False
    refused_splits: tuple[tuple[str, str], ...] = ()


def _require_file(path: Path) -> Path:
    if not path.is_file():
        raise ConfigError("task.data_dir", f"file not found: {path}; is the data folder right?")
    return path


def _read_glue_tsv(path: Path, header: bool = True) -> pd.DataFrame:
    """GLUE TSV: tab-separated, no quoting, every cell read as a string."""
    return read_delimited(_require_file(path), "\t", header, csv.QUOTE_NONE, dtype=str)


def _read_jsonl_records(path: Path) -> list[dict[str, Any]]:
    with _require_file(path).open(encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def _read_json_object_records(path: Path) -> list[dict[str, Any]]:
    """The ``glue_subsets`` layout: one JSON object ``{"0": record, "1": record, ...}``."""
    data = json.loads(_require_file(path).read_text(encoding="utf-8"))
    return list(data.values())


def _label_index(label_names: Sequence[str], path: Path) -> Callable[[Any], int]:
    """Map a label to its class id: by name, or as an integer id (``"1"`` or ``1``)."""
    by_name = {name: index for index, name in enumerate(label_names)}

    def to_index(value: Any) -> int:
        if isinstance(value, str) and value in by_name:
            return by_name[value]
        try:
            index = int(value)
        except (TypeError, ValueError):
            index = -1
        if 0 <= index < len(label_names) and str(index) == str(value).strip():
            return index
        raise ConfigError(
            "task.data_dir",
            f"{path}: unexpected label {value!r}; expected one of {list(label_names)} or their ids",
        )

    return to_index


def _examples(
    rows: Sequence[Sequence[Any]],
    labels: Sequence[Any],
    to_label: Callable[[Any], int | float],
) -> list[Example]:
    """Examples from parallel text tuples and raw labels."""
    return [
        Example(texts=tuple(_text(cell) for cell in row), label=to_label(label))
        for row, label in zip(rows, labels, strict=True)
    ]


def _frame_examples(
    frame: pd.DataFrame, text_columns: Sequence[Hashable], label_column: Hashable, to_label: Callable
) -> list[Example]:
    rows = list(zip(*(frame[column].tolist() for column in text_columns)))
    return _examples(rows, frame[label_column].tolist(), to_label)


def _record_examples(
    records: Sequence[dict[str, Any]], text_keys: Sequence[str], label_field: str, to_label: Callable
) -> list[Example]:
    rows = [tuple(record[key] for key in text_keys) for record in records]
    return _examples(rows, [record[label_field] for record in records], to_label)


def _glue_tsv_task(
    folder: str,
    text_columns: Sequence[str | int],
    label_column: str | int,
    label_names: Sequence[str],
    header: bool = True,
) -> Loader:
    """A GLUE task shipped as ``train.tsv`` + ``dev.tsv``; ``label_names=()`` means regression."""

    def load(data_dir: Path, cfg: TaskConfig, eval_split: str) -> Split:
        splits = []
        for file_name in ("train.tsv", "dev.tsv"):
            path = data_dir / folder / file_name
            frame = _read_glue_tsv(path, header)
            to_label = _label_index(label_names, path) if label_names else _float_label(path)
            splits.append(_frame_examples(frame, text_columns, label_column, to_label))
        return splits[0], splits[1]

    return load


def _float_label(path: Path) -> Callable[[Any], float]:
    def to_float(value: Any) -> float:
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError("task.data_dir", f"{path}: expected a number as label, got {value!r}") from None

    return to_float


def _glue_subset_task(folder: str, label_names: Sequence[str], official_dev: Loader | None = None) -> Loader:
    """A ``glue_subsets/<T>`` task (10k sample of the official train, re-split 90/10).

    ``eval_split: official_dev`` reads the official dev file instead of the subset's dev.json.
    """

    def load(data_dir: Path, cfg: TaskConfig, eval_split: str) -> Split:
        train = _read_subset_split(data_dir / "glue_subsets" / folder / "train.json", label_names)
        if eval_split == "official_dev" and official_dev is not None:
            return train, official_dev(data_dir, cfg, eval_split)[1]
        return train, _read_subset_split(data_dir / "glue_subsets" / folder / "dev.json", label_names)

    return load


def _read_subset_split(path: Path, label_names: Sequence[str]) -> list[Example]:
    records = _read_json_object_records(path)
    return _record_examples(records, ("text_a", "text_b"), "label", _label_index(label_names, path))


def _mnli_official_dev(data_dir: Path, cfg: TaskConfig, eval_split: str) -> Split:
    path = data_dir / "glue" / "MNLI" / "dev.jsonl"
    records = _read_jsonl_records(path)
    return [], _record_examples(records, ("premise", "hypothesis"), "label", _label_index(_NLI_LABELS, path))


def _qnli_official_dev(data_dir: Path, cfg: TaskConfig, eval_split: str) -> Split:
    path = data_dir / "glue" / "QNLI" / "dev.tsv"
    frame = _read_glue_tsv(path)
    return [], _frame_examples(
        frame, ("question", "sentence"), "label", _label_index(_ENTAILMENT_LABELS, path)
    )


def _sentence_task(folder: str, label_names: Sequence[str]) -> Loader:
    """``sentence/<task>``: ``train.tsv``/``dev.tsv`` (header ``sentence, label``), and with
    ``eval_split: test`` the LM-BFF ``test.csv`` (no header, ``label,sentence``, CSV quoting)."""

    def load(data_dir: Path, cfg: TaskConfig, eval_split: str) -> Split:
        base = data_dir / "sentence" / folder
        train = _sentence_tsv(base / "train.tsv", label_names)
        if eval_split == "test":
            path = _require_file(base / "test.csv")
            frame = read_delimited(path, ",", False, csv.QUOTE_MINIMAL, dtype=str)
            return train, _frame_examples(frame, (1,), 0, _label_index(label_names, path))
        return train, _sentence_tsv(base / "dev.tsv", label_names)

    return load


def _sentence_tsv(path: Path, label_names: Sequence[str]) -> list[Example]:
    return _frame_examples(_read_glue_tsv(path), ("sentence",), "label", _label_index(label_names, path))


def _superglue_pair_task(folder: str, label_names: Sequence[str]) -> Loader:
    """SuperGLUE CB / RTE: ``train.jsonl`` and ``val.jsonl`` (the eval split) of premise/hypothesis."""

    def load(data_dir: Path, cfg: TaskConfig, eval_split: str) -> Split:
        splits = []
        for file_name in ("train.jsonl", "val.jsonl"):
            path = data_dir / "superglue" / folder / file_name
            records = _read_jsonl_records(path)
            splits.append(
                _record_examples(records, ("premise", "hypothesis"), "label", _label_index(label_names, path))
            )
        return splits[0], splits[1]

    return load


COPA_CONNECTIVES = {"cause": "because", "effect": "therefore"}


def copa_example(record: dict[str, Any]) -> Example:
    """A COPA record as multiple choice: context = premise + connective, two continuations.

    Follows EleutherAI lm-evaluation-harness's COPA prompt: the premise's final period is
    replaced by " because" (question ``cause``) or " therefore" (``effect``), and each choice
    starts lower-case so that context + " " + choice reads as one sentence.
    """
    question = record["question"]
    if question not in COPA_CONNECTIVES:
        raise ConfigError("task.data_dir", f"COPA record {record.get('idx')}: unknown question {question!r}")
    premise = record["premise"].strip()
    context = f"{premise.removesuffix('.')} {COPA_CONNECTIVES[question]}"
    choices = tuple(_lower_first(record[key]) for key in ("choice1", "choice2"))
    return Example(texts=(context,), label=int(record["label"]), choices=choices)


def _lower_first(text: str) -> str:
    return text[:1].lower() + text[1:]


def _copa(data_dir: Path, cfg: TaskConfig, eval_split: str) -> Split:
    base = data_dir / "superglue" / "COPA"
    train = [copa_example(record) for record in _read_jsonl_records(base / "train.jsonl")]
    val = [copa_example(record) for record in _read_jsonl_records(base / "val.jsonl")]
    return train, val


NEWSGROUPS = (
    "alt.atheism",
    "comp.graphics",
    "comp.os.ms-windows.misc",
    "comp.sys.ibm.pc.hardware",
    "comp.sys.mac.hardware",
    "comp.windows.x",
    "misc.forsale",
    "rec.autos",
    "rec.motorcycles",
    "rec.sport.baseball",
    "rec.sport.hockey",
    "sci.crypt",
    "sci.electronics",
    "sci.med",
    "sci.space",
    "soc.religion.christian",
    "talk.politics.guns",
    "talk.politics.mideast",
    "talk.politics.misc",
    "talk.religion.misc",
)

_QUOTE_LINE_MARKERS = ("writes in", "writes:", "wrote:", "says:", "said:")
_QUOTE_LINE_PREFIXES = ("In article", "Quoted from", "|", ">")


def strip_newsgroup_header(text: str) -> str:
    """Drop the e-mail headers: everything before the first blank line (as scikit-learn)."""
    return text.partition("\n\n")[2]


def strip_newsgroup_footer(text: str) -> str:
    """Drop a signature block: from the last line that is blank or only hyphens (ignoring
    trailing blank lines) to the end, as scikit-learn's heuristic; unchanged if that line is
    the first one."""
    lines = text.strip().split("\n")
    line_number = len(lines) - 1
    while line_number >= 0 and lines[line_number].strip().strip("-") != "":
        line_number -= 1
    if line_number > 0:
        return "\n".join(lines[:line_number])
    return text


def strip_newsgroup_quoting(text: str) -> str:
    """Drop quoted lines (starting with ``>`` or ``|``) and lines that introduce a quote
    ("In article ...", "... writes:", ...), as scikit-learn's ``_QUOTE_RE``."""
    return "\n".join(line for line in text.split("\n") if not _is_quote_line(line))


def _is_quote_line(line: str) -> bool:
    return line.startswith(_QUOTE_LINE_PREFIXES) or any(marker in line for marker in _QUOTE_LINE_MARKERS)


def strip_newsgroup_metadata(text: str) -> str:
    """``fetch_20newsgroups(remove=("headers", "footers", "quotes"))``: headers, then footer,
    then quoting, in scikit-learn's order."""
    return strip_newsgroup_quoting(strip_newsgroup_footer(strip_newsgroup_header(text)))


def read_newsgroups_archive(path: Path) -> dict[str, list[tuple[str, str, str]]]:
    """Read ``20news-bydate.tar.gz`` once: ``{"train"|"test": [(group, message_id, text), ...]}``.

    Members are ``20news-bydate-{train,test}/<group>/<message-id>``; text is decoded as latin-1
    (as scikit-learn does). Messages are sorted by group, then message id as a string, the order
    scikit-learn's ``load_files`` gives.
    """
    splits: dict[str, list[tuple[str, str, str]]] = {"train": [], "test": []}
    with tarfile.open(_require_file(path)) as archive:
        for member in archive:
            if not member.isfile():
                continue
            parts = member.name.removeprefix("./").split("/")
            if len(parts) != 3 or not parts[0].startswith("20news-bydate-"):
                continue
            split = parts[0].removeprefix("20news-bydate-")
            handle = archive.extractfile(member)
            if split in splits and handle is not None:
                splits[split].append((parts[1], parts[2], handle.read().decode("latin-1")))
    for messages in splits.values():
        messages.sort(key=lambda message: (message[0], message[1]))
    return splits


def _newsgroups(data_dir: Path, cfg: TaskConfig, eval_split: str) -> Split:
    path = data_dir / "20newsgroups" / "20news-bydate.tar.gz"
    splits = read_newsgroups_archive(path)
    group_id = {group: index for index, group in enumerate(NEWSGROUPS)}
    result = []
    for split in ("train", "test"):
        examples = []
        for group, _message_id, text in splits[split]:
            if group not in group_id:
                raise ConfigError("task.data_dir", f"{path}: unexpected newsgroup folder {group!r}")
            body = strip_newsgroup_metadata(text) if cfg.strip_newsgroup_metadata else text
            examples.append(Example(texts=(body,), label=group_id[group]))
        result.append(examples)
    return result[0], result[1]


def _e2e_nlg(data_dir: Path, cfg: TaskConfig, eval_split: str) -> Split:
    """E2E NLG (``e2e_nlg``): meaning representation -> restaurant description.

    There is no train split in the data folder: training reads ``devset.csv`` (one example per
    ``mr,ref`` row); evaluation reads ``testset_w_refs.csv`` with one example per distinct MR
    (in first-appearance order) holding all of its references.
    """
    base = data_dir / "e2e_nlg"
    train_frame = read_delimited(_require_file(base / "devset.csv"), ",", True, csv.QUOTE_MINIMAL, dtype=str)
    test_frame = read_delimited(_require_file(base / "testset_w_refs.csv"), ",", True, csv.QUOTE_MINIMAL, dtype=str)
    for path, frame in ((base / "devset.csv", train_frame), (base / "testset_w_refs.csv", test_frame)):
        if list(frame.columns)[:2] != ["mr", "ref"]:
            raise ConfigError("task.data_dir", f"{path}: expected columns mr, ref; got {list(frame.columns)}")
    train = [
        Example(texts=(_text(mr),), label=None, references=(_text(ref),))
        for mr, ref in zip(train_frame["mr"].tolist(), train_frame["ref"].tolist())
    ]
    grouped: dict[str, list[str]] = {}
    for mr, ref in zip(test_frame["mr"].tolist(), test_frame["ref"].tolist()):
        grouped.setdefault(_text(mr), []).append(_text(ref))
    evaluation = [Example(texts=(mr,), label=None, references=tuple(refs)) for mr, refs in grouped.items()]
    return train, evaluation


WNUT17_TAGS = (
    "O", "B-corporation", "I-corporation", "B-creative-work", "I-creative-work", "B-group", "I-group",
    "B-location", "I-location", "B-person", "I-person", "B-product", "I-product",
)


def token_examples(sentences: Sequence[Sentence], names: Sequence[str], source: str) -> list[Example]:
    """CoNLL sentences as token-classification examples (classes are assigned later)."""
    return [
        Example(texts=(" ".join(words),), label=None, words=tuple(words), tags=tuple(ids))
        for (words, _tags), ids in zip(sentences, tag_ids(sentences, names, source))
    ]


def _builtin_conll(path: Path, names: Sequence[str]) -> list[Example]:
    return token_examples(read_conll(_require_file(path), "task.data_dir"), names, str(path))


def _wnut17(data_dir: Path, cfg: TaskConfig, eval_split: str) -> Split:
    """WNUT 2017 emerging entities: train on ``wnut17train.conll``; evaluate on
    ``emerging.dev.conll`` or, with ``eval_split: test``, ``emerging.test.annotated``."""
    base = data_dir / "ner" / "wnut17"
    eval_file = {"dev": "emerging.dev.conll", "test": "emerging.test.annotated"}[eval_split]
    return _builtin_conll(base / "wnut17train.conll", WNUT17_TAGS), _builtin_conll(base / eval_file, WNUT17_TAGS)


def _squad(data_dir: Path, cfg: TaskConfig, eval_split: str) -> Split:
    """SQuAD v1.1 dev split by article title (:func:`fedpeft.data.squad.split_by_title`)."""
    path = _require_file(data_dir / "qa" / "squad_v1.1" / "dev-v1.1.json")
    return split_by_title(read_squad(path, "task.data_dir"))


def _xquad(data_dir: Path, cfg: TaskConfig, eval_split: str) -> Split:
    """Evaluate on English XQuAD after training on ``task.train_file`` (SQuAD format), which must
    share no article or paragraph with it (:func:`fedpeft.data.squad.check_no_overlap`)."""
    if not cfg.train_file:
        raise ConfigError("task.train_file", "xquad is evaluation-only: set task.train_file to SQuAD-format "
                          "training data of other articles than SQuAD v1.1 dev's (e.g. SQuAD v1.1 train)")
    train = read_squad(_find_file(cfg.train_file, "task.train_file", data_dir), "task.train_file")
    evaluation = read_squad(_require_file(data_dir / "qa" / "xquad" / "xquad.en.json"), "task.data_dir")
    check_no_overlap(train, evaluation, "task.train_file", by_title=True)
    return train, evaluation


_BINARY_SENTIMENT = ("negative", "positive")
_NLI_LABELS = ("entailment", "neutral", "contradiction")
_ENTAILMENT_LABELS = ("entailment", "not_entailment")
_CB_LABELS = ("entailment", "contradiction", "neutral")


_SST5_LABELS = ("very negative", "negative", "neutral", "positive", "very positive")

BUILTIN_TASKS: dict[str, TaskSpec] = {
    spec.name: spec
    for spec in (
        TaskSpec(
            name="sst2",
            description="GLUE SST-2 binary sentiment (glue/SST-2 TSV)",
            problem_type="classification",
            label_names=_BINARY_SENTIMENT,
            metrics=("accuracy",),
            loader=_glue_tsv_task("glue/SST-2", ["sentence"], "label", _BINARY_SENTIMENT),
        ),
        TaskSpec(
            name="cola",
            description="GLUE CoLA grammatical acceptability (headerless TSV)",
            problem_type="classification",
            label_names=("unacceptable", "acceptable"),
            metrics=("matthews", "accuracy"),
            loader=_glue_tsv_task("glue/CoLA", [3], 1, ("unacceptable", "acceptable"), header=False),
        ),
        TaskSpec(
            name="mrpc",
            description="GLUE MRPC paraphrase (glue/MRPC TSV: 3,667 train pairs)",
            problem_type="classification",
            label_names=("not_equivalent", "equivalent"),
            metrics=("f1", "accuracy"),
            loader=_glue_tsv_task(
                "glue/MRPC", ["#1 String", "#2 String"], "Quality", ("not_equivalent", "equivalent")
            ),
        ),
        TaskSpec(
            name="rte",
            description="GLUE RTE textual entailment (glue/RTE TSV)",
            problem_type="classification",
            label_names=_ENTAILMENT_LABELS,
            metrics=("accuracy",),
            loader=_glue_tsv_task("glue/RTE", ["sentence1", "sentence2"], "label", _ENTAILMENT_LABELS),
        ),
        TaskSpec(
            name="stsb",
            description="GLUE STS-B sentence similarity, regression on scores 0-5",
            problem_type="regression",
            label_names=(),
            metrics=("pearson", "spearman"),
            loader=_glue_tsv_task("glue/STS-B", ["sentence1", "sentence2"], "score", ()),
        ),
        TaskSpec(
            name="mnli",
            description="MNLI 3-way NLI (glue_subsets 10k sample; eval_split official_dev: dev-matched)",
            problem_type="classification",
            label_names=_NLI_LABELS,
            metrics=("accuracy",),
            loader=_glue_subset_task("MNLI", _NLI_LABELS, _mnli_official_dev),
            eval_splits=("dev", "official_dev"),
        ),
        TaskSpec(
            name="qnli",
            description="QNLI question/sentence entailment (glue_subsets 10k sample; official_dev)",
            problem_type="classification",
            label_names=_ENTAILMENT_LABELS,
            metrics=("accuracy",),
            loader=_glue_subset_task("QNLI", _ENTAILMENT_LABELS, _qnli_official_dev),
            eval_splits=("dev", "official_dev"),
        ),
        TaskSpec(
            name="qqp",
            description="QQP duplicate questions (glue_subsets 10k sample)",
            problem_type="classification",
            label_names=("not_duplicate", "duplicate"),
            metrics=("f1", "accuracy"),
            loader=_glue_subset_task("QQP", ("not_duplicate", "duplicate")),
        ),
        TaskSpec(
            name="snli",
            description="SNLI 3-way NLI (glue_subsets 10k sample)",
            problem_type="classification",
            label_names=_NLI_LABELS,
            metrics=("accuracy",),
            loader=_glue_subset_task("SNLI", _NLI_LABELS),
        ),
        TaskSpec(
            name="20newsgroups",
            description="20 Newsgroups topic classification, 20 classes (bydate tarball)",
            problem_type="classification",
            label_names=NEWSGROUPS,
            metrics=("accuracy",),
            loader=_newsgroups,
            eval_splits=("test",),
        ),
        TaskSpec(
            name="mr",
            description="MR movie-review polarity (sentence/mr; eval_split test: LM-BFF test set)",
            problem_type="classification",
            label_names=_BINARY_SENTIMENT,
            metrics=("accuracy",),
            loader=_sentence_task("mr", _BINARY_SENTIMENT),
            eval_splits=("dev", "test"),
        ),
        TaskSpec(
            name="mpqa",
            description="MPQA opinion polarity (sentence/mpqa; eval_split test: LM-BFF test set)",
            problem_type="classification",
            label_names=_BINARY_SENTIMENT,
            metrics=("accuracy",),
            loader=_sentence_task("mpqa", _BINARY_SENTIMENT),
            eval_splits=("dev", "test"),
        ),
        TaskSpec(
            name="sst5",
            description="SST-5 five-way sentiment (sentence/sst-5; eval_split test: LM-BFF test set)",
            problem_type="classification",
            label_names=_SST5_LABELS,
            metrics=("accuracy",),
            loader=_sentence_task("sst-5", _SST5_LABELS),
            eval_splits=("dev", "test"),
        ),
        TaskSpec(
            name="cb",
            description="SuperGLUE CommitmentBank 3-way NLI (val.jsonl is the eval split)",
            problem_type="classification",
            label_names=_CB_LABELS,
            metrics=("accuracy", "macro_f1"),
            loader=_superglue_pair_task("CB", _CB_LABELS),
            eval_splits=("val",),
        ),
        TaskSpec(
            name="copa",
            description="SuperGLUE COPA causal reasoning, 2-way multiple choice (val.jsonl is eval)",
            problem_type="multiple_choice",
            label_names=("choice1", "choice2"),
            metrics=("accuracy",),
            loader=_copa,
            eval_splits=("val",),
        ),
        TaskSpec(
            name="e2e_nlg",
            description="E2E NLG data-to-text generation (train: devset.csv; eval: testset_w_refs.csv, all refs)",
            problem_type="generation",
            label_names=(),
            metrics=ROUGE_METRICS,
            loader=_e2e_nlg,
            eval_splits=("test",),
        ),
        TaskSpec(
            name="superglue_rte",
            description="SuperGLUE RTE entailment, JSONL (val.jsonl is the eval split)",
            problem_type="classification",
            label_names=_ENTAILMENT_LABELS,
            metrics=("accuracy",),
            loader=_superglue_pair_task("RTE", _ENTAILMENT_LABELS),
            eval_splits=("val",),
        ),
        TaskSpec(
            name="wnut17",
            description="WNUT 2017 emerging-entity NER, 13 BIO tags (CoNLL; eval_split test: emerging.test)",
            problem_type="token_classification",
            label_names=WNUT17_TAGS,
            metrics=ENTITY_METRICS,
            loader=_wnut17,
            eval_splits=("dev", "test"),
        ),
        TaskSpec(
            name="squad",
            description="SQuAD v1.1 extractive QA: the dev file's 48 articles split by title, 39 train / 9 eval",
            problem_type="extractive_qa",
            label_names=(),
            metrics=SQUAD_METRICS,
            loader=_squad,
            refused_splits=(("xquad", "squad trains on SQuAD v1.1 dev articles and XQuAD is a subset of them, so "
                             "evaluating on XQuAD would test on training data; use task.name: xquad with a "
                             "SQuAD-format task.train_file of other articles (e.g. SQuAD v1.1 train)"),),
        ),
        TaskSpec(
            name="xquad",
            description="English XQuAD (evaluation only; train on task.train_file, never on SQuAD v1.1 dev)",
            problem_type="extractive_qa",
            label_names=(),
            metrics=SQUAD_METRICS,
            loader=_xquad,
            eval_splits=("test",),
            reads_train_file=True,
        ),
    )
}

_USER_TASK_FIELDS = (
    "train_file",
    "eval_file",
    "text_columns",
    "text_pair_columns",
    "label_column",
    "label_names",
    "label_map",
    "group_column",
    "hf_dataset",
    "hf_config",
    "problem_type",
)


def allowed_metrics(problem_type: ProblemType | None) -> tuple[str, ...]:
    """The metric names a task of ``problem_type`` can report."""
    return {"generation": ROUGE_METRICS, "token_classification": ENTITY_METRICS,
            "extractive_qa": SQUAD_METRICS}.get(problem_type or "classification", METRIC_NAMES)


def _load_builtin(spec: TaskSpec, cfg: TaskConfig, data_dir: Path) -> TaskData:
    for field in _USER_TASK_FIELDS:
        if field == "train_file" and spec.reads_train_file:
            continue
        if field in cfg.model_fields_set and getattr(cfg, field) not in (None, []):
            raise ConfigError(
                f"task.{field}",
                f"only used when task.name is 'file' or 'hf'; built-in task {spec.name!r} defines its own",
            )
    eval_split = cfg.eval_split or spec.eval_splits[0]
    refused = dict(spec.refused_splits)
    if eval_split in refused:
        raise ConfigError("task.eval_split", refused[eval_split])
    if eval_split not in spec.eval_splits:
        raise ConfigError(
            "task.eval_split",
            f"unknown split {eval_split!r} for {spec.name}; allowed: {', '.join(spec.eval_splits)}",
        )
    train, evaluation = spec.loader(data_dir, cfg, eval_split)
    metrics = _check_metrics(cfg.metrics, allowed_metrics(spec.problem_type)) if cfg.metrics else spec.metrics
    return TaskData(spec.name, spec.problem_type, spec.label_names, metrics, train, evaluation)


# --------------------------------------------------------------------------------------------
# A user's own files (task.name: file) and Hugging Face datasets (task.name: hf)


def _find_file(value: str | None, field: str, data_dir: Path | None) -> Path:
    """An absolute path, else relative to the data folder, else to the current directory."""
    if not value:
        raise ConfigError(field, "required when task.name is 'file' (a CSV/TSV/JSON/JSONL/Parquet path)")
    path = Path(value).expanduser()
    candidates = (
        [path] if path.is_absolute() else [*([data_dir / path] if data_dir else []), Path.cwd() / path]
    )
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    looked = ", ".join(str(candidate) for candidate in candidates)
    raise ConfigError(field, f"file not found: {value} (looked for {looked})")


def _optional_data_dir(explicit: str | None) -> Path | None:
    """The data folder when one can be found; user files with absolute paths need none."""
    try:
        return resolve_data_dir(explicit)
    except ConfigError:
        if explicit:
            raise
        return None


def _load_file_task(cfg: TaskConfig, data_dir: Path | None) -> TaskData:
    if cfg.eval_split is not None:
        raise ConfigError(
            "task.eval_split", "only for built-in tasks; with task.name 'file' set task.eval_file"
        )
    data_dir = data_dir if data_dir is not None else _optional_data_dir(cfg.data_dir)
    train_path = _find_file(cfg.train_file, "task.train_file", data_dir)
    eval_path = _find_file(cfg.eval_file, "task.eval_file", data_dir)
    if cfg.problem_type in SPAN_PROBLEMS:
        return _span_file_task(cfg, train_path, eval_path)
    train_frame = read_table(train_path, file_format(train_path, cfg.format), cfg.header)
    eval_frame = read_table(eval_path, file_format(eval_path, cfg.format), cfg.header)
    return task_from_frames(cfg, "file", train_frame, eval_frame, str(train_path), str(eval_path))


def _span_file_task(cfg: TaskConfig, train_path: Path, eval_path: Path) -> TaskData:
    """CoNLL files (token classification) or SQuAD-format JSON (extractive QA).

    CoNLL: the word is column ``task.text_columns[0]`` (default 0), the tag column
    ``task.label_column`` (default the last), positions only; tags from the training file or
    ``task.label_names``. QA: an evaluation context that training also holds is an error.
    """
    if cfg.format != "auto":
        raise ConfigError("task.format", f"{cfg.problem_type} files are read as "
                          f"{'CoNLL' if cfg.problem_type == 'token_classification' else 'SQuAD JSON'}; leave it auto")
    metrics = _check_metrics(cfg.metrics, allowed_metrics(cfg.problem_type)) if cfg.metrics else None
    if cfg.problem_type == "extractive_qa":
        train = read_squad(train_path, "task.train_file")
        evaluation = read_squad(eval_path, "task.eval_file")
        check_no_overlap(train, evaluation, "task.eval_file", by_title=False)
        return TaskData("file", "extractive_qa", (), metrics or SQUAD_METRICS, train, evaluation)
    token_column = _conll_position(cfg.text_columns[0] if cfg.text_columns else 0, "task.text_columns")
    tag_column = _conll_position(-1 if cfg.label_column is None else cfg.label_column, "task.label_column")
    if len(cfg.text_columns) > 1:
        raise ConfigError("task.text_columns", "a CoNLL file has one word column; give one position")
    sentences = read_conll(train_path, "task.train_file", token_column, tag_column)
    names = tag_set(sentences, cfg.label_names, str(train_path))
    train = token_examples(sentences, names, str(train_path))
    evaluation = token_examples(read_conll(eval_path, "task.eval_file", token_column, tag_column), names,
                                str(eval_path))
    return TaskData("file", "token_classification", names, metrics or ENTITY_METRICS, train, evaluation)


def _conll_position(value: str | int, field: str) -> int:
    if isinstance(value, int):
        return value
    if value.lstrip("-").isdigit():
        return int(value)
    raise ConfigError(field, f"CoNLL files have no header: give a column position (0, 1, ..., -1), got {value!r}")


def with_example_classes(task: TaskData, token_class_by: str = "tags", qa_class_by: str = "title",
                         qa_clusters: int = 30, embed: Embedder = minilm_embeddings) -> TaskData:
    """Give each example of a token-classification or QA task its class for label-skewed
    partitions (FeDeRA App. A.2): the set of its tags or entity types (see
    :func:`fedpeft.data.conll.sentence_class`), or (QA) its article title or its question's
    k-means cluster (:mod:`fedpeft.data.question_clusters`; ``embed`` embeds the questions).
    Class ids index the sorted names of both splits' classes (``O``, no entity, first)."""
    if task.problem_type == "extractive_qa" and qa_class_by == "question_clusters":
        if qa_clusters > len(task.train):
            raise ConfigError("task.qa_clusters", f"{qa_clusters} clusters but only {len(task.train)} training "
                              "questions")
        train_ids, eval_ids = question_classes([ex.texts[0] for ex in task.train], [ex.texts[0] for ex in task.eval],
                                               qa_clusters, embed)
        task.train = [replace(ex, label=int(c)) for ex, c in zip(task.train, train_ids, strict=True)]
        task.eval = [replace(ex, label=int(c)) for ex, c in zip(task.eval, eval_ids, strict=True)]
        task.example_classes = tuple(f"cluster_{c:02d}" for c in range(qa_clusters))
        return task
    if task.problem_type == "token_classification":
        def key(example: Example) -> str:
            return sentence_class([task.label_names[tag] for tag in example.tags], token_class_by)
    else:
        def key(example: Example) -> str:
            return example.group or ""
    splits = (task.train, task.eval, task.validation)
    names = sorted({key(example) for split in splits for example in split}, key=lambda name: (name != "O", name))
    ids = {name: index for index, name in enumerate(names)}
    task.train, task.eval, task.validation = ([replace(example, label=ids[key(example)]) for example in split]
                                              for split in splits)
    task.example_classes = tuple(names)
    return task


def _load_hf_task(cfg: TaskConfig) -> TaskData:
    if cfg.problem_type in SPAN_PROBLEMS:
        raise ConfigError("task.problem_type", f"{cfg.problem_type} reads CoNLL / SQuAD-format files (task.name: "
                          "file) or the built-in wnut17, squad and xquad, not Hugging Face datasets")
    if not cfg.hf_dataset:
        raise ConfigError("task.hf_dataset", "required when task.name is 'hf' (a dataset id, e.g. 'glue')")
    try:
        from datasets import load_dataset
    except ImportError:
        raise ConfigError(
            "task.name", "task 'hf' needs the Hugging Face datasets package: pip install datasets"
        ) from None
    frames = []
    class_names: tuple[str, ...] | None = None
    for split in (cfg.hf_train_split, cfg.hf_eval_split):
        try:
            dataset = load_dataset(cfg.hf_dataset, cfg.hf_config, split=split)
        except Exception as err:  # the hub, the cache and the dataset script raise many kinds
            raise ConfigError(
                "task.hf_dataset", f"cannot load {cfg.hf_dataset!r} split {split!r}: {err}"
            ) from err
        frames.append(dataset.to_pandas())
        class_names = class_names or _hf_class_names(dataset, cfg.label_column)
    return task_from_frames(
        cfg, f"hf:{cfg.hf_dataset}", frames[0], frames[1], cfg.hf_train_split, cfg.hf_eval_split, class_names
    )


def _hf_class_names(dataset: Any, label_column: str | int | None) -> tuple[str, ...] | None:
    """The names of a ``ClassLabel`` label feature, so ids map to their names."""
    column = label_column if isinstance(label_column, str) else "label"
    feature = getattr(dataset, "features", {}).get(column)
    names = getattr(feature, "names", None)
    return tuple(names) if names else None


def task_from_frames(
    cfg: TaskConfig,
    name: str,
    train_frame: pd.DataFrame,
    eval_frame: pd.DataFrame,
    train_source: str,
    eval_source: str,
    class_names: tuple[str, ...] | None = None,
) -> TaskData:
    """Build a task from two tables using the ``task.*`` column, label and metric fields.

    The label set comes from the training table only; an eval label outside it is an error.
    ``class_names`` (e.g. a Hugging Face ``ClassLabel``) stands in for ``task.label_names``.
    With ``problem_type: generation`` the label column holds target texts instead.
    """
    if cfg.problem_type == "generation":
        return _generation_task(cfg, name, train_frame, eval_frame, train_source, eval_source)
    if cfg.problem_type == "multiple_choice":
        raise ConfigError(
            "task.problem_type",
            "multiple_choice is built-in only (copa); allowed here: classification, regression",
        )
    columns = {
        split: _task_columns(cfg, frame, source)
        for split, frame, source in (("train", train_frame, train_source), ("eval", eval_frame, eval_source))
    }
    raw_train = _raw_labels(train_frame, columns["train"].label, train_source)
    raw_eval = _raw_labels(eval_frame, columns["eval"].label, eval_source)
    labels = build_label_set(raw_train, cfg, class_names)
    train = _user_examples(train_frame, columns["train"], labels.encode_all(raw_train, train_source), cfg)
    evaluation = _user_examples(eval_frame, columns["eval"], labels.encode_all(raw_eval, eval_source), cfg)
    metrics = _check_metrics(cfg.metrics) if cfg.metrics else _default_metrics(labels)
    return TaskData(name, labels.problem_type, labels.names, metrics, train, evaluation)


def _generation_task(cfg: TaskConfig, name: str, train_frame: pd.DataFrame, eval_frame: pd.DataFrame,
                     train_source: str, eval_source: str) -> TaskData:
    """A text-to-text task: ``text_columns`` (joined) -> the target text in ``label_column``.

    Training has one example per row; evaluation one per distinct input text, with the targets
    of all its rows as references (the E2E NLG convention). Metrics: ROUGE.
    """
    splits = []
    for frame, source, grouped in ((train_frame, train_source, False), (eval_frame, eval_source, True)):
        columns = _task_columns(cfg, frame, source)
        inputs = joined_texts(frame, columns.texts, cfg.join_with)
        targets = [_text(value) for value in _raw_labels(frame, columns.label, source)]
        if not grouped:
            splits.append([Example(texts=(text,), label=None, references=(target,))
                           for text, target in zip(inputs, targets)])
            continue
        references: dict[str, list[str]] = {}
        for text, target in zip(inputs, targets):
            references.setdefault(text, []).append(target)
        splits.append([Example(texts=(text,), label=None, references=tuple(refs)) for text, refs in references.items()])
    metrics = _check_metrics(cfg.metrics, ROUGE_METRICS) if cfg.metrics else ROUGE_METRICS
    return TaskData(name, "generation", (), metrics, splits[0], splits[1])


@dataclass(frozen=True)
class _Columns:
    texts: tuple[Hashable, ...]
    pairs: tuple[Hashable, ...]
    label: Hashable
    group: Hashable | None


DEFAULT_TEXT_COLUMNS = ("text", "sentence", "content")


def _task_columns(cfg: TaskConfig, frame: pd.DataFrame, source: str) -> _Columns:
    """Resolve the configured columns of one table (names, or integer positions)."""
    text_specs: list[str | int] = list(cfg.text_columns)
    if not text_specs:
        default = next((name for name in DEFAULT_TEXT_COLUMNS if name in frame.columns), None)
        if default is None:
            raise ConfigError("task.text_columns", f"required; {source} has {_describe_columns(frame)}")
        text_specs = [default]
    label_spec = cfg.label_column
    if label_spec is None:
        if "label" not in frame.columns:
            raise ConfigError("task.label_column", f"required; {source} has {_describe_columns(frame)}")
        label_spec = "label"
    return _Columns(
        texts=tuple(resolve_column(frame, spec, "task.text_columns", source) for spec in text_specs),
        pairs=tuple(
            resolve_column(frame, spec, "task.text_pair_columns", source) for spec in cfg.text_pair_columns
        ),
        label=resolve_column(frame, label_spec, "task.label_column", source),
        group=None
        if cfg.group_column is None
        else resolve_column(frame, cfg.group_column, "task.group_column", source),
    )


def resolve_column(frame: pd.DataFrame, spec: str | int, field: str, source: str) -> Hashable:
    """The column ``spec`` names: an ``int`` is a position, a ``str`` a name (or, in a file
    without header, a position written as digits)."""
    columns = list(frame.columns)
    if isinstance(spec, str) and spec in columns:
        return spec
    position = spec if isinstance(spec, int) else int(spec) if spec.isdigit() and 0 in columns else None
    if position is not None and 0 <= position < len(columns):
        return columns[position]
    raise ConfigError(field, f"unknown column {spec!r} in {source}; it has {_describe_columns(frame)}")


def _describe_columns(frame: pd.DataFrame) -> str:
    columns = list(frame.columns)
    if columns == list(range(len(columns))):
        return f"{len(columns)} columns, positions 0..{len(columns) - 1} (no header)"
    return f"columns {', '.join(repr(column) for column in columns)} (or positions 0..{len(columns) - 1})"


def _raw_labels(frame: pd.DataFrame, column: Hashable, source: str) -> list[Any]:
    """The label cells as plain Python values; a missing label is an error naming the record."""
    values = [_plain(value) for value in frame[column].tolist()]
    for index, value in enumerate(values):
        if value is None:
            raise ConfigError(
                "task.label_column", f"{source}: record {index + 1} has no label in column {column!r}"
            )
    return values


def _plain(value: Any) -> Any:
    """A cell as a plain Python value: numpy scalars unwrapped, NaN/None as None."""
    if isinstance(value, np.generic):
        value = value.item()
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    return value


def _text(value: Any) -> str:
    value = _plain(value)
    return "" if value is None else str(value)


def label_key(value: Any) -> str:
    """How a raw label is compared with ``label_names`` / ``label_map`` keys: its string form,
    with booleans as ``true``/``false`` in any case (``True``, ``"FALSE"``) and integral floats
    without ``.0`` (``1.0`` -> ``"1"``)."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    key = str(value).strip()
    return key.lower() if key.lower() in ("true", "false") else key


@dataclass(frozen=True)
class LabelSet:
    """The label space of a user task and how raw labels map into it.

    ``ids`` maps :func:`label_key` of a raw label to its class id (empty for regression).
    """

    problem_type: ProblemType
    names: tuple[str, ...]
    ids: dict[str, int]

    def encode(self, value: Any, where: str) -> int | float:
        if self.problem_type == "regression":
            if isinstance(value, bool) or not _is_number(value):
                raise ConfigError(
                    "task.label_column", f"{where}: regression needs numeric labels, got {value!r}"
                )
            return float(value)
        key = label_key(value)
        if key not in self.ids:
            allowed = ", ".join(repr(name) for name in self.names)
            raise ConfigError(
                "task.label_names", f"{where}: label {value!r} is not in the label set; allowed: {allowed}"
            )
        return self.ids[key]

    def encode_all(self, values: Sequence[Any], source: str) -> list[int | float]:
        return [self.encode(value, f"{source} record {index + 1}") for index, value in enumerate(values)]


def build_label_set(
    raw_train: Sequence[Any], cfg: TaskConfig, class_names: tuple[str, ...] | None = None
) -> LabelSet:
    """The label set of a user task, from the config and the training labels.

    - ``problem_type: regression`` (or, when nothing says otherwise, numeric labels with a
      fractional value): float targets, no label names.
    - ``label_map``: raw label -> class id; ids must be exactly ``0..K-1`` (several raw values
      may share an id). Names are ``label_names`` if given, else the first key of each id.
    - ``label_names``: a raw label matches a name by its string form; if the training labels
      are all integers ``0..K-1`` instead, they are taken as ids into ``label_names``, and if
      they are integers ``1..K`` (K among them), as 1-based ids.
    - neither: the sorted unique training labels (numerically when all are numbers) are the
      classes ``0..K-1``, so ints starting at 1, booleans and strings all work.
    """
    names_given = cfg.label_names or (list(class_names) if class_names else None)
    if cfg.problem_type == "regression" or (
        cfg.problem_type is None
        and cfg.label_map is None
        and names_given is None
        and _looks_continuous(raw_train)
    ):
        return LabelSet("regression", (), {})
    if cfg.label_map is not None:
        return _label_set_from_map(cfg.label_map, cfg.label_names)
    if names_given is not None:
        return _label_set_from_names(tuple(names_given), raw_train)
    keys = sorted({label_key(value) for value in raw_train}, key=_label_sort_key)
    return LabelSet("classification", tuple(keys), {key: index for index, key in enumerate(keys)})


def _label_set_from_map(label_map: dict[str, int], label_names: list[str] | None) -> LabelSet:
    ids = sorted(set(label_map.values()))
    if ids != list(range(len(ids))):
        raise ConfigError("task.label_map", f"class ids must be 0..K-1 with none missing, got {ids}")
    if label_names is not None and len(label_names) != len(ids):
        raise ConfigError(
            "task.label_names", f"{len(label_names)} names for the {len(ids)} classes of task.label_map"
        )
    names = (
        tuple(label_names)
        if label_names
        else tuple(next(key for key, value in label_map.items() if value == class_id) for class_id in ids)
    )
    return LabelSet("classification", names, {label_key(key): value for key, value in label_map.items()})


def _label_set_from_names(names: tuple[str, ...], raw_train: Sequence[Any]) -> LabelSet:
    if len(set(names)) != len(names):
        raise ConfigError("task.label_names", f"names must be distinct, got {list(names)}")
    by_name = {label_key(name): index for index, name in enumerate(names)}
    keys = {label_key(value) for value in raw_train}
    if keys <= by_name.keys():
        return LabelSet("classification", names, by_name)
    integers = all(isinstance(value, int) and not isinstance(value, bool) for value in raw_train)
    by_id = {str(index): index for index in range(len(names))}
    if integers and keys <= by_id.keys():
        return LabelSet("classification", names, by_id)
    # ids 1..K (as many datasets number their classes): the K-th name is only reachable 1-based
    by_one_based_id = {str(index + 1): index for index in range(len(names))}
    if integers and keys <= by_one_based_id.keys():
        return LabelSet("classification", names, by_one_based_id)
    unknown = sorted(keys - by_name.keys(), key=_label_sort_key)[0]
    allowed = ", ".join(repr(name) for name in names)
    raise ConfigError(
        "task.label_names",
        f"training label {unknown!r} is not in the label set; "
        f"allowed: {allowed} (or ids 0..{len(names) - 1} or 1..{len(names)})",
    )


def _is_number(value: Any) -> bool:
    if isinstance(value, (int, float)):
        return True
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True


def _looks_continuous(values: Sequence[Any]) -> bool:
    """Numbers (not booleans, not strings) of which at least one is fractional."""
    numeric = all(isinstance(value, (int, float)) and not isinstance(value, bool) for value in values)
    return numeric and any(isinstance(value, float) and not value.is_integer() for value in values)


def _label_sort_key(key: str) -> tuple[int, float, str]:
    """Numbers before words, numbers by value (``"2"`` < ``"10"``), words alphabetically."""
    try:
        return (0, float(key), key)
    except ValueError:
        return (1, 0.0, key)


def _user_examples(
    frame: pd.DataFrame, columns: _Columns, labels: Sequence[int | float], cfg: TaskConfig
) -> list[Example]:
    """One Example per row: text columns joined with ``join_with``, the pair columns likewise."""
    first = joined_texts(frame, columns.texts, cfg.join_with)
    second = joined_texts(frame, columns.pairs, cfg.join_with) if columns.pairs else None
    groups = [_text(value) for value in frame[columns.group].tolist()] if columns.group is not None else None
    return [
        Example(
            texts=(first[index],) if second is None else (first[index], second[index]),
            label=label,
            group=None if groups is None else groups[index],
        )
        for index, label in enumerate(labels)
    ]


def joined_texts(frame: pd.DataFrame, columns: Sequence[Hashable], separator: str) -> list[str]:
    """Per row, the cells of ``columns`` as text (missing: empty) joined by ``separator``."""
    cells = zip(*(frame[column].tolist() for column in columns))
    return [separator.join(_text(cell) for cell in row) for row in cells]


def _check_metrics(metrics: Sequence[str], allowed: Sequence[str] = METRIC_NAMES) -> tuple[str, ...]:
    unknown = [name for name in metrics if name not in allowed]
    if unknown:
        raise ConfigError(
            "task.metrics", f"unknown metric {unknown[0]!r}; allowed: {', '.join(allowed)}"
        )
    return tuple(metrics)


def _default_metrics(labels: LabelSet) -> tuple[str, ...]:
    """Regression: Pearson, Spearman. Classification: accuracy, then F1 (of class 1 when
    binary, macro otherwise; see :func:`fedpeft.metrics.task_metrics.f1`)."""
    if labels.problem_type == "regression":
        return ("pearson", "spearman")
    return ("accuracy", "f1")


# --------------------------------------------------------------------------------------------
# Entry point


def subsample(examples: list[Example], limit: int | None, seed: int = SUBSAMPLE_SEED) -> list[Example]:
    """At most ``limit`` examples, the same ones on every run.

    Walk a permutation drawn from ``default_rng(seed)``: first the first example of every class
    met (so a small run still sees every class, even in a file sorted by label), then the rest
    in permutation order. The chosen examples keep their original file order. Regression
    targets (floats) skip the per-class step.
    """
    if limit is None or limit >= len(examples):
        return examples
    order = np.random.default_rng(seed).permutation(len(examples))
    first_of_class: list[int] = []
    seen: set[int] = set()
    for index in order.tolist():
        label = examples[index].label
        if isinstance(label, int) and label not in seen:
            seen.add(label)
            first_of_class.append(index)
    chosen = first_of_class[:limit]
    taken = set(chosen)
    for index in order.tolist():
        if len(chosen) >= limit:
            break
        if index not in taken:
            chosen.append(index)
    return [examples[index] for index in sorted(chosen)]


def task_names() -> tuple[str, ...]:
    """Every value ``task.name`` accepts."""
    return (*BUILTIN_TASKS, "file", "hf")


def load_task(cfg: TaskConfig, data_dir: Path | None = None) -> TaskData:
    """Load the task ``cfg`` describes, then apply ``max_train_examples`` / ``max_eval_examples``
    (see :func:`subsample`).

    ``data_dir`` (e.g. the CLI's ``--data-dir``) wins over ``task.data_dir``; built-in tasks
    need a data folder, user files only for relative paths.
    """
    task = _load_splits(cfg, data_dir)
    if cfg.validation_file is not None:
        if cfg.name != "file":
            raise ConfigError("task.validation_file", "only with task.name 'file'; a built-in or hf task takes "
                              "task.validation_fraction")
        # the validation file is read exactly as an eval file would be, against the training file's label set
        task.validation = _load_splits(cfg.model_copy(update={"eval_file": cfg.validation_file}), data_dir).eval
    if cfg.qa_class_by != "title" and task.problem_type != "extractive_qa":
        raise ConfigError("task.qa_class_by", f"classes extractive QA questions; task {task.name!r} is "
                          f"{task.problem_type}")
    if task.problem_type in SPAN_PROBLEMS:
        task = with_example_classes(task, cfg.token_class_by, cfg.qa_class_by, cfg.qa_clusters)
    task.train = subsample(task.train, cfg.max_train_examples)
    task.eval = subsample(task.eval, cfg.max_eval_examples)
    if cfg.validation_fraction is not None:
        task.train, task.validation = split_validation(task.train, cfg.validation_fraction)
    return task


def _load_splits(cfg: TaskConfig, data_dir: Path | None) -> TaskData:
    if cfg.name == "file":
        return _load_file_task(cfg, data_dir)
    if cfg.name == "hf":
        return _load_hf_task(cfg)
    if cfg.name in BUILTIN_TASKS:
        folder = data_dir if data_dir is not None else resolve_data_dir(cfg.data_dir)
        return _load_builtin(BUILTIN_TASKS[cfg.name], cfg, folder)
    raise ConfigError("task.name", f"unknown task {cfg.name!r}; allowed: {', '.join(task_names())}")
