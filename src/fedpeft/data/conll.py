"""CoNLL-style token classification files and the classes FeDeRA partitions NER data by.

A file holds one word per line, its columns separated by a tab (or, in a file without tabs, by
white space): the word in ``token_column`` (default 0), its BIO tag in ``tag_column`` (default
the last). A sentence ends at a line that is empty after stripping white space (WNUT 2017's
train file ends sentences with empty lines and with lines holding a single tab); ``-DOCSTART-``
lines (CoNLL 2003) end a sentence and are skipped.

Tags are BIO (IOB1 or IOB2): ``O``, ``B-TYPE``, ``I-TYPE``. The tag set comes from the training
file unless given (``task.label_names``): ``O`` first, then by entity type, ``B-`` before ``I-``.

FeDeRA's App. A.2 (Table 6) makes "the total types of token labels encompassed within each
training sample its class" for the Dirichlet split: a sentence's class is the set of distinct
non-``O`` tags it holds (``task.token_class_by: tags``; ``O`` when it holds none). WNUT 2017's
training file has 79 such classes where the paper's Table 1 lists 37 (it does not say how it
got there); ``token_class_by: entity_types`` uses the set of entity types instead (31 classes).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from fedpeft.config import ConfigError

DOCSTART = "-DOCSTART-"
OUTSIDE = "O"
NO_ENTITY_CLASS = "O"

Sentence = tuple[list[str], list[str]]
"""(words, tags) of one sentence."""


def read_conll(path: Path, field: str, token_column: int = 0, tag_column: int = -1) -> list[Sentence]:
    """The sentences of a CoNLL file; ``field`` names the config value that pointed at it."""
    sentences: list[Sentence] = []
    words: list[str] = []
    tags: list[str] = []

    def close() -> None:
        if words:
            sentences.append((list(words), list(tags)))
        words.clear()
        tags.clear()

    with path.open(encoding="utf-8-sig") as handle:
        for number, raw in enumerate(handle, start=1):
            if not raw.strip():
                close()
                continue
            line = raw.rstrip("\r\n")
            cells = line.split("\t") if "\t" in line else line.split()
            if cells[0].strip() == DOCSTART:
                close()
                continue
            try:
                word, tag = cells[token_column], cells[tag_column].strip()
            except IndexError:
                raise ConfigError(field, f"{path}:{number}: expected a word in column {token_column} and a tag in "
                                  f"column {tag_column}, got {len(cells)} column(s): {line!r}") from None
            words.append(word.strip())
            tags.append(tag)
    close()
    if not sentences:
        raise ConfigError(field, f"{path}: no sentences found (one 'word<TAB>tag' line per word expected)")
    return sentences


def entity_type(tag: str) -> str | None:
    """``PER`` of ``B-PER``/``I-PER``; None for ``O``."""
    return None if tag == OUTSIDE else tag[2:]


def check_bio(tag: str, where: str) -> None:
    if tag != OUTSIDE and not (len(tag) > 2 and tag[:2] in ("B-", "I-")):
        raise ConfigError("task.label_column", f"{where}: tag {tag!r} is not BIO (O, B-TYPE or I-TYPE)")


def bio_tag_order(tags: Sequence[str]) -> tuple[str, ...]:
    """``O`` first, then by entity type, ``B-`` before ``I-``."""
    distinct = sorted(set(tags) - {OUTSIDE}, key=lambda tag: (entity_type(tag), tag[:2]))
    return (OUTSIDE, *distinct)


def tag_set(sentences: Sequence[Sentence], declared: Sequence[str] | None, source: str) -> tuple[str, ...]:
    """The task's tags: ``declared`` (``task.label_names``) or those of the training sentences."""
    seen = [tag for _words, tags in sentences for tag in tags]
    for tag in set(seen):
        check_bio(tag, source)
    if declared is None:
        return bio_tag_order(seen)
    if len(set(declared)) != len(declared):
        raise ConfigError("task.label_names", f"tags must be distinct, got {list(declared)}")
    for tag in declared:
        check_bio(tag, "task.label_names")
    return tuple(declared)


def tag_ids(sentences: Sequence[Sentence], names: Sequence[str], source: str) -> list[list[int]]:
    """Tag names -> ids; a tag outside the tag set is an error naming the sentence."""
    index = {name: position for position, name in enumerate(names)}
    ids = []
    for number, (_words, tags) in enumerate(sentences, start=1):
        unknown = next((tag for tag in tags if tag not in index), None)
        if unknown is not None:
            raise ConfigError("task.label_names", f"{source} sentence {number}: tag {unknown!r} is not in the tag "
                              f"set {list(names)}")
        ids.append([index[tag] for tag in tags])
    return ids


def sentence_class(tags: Sequence[str], by: str = "tags") -> str:
    """A sentence's class for label-skewed partitions (FeDeRA App. A.2, Table 6): its distinct
    non-``O`` tags (``by="tags"``) or entity types (``"entity_types"``), sorted and joined by
    spaces; ``O`` when it has none."""
    if by == "tags":
        parts = bio_tag_order(tags)[1:]
    else:
        parts = tuple(sorted({kind for kind in map(entity_type, tags) if kind is not None}))
    return " ".join(parts) if parts else NO_ENTITY_CLASS
