"""Token classification: word tags onto sub-tokens for training, and token scores back to word tags.

Words are tokenized with ``is_split_into_words`` (a fast tokenizer gives each token's word id).
For training, a word's tag goes on its first sub-token and every other token (later sub-tokens,
special tokens) is ignored by the loss (``-100``), the convention of BERT's CoNLL experiments and
of Hugging Face's ``run_ner.py``; ``label_all_subtokens`` instead tags every sub-token, a ``B-X``
word's later sub-tokens as ``I-X`` (``run_ner.py``'s ``label_all_tokens`` + ``b_to_i_label``).

For evaluation each word is read off the scores of its first sub-token, greedily (no CRF, no
search over whole sequences): ``argmax`` takes the best tag of every word on its own (the usual
decoding; :mod:`fedpeft.metrics.entity` reads a stray ``I-X`` as the start of an entity, as
conlleval does); ``constrained`` goes left to right and only allows ``I-X`` right after ``B-X`` or
``I-X``, so the output is always a valid BIO sequence. A word cut off by ``task.max_length`` has no
token and is tagged ``O``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
from transformers import PreTrainedTokenizerBase

from fedpeft.config import ConfigError
from fedpeft.data.types import Example
from fedpeft.metrics.entity import entity_scores

IGNORE_INDEX = -100
OUTSIDE = "O"
BioDecoding = Literal["argmax", "constrained"]


def continuation_tags(tag_names: Sequence[str]) -> list[int]:
    """For each tag id, the id a later sub-token of the same word gets: ``I-X`` for ``B-X`` (when the
    tag set has it), the tag itself otherwise."""
    index = {name: position for position, name in enumerate(tag_names)}
    return [index.get("I-" + name[2:], position) if name.startswith("B-") else position
            for position, name in enumerate(tag_names)]


def align_labels(word_ids: Sequence[int | None], word_tags: Sequence[int], label_all: bool = False,
                 continuation: Sequence[int] | None = None) -> list[int]:
    """One training label per token: the word's tag on its first sub-token, :data:`IGNORE_INDEX`
    on special tokens and, unless ``label_all``, on the word's later sub-tokens (with ``label_all``
    they get ``continuation[tag]``, see :func:`continuation_tags`)."""
    labels = []
    previous: int | None = None
    for word in word_ids:
        if word is None:
            labels.append(IGNORE_INDEX)
        elif word != previous:
            labels.append(word_tags[word])
        elif label_all:
            tag = word_tags[word]
            labels.append(continuation[tag] if continuation is not None else tag)
        else:
            labels.append(IGNORE_INDEX)
        previous = word
    return labels


def first_subtoken_scores(scores: np.ndarray, word_ids: Sequence[int | None], num_words: int) -> np.ndarray:
    """``(num_words, tags)`` scores of each word's first sub-token; NaN rows for words without a token."""
    words = np.full((num_words, scores.shape[-1]), np.nan, dtype=np.float64)
    seen: set[int] = set()
    for position, word in enumerate(word_ids[: len(scores)]):
        if word is not None and word not in seen:
            seen.add(word)
            words[word] = scores[position]
    return words


def allowed_after(previous: str, tag_names: Sequence[str]) -> np.ndarray:
    """Tags a BIO sequence allows after ``previous``: anything but an ``I-X`` that does not continue X."""
    kind = None if previous == OUTSIDE else previous[2:]
    return np.array([not name.startswith("I-") or name[2:] == kind for name in tag_names])


def greedy_bio_decode(word_scores: np.ndarray, tag_names: Sequence[str], decoding: BioDecoding = "argmax") -> list[str]:
    """Word tags from ``(words, tags)`` scores, one word at a time (see the module docstring).
    A NaN row (a word without tokens) is tagged ``O``."""
    tags: list[str] = []
    previous = OUTSIDE
    for row in word_scores:
        if np.isnan(row).any():
            tag = OUTSIDE
        elif decoding == "constrained":
            tag = tag_names[int(np.argmax(np.where(allowed_after(previous, tag_names), row, -np.inf)))]
        else:
            tag = tag_names[int(np.argmax(row))]
        tags.append(tag)
        previous = tag
    return tags


@dataclass
class TokenTagging:
    """What scoring a token-classification split needs: each row's token -> word map, word count and
    gold tags (rows and examples coincide: one sentence, one row; an unlabelled sentence, as
    ``fedpeft predict`` reads them, has no gold tags but its words still get predicted tags)."""

    tag_names: tuple[str, ...]
    word_ids: list[list[int | None]]
    num_words: list[int]
    gold: list[list[str]]
    decoding: BioDecoding = "argmax"

    def predict(self, row: int, scores: np.ndarray) -> list[str]:
        """The word tags of ``row`` from its ``(tokens, tags)`` scores."""
        words = first_subtoken_scores(scores, self.word_ids[row], self.num_words[row])
        return greedy_bio_decode(words, self.tag_names, self.decoding)

    def score(self, rows: Sequence[int], scores: Sequence[np.ndarray], metrics: Sequence[str]) -> dict[str, float]:
        """Entity-level metrics of the rows' predicted word tags against the gold ones."""
        predicted = [self.predict(row, row_scores) for row, row_scores in zip(rows, scores, strict=True)]
        return entity_scores([self.gold[row] for row in rows], predicted, metrics)


def require_fast(tokenizer: PreTrainedTokenizerBase, what: str) -> None:
    if not tokenizer.is_fast:
        raise ConfigError("model.tokenizer", f"{what} needs a fast (Rust) tokenizer for word ids and offsets; "
                          f"{type(tokenizer).__name__} is not one")


def encode_tagging(examples: Sequence[Example], tokenizer: PreTrainedTokenizerBase, tag_names: Sequence[str],
                   max_length: int, label_all: bool = False, decoding: BioDecoding = "argmax"
                   ) -> tuple[list[dict[str, list[int]]], TokenTagging]:
    """Model features (``input_ids``, ``token_type_ids`` when the tokenizer has them, per-token
    ``labels``) of each sentence, truncated to ``max_length`` tokens, and its scoring data. A
    sentence without tags (to predict) has no training target: every label is ignored."""
    require_fast(tokenizer, "token classification")
    encoded = tokenizer([list(example.words) for example in examples], is_split_into_words=True, truncation=True,
                        max_length=max_length)
    continuation = continuation_tags(tag_names)
    keys = [key for key in ("input_ids", "token_type_ids") if key in encoded]
    features, word_ids = [], []
    for row, example in enumerate(examples):
        words = encoded.word_ids(row)
        feature = {key: encoded[key][row] for key in keys}
        feature["labels"] = (align_labels(words, example.tags, label_all, continuation) if example.tags
                             else [IGNORE_INDEX] * len(words))
        features.append(feature)
        word_ids.append(words)
    gold = [[tag_names[tag] for tag in example.tags] for example in examples]
    return features, TokenTagging(tuple(tag_names), word_ids, [len(example.words) for example in examples], gold,
                                  decoding)
