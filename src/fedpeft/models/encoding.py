"""Tokenize examples once, pad per batch, and turn model outputs into predictions.

Examples are tokenized once at start-up (no padding) and padded to the batch's longest
sequence, so a round spends its time in the model, not in the tokenizer. Generative heads
(``causal_lm``, ``seq2seq``) cast classification as text: the target is the label's name, and a
prediction is the label whose text the model finds most likely (rank classification). Generation
tasks train on each example's first reference text; :mod:`fedpeft.models.generation` decodes.

Token classification and extractive QA predict per token: their rows carry per-token targets
(:mod:`fedpeft.models.token_tagging`, :mod:`fedpeft.models.span_qa`), and a split's
:class:`TokenScorer` turns the model's per-token scores into the task's metrics. A long QA
context gives several rows (windows) per example: rows are what clients train on, examples what
partitions and evaluation count (:meth:`EncodedData.rows_of`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from fedpeft.config import ConfigError, ExperimentConfig
from fedpeft.data.types import Example, TaskData
from fedpeft.models.backbone import Head
from fedpeft.models.span_qa import encode_qa
from fedpeft.models.token_tagging import BioDecoding, encode_tagging
from fedpeft.models.verbalizer import encode_with_template

IGNORE_INDEX = -100
PROMPT_SUFFIX = " Answer:"
SPAN_TARGETS = ("start_positions", "end_positions")
TARGET_KEYS = ("labels", *SPAN_TARGETS)
"""Batch entries that are loss targets, not model inputs."""


@dataclass
class GenerationSettings:
    """How a generation task's texts are decoded at evaluation: greedy when ``num_beams == 1``."""

    tokenizer: PreTrainedTokenizerBase
    max_new_tokens: int = 64
    num_beams: int = 1


@dataclass(frozen=True)
class SpanSettings:
    """Encoding and scoring options of token classification and extractive QA (``task.*`` and
    ``evaluation.*`` fields of the same names)."""

    label_all_subtokens: bool = False
    doc_stride: int = 128
    n_best_size: int = 20
    max_answer_length: int = 30
    bio_decoding: BioDecoding = "argmax"

    @classmethod
    def from_config(cls, cfg: ExperimentConfig) -> SpanSettings:
        return cls(cfg.task.label_all_subtokens, cfg.task.doc_stride, cfg.evaluation.n_best_size,
                   cfg.evaluation.max_answer_length, cfg.evaluation.bio_decoding)


class TokenScorer(Protocol):
    """Turns per-token model scores of some rows into task metrics."""

    def score(self, rows: Sequence[int], scores: Sequence[np.ndarray], metrics: Sequence[str]) -> dict[str, float]:
        """``scores[i]`` is row ``rows[i]``'s ``(tokens, outputs)`` array (padding removed)."""
        ...


@dataclass
class EncodedData:
    """Tokenized examples of one split; ``features[i]`` maps field name -> token ids (or per-token
    targets: ``labels`` for token classification, ``start_positions``/``end_positions`` for QA).

    Generation tasks also carry ``targets`` (token ids of each example's first reference, + eos),
    ``references`` (every reference text, for ROUGE) and their decoding ``generation`` settings.
    Per-token tasks carry their ``scorer``; ``example_of`` maps rows to examples when an example
    has several rows (QA windows; None: row i is example i). Every batch is built on ``device``,
    the model's (``engine.device``, see :mod:`fedpeft.devices`).
    """

    features: list[dict[str, list[int]]]
    labels: list[int | float]
    head: Head
    pad_id: int
    label_targets: list[list[int]] | None = None
    targets: list[list[int]] | None = None
    references: list[tuple[str, ...]] | None = None
    generation: GenerationSettings | None = None
    scorer: TokenScorer | None = None
    example_of: list[int] | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    _rows: dict[int, list[int]] | None = field(default=None, init=False, repr=False)

    def __len__(self) -> int:
        return len(self.features)

    def rows_of(self, examples: Sequence[int]) -> np.ndarray:
        """The rows of ``examples``, example by example (each example's rows in order)."""
        if self.example_of is None:
            return np.asarray(examples, dtype=np.int64)
        if self._rows is None:
            self._rows = {}
            for row, example in enumerate(self.example_of):
                self._rows.setdefault(example, []).append(row)
        return np.asarray([row for example in examples for row in self._rows.get(int(example), [])], dtype=np.int64)


def label_targets(tokenizer: PreTrainedTokenizerBase, task: TaskData) -> list[list[int]]:
    """Token ids of each label's text (leading space so BPE vocabularies split words cleanly)."""
    targets = [tokenizer(" " + name, add_special_tokens=False)["input_ids"] for name in task.label_names]
    eos = tokenizer.eos_token_id
    return [[*ids, eos] for ids in targets]


def _prompt_text(example: Example) -> str:
    return " ".join(example.texts) + PROMPT_SUFFIX


def _encode_generation(examples: Sequence[Example], tokenizer: PreTrainedTokenizerBase, head: Head,
                       max_length: int) -> EncodedData:
    """Prompt = the input text(s) + :data:`PROMPT_SUFFIX`; target = the first reference + eos,
    each truncated to ``max_length`` tokens."""
    if head not in ("causal_lm", "seq2seq"):
        raise ConfigError("model.head", f"generation needs a causal_lm or seq2seq head, not {head}")
    missing = next((i for i, ex in enumerate(examples) if not ex.references), None)
    if missing is not None:
        raise ConfigError("task.name", f"generation example {missing} has no reference text")
    prompts = tokenizer([_prompt_text(ex) for ex in examples], truncation=True, max_length=max_length,
                        add_special_tokens=head == "seq2seq")
    answers = tokenizer([" " + ex.references[0] for ex in examples], truncation=True,
                        max_length=max(max_length - 1, 1), add_special_tokens=False)
    targets = [[*ids, tokenizer.eos_token_id] for ids in answers["input_ids"]]
    return EncodedData(
        features=[{"input_ids": ids} for ids in prompts["input_ids"]], labels=[0] * len(examples), head=head,
        pad_id=tokenizer.pad_token_id, targets=targets, references=[tuple(ex.references) for ex in examples],
        generation=GenerationSettings(tokenizer),
    )


def encode_examples(examples: Sequence[Example], tokenizer: PreTrainedTokenizerBase, head: Head,
                    task: TaskData, max_length: int, template: str | None = None,
                    spans: SpanSettings | None = None) -> EncodedData:
    if task.problem_type == "generation":
        return _encode_generation(examples, tokenizer, head, max_length)
    spans = spans or SpanSettings()
    if task.problem_type == "token_classification":
        features, tagging = encode_tagging(examples, tokenizer, task.label_names, max_length,
                                           spans.label_all_subtokens, spans.bio_decoding)
        return EncodedData(features, [0] * len(features), head, tokenizer.pad_token_id, scorer=tagging)
    if task.problem_type == "extractive_qa":
        features, answers = encode_qa(examples, tokenizer, max_length, spans.doc_stride, spans.n_best_size,
                                      spans.max_answer_length)
        return EncodedData(features, [0] * len(features), head, tokenizer.pad_token_id, scorer=answers,
                           example_of=answers.example_of)
    labels = [ex.label if ex.label is not None else 0 for ex in examples]
    targets = label_targets(tokenizer, task) if head in ("causal_lm", "seq2seq") else None
    features: list[dict[str, list[int]]] = []
    if head == "masked_lm":  # LM-BFF: the texts written into a template holding one mask token
        features = [{"input_ids": encode_with_template(tokenizer, ex.texts, template, max_length)} for ex in examples]
    elif head == "sequence_classification":
        firsts = [ex.texts[0] for ex in examples]
        seconds = [ex.texts[1] if len(ex.texts) > 1 else None for ex in examples]
        if any(s is not None for s in seconds):
            enc = tokenizer(firsts, [s or "" for s in seconds], truncation=True, max_length=max_length)
        else:
            enc = tokenizer(firsts, truncation=True, max_length=max_length)
        keys = [k for k in ("input_ids", "token_type_ids") if k in enc]
        features = [{k: enc[k][i] for k in keys} for i in range(len(examples))]
    elif head == "multiple_choice":
        for ex in examples:
            enc = tokenizer([ex.texts[0]] * len(ex.choices), list(ex.choices), truncation=True,
                            max_length=max_length)
            features.append({k: [tok for row in enc[k] for tok in [*row, -1]]
                             for k in ("input_ids", "token_type_ids") if k in enc})
    elif head == "causal_lm":
        enc = tokenizer([_prompt_text(ex) for ex in examples], truncation=True, max_length=max_length,
                        add_special_tokens=False)
        features = [{"input_ids": ids} for ids in enc["input_ids"]]
    else:
        enc = tokenizer([_prompt_text(ex) for ex in examples], truncation=True, max_length=max_length)
        features = [{"input_ids": ids} for ids in enc["input_ids"]]
    return EncodedData(features, labels, head, tokenizer.pad_token_id, targets)


def _pad(rows: Sequence[Sequence[int]], value: int) -> torch.Tensor:
    width = max(len(r) for r in rows)
    out = torch.full((len(rows), width), value, dtype=torch.long)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=torch.long)
    return out


def _split_choices(flat: list[int]) -> list[list[int]]:
    rows, current = [], []
    for tok in flat:
        if tok == -1:
            rows.append(current)
            current = []
        else:
            current.append(tok)
    return rows


def _classification_batch(data: EncodedData, idx: Sequence[int]) -> dict[str, torch.Tensor]:
    feats = [data.features[i] for i in idx]
    batch = {"input_ids": _pad([f["input_ids"] for f in feats], data.pad_id)}
    batch["attention_mask"] = _pad([[1] * len(f["input_ids"]) for f in feats], 0)
    if "token_type_ids" in feats[0]:
        batch["token_type_ids"] = _pad([f["token_type_ids"] for f in feats], 0)
    return batch


def _multiple_choice_batch(data: EncodedData, idx: Sequence[int]) -> dict[str, torch.Tensor]:
    per_example = [{k: _split_choices(v) for k, v in data.features[i].items()} for i in idx]
    n_choices = len(per_example[0]["input_ids"])
    flat = {k: [row for ex in per_example for row in ex[k]] for k in per_example[0]}
    batch = {"input_ids": _pad(flat["input_ids"], data.pad_id)}
    batch["attention_mask"] = _pad([[1] * len(r) for r in flat["input_ids"]], 0)
    if "token_type_ids" in flat:
        batch["token_type_ids"] = _pad(flat["token_type_ids"], 0)
    return {k: v.view(len(idx), n_choices, -1) for k, v in batch.items()}


def _generative_batch(data: EncodedData, idx: Sequence[int], targets: Sequence[Sequence[int]]
                      ) -> dict[str, torch.Tensor]:
    prompts = [data.features[i]["input_ids"] for i in idx]
    if data.head == "seq2seq":
        batch = {"input_ids": _pad(prompts, data.pad_id)}
        batch["attention_mask"] = _pad([[1] * len(p) for p in prompts], 0)
        batch["labels"] = _pad(targets, IGNORE_INDEX)
        return batch
    joined = [list(p) + list(t) for p, t in zip(prompts, targets)]
    batch = {"input_ids": _pad(joined, data.pad_id)}
    batch["attention_mask"] = _pad([[1] * len(j) for j in joined], 0)
    batch["labels"] = _pad([[IGNORE_INDEX] * len(p) + list(t) for p, t in zip(prompts, targets)], IGNORE_INDEX)
    return batch


def _on_device(data: EncodedData, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {key: value.to(data.device) for key, value in batch.items()}


def training_batch(data: EncodedData, idx: Sequence[int]) -> dict[str, torch.Tensor]:
    """Model inputs with the targets of this head's loss (``labels``, or the QA span positions),
    on the data's device."""
    return _on_device(data, _cpu_batch(data, idx))


def _cpu_batch(data: EncodedData, idx: Sequence[int]) -> dict[str, torch.Tensor]:
    if data.head == "token_classification":
        batch = _classification_batch(data, idx)
        batch["labels"] = _pad([data.features[i]["labels"] for i in idx], IGNORE_INDEX)
        return batch
    if data.head == "question_answering":
        batch = _classification_batch(data, idx)
        for key in SPAN_TARGETS:
            batch[key] = torch.tensor([data.features[i][key][0] for i in idx], dtype=torch.long)
        return batch
    if data.targets is not None:
        return _generative_batch(data, idx, [data.targets[i] for i in idx])
    if data.head in ("causal_lm", "seq2seq"):
        assert data.label_targets is not None
        return _generative_batch(data, idx, [data.label_targets[int(data.labels[i])] for i in idx])
    batch = (_multiple_choice_batch if data.head == "multiple_choice" else _classification_batch)(data, idx)
    dtype = torch.float if isinstance(data.labels[idx[0]], float) else torch.long
    batch["labels"] = torch.tensor([data.labels[i] for i in idx], dtype=dtype)
    return batch


def _target_log_probs(model: nn.Module, batch: dict[str, torch.Tensor], aligned: bool
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """log p of every target token (rows x positions) and the mask of real targets. Seq2seq and
    token-classification logits align with their labels (``aligned``); causal ones shift by one."""
    labels = batch["labels"]
    if aligned:
        logits = model(**batch).logits
    else:
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits[:, :-1]
        labels = labels[:, 1:]
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    mask = labels != IGNORE_INDEX
    return logprobs.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1), mask


def _sequence_log_likelihood(model: nn.Module, batch: dict[str, torch.Tensor], seq2seq: bool) -> torch.Tensor:
    """Sum of log p(target tokens) per row."""
    picked, mask = _target_log_probs(model, batch, seq2seq)
    return (picked * mask).sum(dim=-1)


PER_TOKEN_LOSS_HEADS = ("causal_lm", "seq2seq", "token_classification")
"""Heads whose transformers loss averages over every target token of the batch."""


def example_mean_loss(model: nn.Module, data: EncodedData, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The mean over examples of each example's own loss, as DP-SGD's per-example clipping needs:
    no example's loss may depend on the other examples of its batch (or one example's presence
    would change the others' gradients, and the sensitivity bound would not hold).

    Classification, regression and verbalizer heads already average one loss per example. For
    generation and token classification, transformers averages over all target tokens of the
    batch, which makes an example's weight depend on the other examples' lengths; here each
    example's loss is the mean over its own target tokens. Extractive QA (one loss per window):
    transformers' softmax over start/end positions includes the batch's padding, whose length
    depends on the longest window; here padding positions are masked out of it.
    """
    if data.head == "question_answering":
        inputs = {k: v for k, v in batch.items() if k not in SPAN_TARGETS}
        outputs = model(**inputs)
        padding = inputs["attention_mask"] == 0
        losses = [nn.functional.cross_entropy(logits.float().masked_fill(padding, float("-inf")), batch[key],
                                              reduction="none")
                  for logits, key in zip((outputs.start_logits, outputs.end_logits), SPAN_TARGETS)]
        return ((losses[0] + losses[1]) / 2).mean()
    if data.targets is None and data.head not in PER_TOKEN_LOSS_HEADS:
        return model(**batch).loss
    picked, mask = _target_log_probs(model, batch, data.head != "causal_lm")
    return -((picked * mask).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)).mean()


@torch.no_grad()
def output_scores(model: nn.Module, data: EncodedData, idx: Sequence[int]) -> torch.Tensor:
    """Per example ``idx``, the head's scores on the CPU: class logits (a generative head: each
    label text's log-likelihood), or the regression value (one column)."""
    if data.head in ("causal_lm", "seq2seq"):
        assert data.label_targets is not None
        return torch.stack([
            _sequence_log_likelihood(model, _on_device(data, _generative_batch(data, idx, [target] * len(idx))),
                                     data.head == "seq2seq")
            for target in data.label_targets
        ], dim=-1).cpu()
    return model(**model_inputs(training_batch(data, idx))).logits.cpu()


@torch.no_grad()
def predict(model: nn.Module, data: EncodedData, idx: Sequence[int]) -> torch.Tensor:
    """Predicted class ids (or regression values) for the examples ``idx``, on the CPU."""
    scores = output_scores(model, data, idx)
    if scores.shape[-1] == 1 and data.head == "sequence_classification" and isinstance(data.labels[0], float):
        return scores.squeeze(-1).float()
    return scores.argmax(dim=-1)


def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A training batch without its loss targets (:data:`TARGET_KEYS`)."""
    return {key: value for key, value in batch.items() if key not in TARGET_KEYS}


@torch.no_grad()
def token_scores(model: nn.Module, data: EncodedData, rows: Sequence[int], batch_size: int) -> list[np.ndarray]:
    """Per row, the head's ``(tokens, outputs)`` scores without padding: the tag logits of a
    token-classification head, ``[start, end]`` logits of a QA head."""
    out: list[np.ndarray] = []
    for begin in range(0, len(rows), batch_size):
        chunk = [int(row) for row in rows[begin : begin + batch_size]]
        inputs = model_inputs(training_batch(data, chunk))
        output = model(**inputs)
        if data.head == "question_answering":
            scores = torch.stack([output.start_logits, output.end_logits], dim=-1)
        else:
            scores = output.logits
        lengths = inputs["attention_mask"].sum(dim=1).tolist()
        scores = scores.float().cpu()
        out.extend(scores[i, :length].numpy() for i, length in enumerate(lengths))
    return out
