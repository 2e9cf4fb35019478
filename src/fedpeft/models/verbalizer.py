"""LM-BFF-style prompt-based classification for models with a masked-LM head (``model.head: masked_lm``).

Gao et al. (2021, LM-BFF), whose templates and label words FedPepTAO uses with RoBERTa: each
example is written into a template holding one mask token, e.g. ``"<s> {sentence} It was <mask> . </s>"``,
and class c is scored by the masked-LM logit of its label word (``great`` / ``terrible``) at the
mask position; the loss is cross-entropy over the label words' logits. The LM head stays frozen, so
no new classifier is trained. :class:`VerbalizedClassifier` wraps the masked LM so that it looks like
a sequence classifier to the rest of fedpeft (same batches, ``logits`` of shape (batch, classes)).

Templates use ``{0}``/``{1}`` for the texts and ``{mask}`` for the mask token. Defaults follow
LM-BFF's manual templates per task and fall back to ``"{0} It was {mask} ."`` (one text) or
``"{0} ? {mask} , {1}"`` (pairs); label words follow LM-BFF per label name and fall back to the label
name. A word that the tokenizer splits is represented by its first token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedTokenizerBase
from transformers.modeling_outputs import SequenceClassifierOutput

from fedpeft.config import ConfigError

TASK_TEMPLATES = {
    "sst2": "{0} It was {mask} .", "mr": "{0} It was {mask} .", "cr": "{0} It was {mask} .",
    "mpqa": "{0} It was {mask} .", "sst5": "{0} It was {mask} .", "subj": "{0} This is {mask} .",
    "cola": "{0} This is {mask} .", "mrpc": "{0} {mask} , {1}", "qqp": "{0} {mask} , {1}",
    "rte": "{0} ? {mask} , {1}", "qnli": "{0} ? {mask} , {1}", "mnli": "{0} ? {mask} , {1}",
    "snli": "{0} ? {mask} , {1}", "cb": "{0} ? {mask} , {1}", "boolq": "{0} ? {mask} , {1}",
}
LABEL_WORDS = {
    "negative": "terrible", "positive": "great", "entailment": "Yes", "not_entailment": "No", "neutral": "Maybe",
    "contradiction": "No", "equivalent": "Yes", "not_equivalent": "No", "duplicate": "Yes", "not_duplicate": "No",
    "acceptable": "correct", "unacceptable": "incorrect",
}
SINGLE_TEMPLATE = "{0} It was {mask} ."
PAIR_TEMPLATE = "{0} ? {mask} , {1}"


def default_template(task_name: str) -> str | None:
    """LM-BFF's template for a built-in task, or None (chosen per example by its number of texts)."""
    return TASK_TEMPLATES.get(task_name)


def label_word_ids(tokenizer: PreTrainedTokenizerBase, label_names: Sequence[str],
                   label_words: Sequence[str] | None) -> list[int]:
    """One vocabulary id per class (first token of `` word``); distinct ids are required."""
    words = list(label_words) if label_words is not None else [LABEL_WORDS.get(n, n) for n in label_names]
    if len(words) != len(label_names):
        raise ConfigError("model.label_words", f"{len(words)} words for {len(label_names)} labels {list(label_names)}")
    ids = [tokenizer(" " + word, add_special_tokens=False)["input_ids"][0] for word in words]
    if len(set(ids)) != len(ids):
        raise ConfigError("model.label_words", f"label words {words} share a first token; choose distinct words")
    return ids


def encode_with_template(tokenizer: PreTrainedTokenizerBase, texts: Sequence[str], template: str | None,
                         max_length: int) -> list[int]:
    """Token ids of the filled template with special tokens; texts are truncated so the mask always fits."""
    if tokenizer.mask_token is None:
        raise ConfigError("model.head", "masked_lm needs a tokenizer with a mask token")
    template = template or (SINGLE_TEMPLATE if len(texts) == 1 else PAIR_TEMPLATE)
    pieces: list[list[int] | int] = []  # token ids of literal text, or the index of a text slot
    rest = template
    while rest:
        start = rest.find("{")
        literal = rest if start < 0 else rest[:start]
        if literal.strip():  # trailing spaces would become tokens of their own in BPE vocabularies
            pieces.append(tokenizer(literal.rstrip(), add_special_tokens=False)["input_ids"])
        if start < 0:
            break
        end = rest.index("}", start)
        slot = rest[start + 1 : end]
        if slot == "mask":
            pieces.append([tokenizer.mask_token_id])
        elif slot.isdigit() and int(slot) < len(texts):
            pieces.append(int(slot))
        else:
            raise ConfigError("model.template", f"unknown placeholder {{{slot}}} for {len(texts)} text(s); "
                                                "allowed: {0}, {1}, {mask}")
        rest = rest[end + 1 :]
    if not any(p == [tokenizer.mask_token_id] for p in pieces):
        raise ConfigError("model.template", f"template {template!r} has no {{mask}}")
    text_ids = {i: tokenizer(" " + texts[i] if i else texts[i], add_special_tokens=False)["input_ids"]
                for i in range(len(texts))}
    fixed = sum(len(p) for p in pieces if isinstance(p, list))
    before, after = _special_tokens(tokenizer)
    budget = max(0, max_length - fixed - len(before) - len(after))
    while sum(len(text_ids[p]) for p in pieces if isinstance(p, int)) > budget:
        longest = max((p for p in pieces if isinstance(p, int)), key=lambda i: len(text_ids[i]))
        text_ids[longest] = text_ids[longest][:-1]
    body = [tok for p in pieces for tok in (text_ids[p] if isinstance(p, int) else p)]
    return [*before, *body, *after]


def _special_tokens(tokenizer: PreTrainedTokenizerBase) -> tuple[list[int], list[int]]:
    """The special tokens a tokenizer puts before and after one sequence ([CLS] / [SEP], <s> / </s>)."""
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a")["input_ids"]
    start = next(i for i in range(len(full) - len(plain) + 1) if full[i : i + len(plain)] == plain)
    return full[:start], full[start + len(plain) :]


def verbalized_classifier(language_model: nn.Module, tokenizer: PreTrainedTokenizerBase, label_names: Sequence[str],
                          template: str | None, label_words: Sequence[str] | None) -> VerbalizedClassifier:
    """Wrap a masked LM for classification with label words (``model.label_words`` or LM-BFF's defaults)."""
    if tokenizer.mask_token_id is None:
        raise ConfigError("model.head", "masked_lm needs a tokenizer with a mask token")
    return VerbalizedClassifier(language_model, tokenizer.mask_token_id,
                                label_word_ids(tokenizer, label_names, label_words), template)


class VerbalizedClassifier(nn.Module):
    """A masked LM read as a classifier: logits = LM logits of the label words at the mask position."""

    def __init__(self, language_model: nn.Module, mask_token_id: int, word_ids: Sequence[int],
                 template: str | None) -> None:
        super().__init__()
        self.language_model = language_model
        self.config = language_model.config
        self.mask_token_id = mask_token_id
        self.template = template
        self.register_buffer("word_ids", torch.tensor(list(word_ids)), persistent=False)

    def get_input_embeddings(self) -> nn.Module:
        return self.language_model.get_input_embeddings()

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, **kwargs: Any
                ) -> SequenceClassifierOutput:
        positions = (input_ids == self.mask_token_id).int().argmax(dim=1)
        out = self.language_model(input_ids=input_ids, **kwargs)
        at_mask = out.logits[torch.arange(input_ids.shape[0], device=input_ids.device), positions]
        logits = at_mask[:, self.word_ids]
        loss = F.cross_entropy(logits, labels) if labels is not None else None
        return SequenceClassifierOutput(loss=loss, logits=logits, hidden_states=out.hidden_states)
