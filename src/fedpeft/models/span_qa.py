"""Extractive QA: overlapping windows over long contexts, span targets, and answer post-processing.

Encoding (as Hugging Face's ``run_qa.py``): each question is paired with its context, which is cut
into windows of at most ``max_length`` tokens (question + context + special tokens) that overlap
by ``doc_stride`` context tokens, so an answer shorter than the overlap always lies whole inside at
least one window. A question may take at most half of a window (longer ones are cut), so every
window has room for more context than the overlap. A training window's targets are the first and
last token of the first gold answer when that answer lies whole inside the window, else the
first token (``[CLS]``), as BERT's SQuAD recipe does. Training rows are windows; evaluation is per
question.

Post-processing (``run_qa.py``'s ``postprocess_qa_predictions`` for SQuAD v1.1, which always
answers): in every window of a question, the ``n_best_size`` best start and end tokens are paired;
a pair counts when both tokens are context tokens, the end is not before the start and the span
has at most ``max_answer_length`` tokens; its score is start logit + end logit. The best pair over
all windows gives the answer, the context's text between the pair's character offsets. A question
without a valid pair answers the empty string.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from transformers import PreTrainedTokenizerBase

from fedpeft.config import ConfigError
from fedpeft.data.types import Example
from fedpeft.metrics.squad import squad_scores
from fedpeft.models.token_tagging import require_fast

NOT_CONTEXT = -1
"""Offset value of a token outside the context (question, special tokens, padding)."""


@dataclass
class SpanAnswers:
    """What scoring a QA split needs: each row's example and character offsets (``(tokens, 2)``,
    :data:`NOT_CONTEXT` outside the context), each example's context and gold answers."""

    example_of: list[int]
    offsets: list[np.ndarray]
    contexts: list[str]
    answers: list[tuple[str, ...]]
    n_best_size: int = 20
    max_answer_length: int = 30

    def best_spans(self, rows: Sequence[int], scores: Sequence[np.ndarray]) -> dict[int, tuple[float, int, int]]:
        """Each example's best ``(score, start char, end char)`` over its rows' windows, from their
        ``(tokens, 2)`` start/end scores; ``(-inf, 0, 0)`` (the empty answer) when no window has a
        valid span."""
        best: dict[int, tuple[float, int, int]] = {}
        for row, row_scores in zip(rows, scores, strict=True):
            example = self.example_of[row]
            span = best_span(row_scores[:, 0], row_scores[:, 1], self.offsets[row], self.n_best_size,
                             self.max_answer_length)
            if span is not None and (example not in best or span[0] > best[example][0]):
                best[example] = span
            best.setdefault(example, (-np.inf, 0, 0))
        return best

    def predict(self, rows: Sequence[int], scores: Sequence[np.ndarray]) -> dict[int, str]:
        """Each example's answer text from its rows' ``(tokens, 2)`` start/end scores."""
        return {example: self.contexts[example][start:end]
                for example, (_score, start, end) in self.best_spans(rows, scores).items()}

    def score(self, rows: Sequence[int], scores: Sequence[np.ndarray], metrics: Sequence[str]) -> dict[str, float]:
        """SQuAD exact match and F1 of the questions the rows belong to."""
        answers = self.predict(rows, scores)
        return squad_scores(list(answers.values()), [self.answers[example] for example in answers], metrics)


def best_span(start_scores: np.ndarray, end_scores: np.ndarray, offsets: np.ndarray, n_best_size: int,
              max_answer_length: int) -> tuple[float, int, int] | None:
    """``(score, start char, end char)`` of the best valid span of one window, or None."""
    length = min(len(start_scores), len(offsets))
    starts = np.argsort(start_scores[:length])[::-1][:n_best_size]
    ends = np.argsort(end_scores[:length])[::-1][:n_best_size]
    best: tuple[float, int, int] | None = None
    for start in starts.tolist():
        if offsets[start, 0] == NOT_CONTEXT:
            continue
        for end in ends.tolist():
            if offsets[end, 0] == NOT_CONTEXT or end < start or end - start + 1 > max_answer_length:
                continue
            score = float(start_scores[start] + end_scores[end])
            if best is None or score > best[0]:
                best = (score, int(offsets[start, 0]), int(offsets[end, 1]))
    return best


def span_targets(offsets: np.ndarray, answer_start: int, answer_end: int) -> tuple[int, int]:
    """First and last token of the answer ``[answer_start, answer_end)`` (characters) when the
    window's context tokens cover it whole, else ``(0, 0)`` (the ``[CLS]`` token)."""
    context = np.flatnonzero(offsets[:, 0] != NOT_CONTEXT)
    if not len(context) or offsets[context[0], 0] > answer_start or offsets[context[-1], 1] < answer_end:
        return 0, 0
    first = int(context[offsets[context, 0] <= answer_start][-1])
    last = int(context[offsets[context, 1] >= answer_end][0])
    return first, last


def question_budget(tokenizer: PreTrainedTokenizerBase, max_length: int, doc_stride: int) -> int:
    """The most tokens a question may take: half of a window's room for text. ``doc_stride`` must
    leave the context part of every window more tokens than the overlap."""
    room = max_length - tokenizer.num_special_tokens_to_add(pair=True)
    if doc_stride >= room - room // 2:
        raise ConfigError("task.doc_stride", f"{doc_stride} must be below {room - room // 2}, the context tokens a "
                          f"window of task.max_length {max_length} surely holds (questions take at most half)")
    return room // 2


def _cut_questions(tokenizer: PreTrainedTokenizerBase, questions: list[str], budget: int) -> list[str]:
    encoded = tokenizer(questions, add_special_tokens=False, return_offsets_mapping=True)
    return [text if len(offsets) <= budget else text[: offsets[budget - 1][1]]
            for text, offsets in zip(questions, encoded["offset_mapping"])]


def encode_qa(examples: Sequence[Example], tokenizer: PreTrainedTokenizerBase, max_length: int, doc_stride: int,
              n_best_size: int = 20, max_answer_length: int = 30
              ) -> tuple[list[dict[str, list[int]]], SpanAnswers]:
    """Window features (``input_ids``, ``token_type_ids`` when the tokenizer has them,
    ``start_positions``/``end_positions`` of the first gold answer) and the split's scoring data.
    A question without answers (to predict) targets ``[CLS]`` in every window."""
    require_fast(tokenizer, "extractive QA")
    if tokenizer.padding_side != "right":
        raise ConfigError("model.tokenizer", "extractive QA puts the question first and pads on the right")
    budget = question_budget(tokenizer, max_length, doc_stride)
    questions = _cut_questions(tokenizer, [example.texts[0] for example in examples], budget)
    contexts = [example.texts[1] for example in examples]
    encoded = tokenizer(questions, contexts, truncation="only_second", max_length=max_length, stride=doc_stride,
                        return_overflowing_tokens=True, return_offsets_mapping=True)
    keys = [key for key in ("input_ids", "token_type_ids") if key in encoded]
    features, offsets, example_of = [], [], []
    for row, example_index in enumerate(encoded["overflow_to_sample_mapping"]):
        sequence = encoded.sequence_ids(row)
        window = np.array([pair if part == 1 else (NOT_CONTEXT, NOT_CONTEXT)
                           for pair, part in zip(encoded["offset_mapping"][row], sequence)], dtype=np.int64)
        example = examples[example_index]
        first, last = (span_targets(window, example.answer_starts[0],
                                    example.answer_starts[0] + len(example.references[0]))
                       if example.answer_starts else (0, 0))
        feature = {key: encoded[key][row] for key in keys}
        feature["start_positions"], feature["end_positions"] = [first], [last]
        features.append(feature)
        offsets.append(window)
        example_of.append(int(example_index))
    answers = SpanAnswers(example_of, offsets, contexts, [tuple(example.references) for example in examples],
                          n_best_size, max_answer_length)
    return features, answers
