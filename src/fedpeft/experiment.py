"""Turn a validated config into everything an engine needs, failing early on bad input.

``prepare`` loads the task, partitions it, builds the backbone and adapter, puts the model on
``engine.device`` (:mod:`fedpeft.devices`), tokenizes once, and builds the method's algorithm
and codecs. Anything wrong with the data (missing file,
unknown label, more clients than examples) raises :class:`ConfigError` here, before training.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

import fedpeft.adapters
import fedpeft.methods  # noqa: F401  (registers the methods' algorithms, codecs, selectors)
from fedpeft.adapters.base import build_adapter, trainable_names
from fedpeft.config import ConfigError, ExperimentConfig
from fedpeft.data.partition import partition_indices
from fedpeft.data.tasks import load_task, resolve_data_dir, task_names
from fedpeft.data.types import Example, TaskData
from fedpeft.devices import Placement, place_model
from fedpeft.federated.algorithm import Algorithm, MethodContext, build_algorithm
from fedpeft.federated.client import ModelSlot
from fedpeft.federated.codec import Codec, build_codec, schema_of
from fedpeft.federated.dp_sgd import per_sample_gradient_problems
from fedpeft.federated.privacy import PrivacyLedger
from fedpeft.federated.types import State
from fedpeft.metrics.task_metrics import compute_metrics
from fedpeft.models.backbone import Backbone, load_backbone
from fedpeft.models.encoding import (
    EncodedData,
    GenerationSettings,
    SpanSettings,
    encode_examples,
    example_mean_loss,
    predict,
    token_scores,
    training_batch,
)
from fedpeft.models.generation import evaluate_generation
from fedpeft.recipes import RECIPES


@dataclass
class Experiment:
    """A prepared run. ``shards`` are the partition (example indices per client); ``train_rows``
    the rows of ``train_data`` each client trains on (the same indices, except for QA, whose long
    contexts give several windows per example). ``validation_data`` is the tuning split (None when
    the task has none)."""

    cfg: ExperimentConfig
    task: TaskData
    shards: list[np.ndarray]
    train_rows: list[np.ndarray]
    backbone: Backbone
    slot: ModelSlot
    train_data: EncodedData
    eval_data: EncodedData
    algorithm: Algorithm
    down_codec: Codec
    up_codec: Codec
    initial_state: State
    privacy: PrivacyLedger | None = None
    validation_data: EncodedData | None = None

    @property
    def trainable_params(self) -> int:
        return sum(t.numel() for t in self.initial_state.values())


def load_data(cfg: ExperimentConfig, data_dir: str | None = None) -> tuple[TaskData, list[np.ndarray]]:
    """The task and its client shards (no model needed: used by ``fedpeft data`` too)."""
    if cfg.task.name not in task_names():  # name the real mistake before looking for a data folder
        raise ConfigError("task.name", f"unknown task {cfg.task.name!r}; allowed: {', '.join(task_names())}")
    root: Path | None = None
    if cfg.task.name == "file":
        try:  # a file task may use absolute paths and need no data folder
            root = resolve_data_dir(data_dir or cfg.task.data_dir)
        except ConfigError:
            root = None
    elif cfg.task.name != "hf":
        root = resolve_data_dir(data_dir or cfg.task.data_dir)
    task = load_task(cfg.task, root)
    labels = [ex.label for ex in task.train]
    groups = [ex.group for ex in task.train]
    seed = cfg.partition.seed if cfg.partition.seed is not None else cfg.seed
    shards = partition_indices(labels, cfg.partition, seed, groups)
    return task, shards


def build_model(cfg: ExperimentConfig, task: TaskData,
                placement: Placement | None = None) -> tuple[Backbone, ModelSlot]:
    """The backbone with the configured adapter, as every run builds it before round 1 (the same
    model, bit for bit, from the same config: a checkpoint's global state loads into it). With a
    ``placement`` (training), it is then put on that device, dtype and precision; without one
    (export, load) it stays on the CPU in fp32."""
    backbone = load_backbone(cfg.model, task, cfg.seed, placement.device if placement else None)
    torch.manual_seed(cfg.seed)
    build_adapter(cfg.adapter).apply(backbone)  # on the CPU: the adapters' seeded init is the same on any device
    trainable = trainable_names(backbone.model)
    if placement is not None:
        place_model(backbone.model, trainable, cfg, placement)
    return backbone, ModelSlot(backbone.model, trainable, placement)


def prepare(cfg: ExperimentConfig, data_dir: str | None = None) -> Experiment:
    if cfg.engine.threads:
        torch.set_num_threads(cfg.engine.threads)
    task, shards = load_data(cfg, data_dir)
    placement = Placement.from_config(cfg.engine)
    backbone, slot = build_model(cfg, task, placement)
    if cfg.client.logit_adjustment > 0 and (task.problem_type != "classification"
                                            or backbone.head != "sequence_classification"):
        raise ConfigError("client.logit_adjustment", f"adjusts a classifier's logits by the client's label prior: "
                          f"needs a classification task on a sequence_classification head, not {task.problem_type} "
                          f"on a {backbone.head} head")
    spans = SpanSettings.from_config(cfg)
    def encode(examples: Sequence[Example]) -> EncodedData:
        data = encode_examples(examples, backbone.tokenizer, backbone.head, task, cfg.task.max_length,
                               template=backbone.template, spans=spans)
        data.device = placement.device
        if data.generation is not None:
            data.generation = GenerationSettings(backbone.tokenizer, cfg.evaluation.max_new_tokens,
                                                 cfg.evaluation.num_beams)
        return data

    train_data, eval_data = encode(task.train), encode(task.eval)
    validation_data = encode(task.validation) if task.validation else None
    train_rows = [train_data.rows_of(shard) for shard in shards]
    ctx = MethodContext(backbone=backbone, slot=slot, task=task, shards=train_rows, train_data=train_data)
    algorithm = build_algorithm(RECIPES[cfg.method].algorithm, cfg, ctx)
    initial_state = algorithm.initial_state(slot.read())
    schema = schema_of(initial_state)  # the keys and shapes both codecs pack against
    privacy = None
    if cfg.client.dp is not None:
        check_private_training(cfg, slot, train_data, train_rows)
        privacy = PrivacyLedger(cfg.client.dp, cfg.client, [len(rows) for rows in train_rows])
        privacy.check()
    return Experiment(
        cfg=cfg, task=task, shards=shards, train_rows=train_rows, backbone=backbone, slot=slot, train_data=train_data,
        eval_data=eval_data, validation_data=validation_data, algorithm=algorithm,
        down_codec=build_codec(cfg.codec.down, "down", schema), up_codec=build_codec(cfg.codec.up, "up", schema),
        initial_state=initial_state, privacy=privacy,
    )


def check_private_training(cfg: ExperimentConfig, slot: ModelSlot, data: EncodedData,
                           shards: Sequence[np.ndarray]) -> None:
    """Fail before training when Opacus cannot give exact per-example gradients for this model
    (one probe step on 3 training examples; see :mod:`fedpeft.federated.dp_sgd`)."""
    examples = [int(i) for shard in shards for i in shard][:3]
    problems = per_sample_gradient_problems(slot.model, training_batch(data, examples), len(examples),
                                            lambda model, batch: example_mean_loss(model, data, batch))
    if problems:
        listed = "; ".join(f"{name}: {why}" for name, why in list(problems.items())[:3])
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise ConfigError("client.dp", f"DP-SGD needs exact per-example gradients, which Opacus cannot compute for "
                          f"adapter {cfg.adapter.kind!r} with a {data.head} head: {listed}{more}")


def evaluate(slot: ModelSlot, data: EncodedData, task: TaskData, state: State, batch_size: int,
             indices: Sequence[int] | None = None) -> dict[str, float]:
    """Load ``state`` and compute the task's metrics on ``data`` (all of its examples, or the
    examples ``indices``)."""
    slot.load(state)
    slot.model.eval()
    if data.scorer is not None:
        rows = list(range(len(data))) if indices is None else data.rows_of(indices).tolist()
        return data.scorer.score(rows, token_scores(slot.model, data, rows, batch_size), task.metrics)
    order = list(range(len(data))) if indices is None else [int(i) for i in indices]
    if data.generation is not None:
        return evaluate_generation(slot.model, data, order, batch_size, task.metrics)
    preds = [predict(slot.model, data, order[i : i + batch_size]) for i in range(0, len(order), batch_size)]
    predictions = torch.cat(preds).numpy()
    references = np.asarray([data.labels[i] for i in order])
    return compute_metrics(task.metrics, predictions, references)


def evaluate_splits(exp: Experiment, state: State) -> dict[str, dict[str, float]]:
    """The metrics of ``state`` on each split ``evaluation.splits`` names that the task has:
    ``{"eval": ..., "validation": ...}`` (the validation split only when there is one)."""
    batch_size = exp.cfg.evaluation.batch_size
    out: dict[str, dict[str, float]] = {}
    if "eval" in exp.cfg.evaluation.splits:
        out["eval"] = evaluate(exp.slot, exp.eval_data, exp.task, state, batch_size)
    if "validation" in exp.cfg.evaluation.splits and exp.validation_data is not None:
        out["validation"] = evaluate(exp.slot, exp.validation_data, exp.task, state, batch_size)
    return out


def default_run_dir(cfg: ExperimentConfig) -> Path:
    return Path("runs") / f"{cfg.method}_{cfg.task.name}_s{cfg.seed}"
