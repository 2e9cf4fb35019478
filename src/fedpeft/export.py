"""Use what was trained: load a run or an export, and export a run to standard formats.

A run directory holds ``config.yaml`` and ``checkpoint.pt`` (fedpeft-internal). Its model is
rebuilt exactly as the run built it before round 1 (:func:`fedpeft.experiment.build_model`: the
backbone, its seeded head and the adapter, FeDeRA's SVD residual included) and the checkpoint's
global state is loaded into it: the model the run's evaluation scored.

Export formats (every one writes :data:`METADATA` with the label names, the task, the base
model, the method and the fedpeft version, and ``config.yaml``):

- ``peft``: ``PeftModel.from_pretrained(base, DIR)`` loads it with plain transformers + PEFT
  (``adapter_config.json`` + ``adapter_model.safetensors``; the task head in ``modules_to_save``).
  LoRA family (lora, ffa_lora, rolora, hetlora, FLASC family, head pruning), FeDeRA, IA3, and deep
  (p_tuning_v2, FedPepTAO) or input (prompt_tuning) prompts of an encoder's sequence classifier.
  FeDeRA's frozen base is W0 - scale*B0*A0, not the pretrained W0; as PEFT's PiSSA conversion does,
  the export is the rank-2r LoRA [B, -B0] [A; A0] with the same scale, whose delta on the untouched
  W0 is scale*(B A - B0 A0): loading it on the pretrained model gives the fine-tuned one.
- ``merged``: the backbone with LoRA/IA3 folded into its weights (or the trained backbone itself for
  full fine-tuning and BitFit), loadable with ``AutoModelFor<Task>.from_pretrained(DIR)``.
- ``bundle``: ``config.yaml`` + the global trainable state (``trainable.safetensors``); every
  recipe (tensor-train and Houlsby adapters too); :func:`load` rebuilds the model from them.

A classifier that reads the mean of the encoder's output (``model.pooling`` ``mean`` or
``mean_no_pooler``: the ``auto`` default on MiniLM and MPNet) does so through fedpeft's hooks, which
transformers' classes do not have: the metadata's ``pooling`` records it, :func:`load` re-applies it,
and a plain transformers/PEFT user calls ``fedpeft.models.pooling.apply_pooling(model, pooling)``
after loading (``fedpeft export`` prints that line).

Random-weight (``tiny-*``) backbones exist nowhere on disk, so a ``peft`` export of one also saves
the untouched base (with its seeded head) in ``DIR/base``, and the metadata points there.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from peft import PeftConfig, PeftModel, PrefixTuningConfig, PromptTuningConfig, get_peft_model
from peft.tuners.lora import LoraLayer
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoTokenizer, PreTrainedTokenizerBase

import fedpeft
from fedpeft.adapters.base import HEAD_MODULE_NAMES, head_parameters
from fedpeft.adapters.ia3 import ia3_config
from fedpeft.adapters.lora import lora_config
from fedpeft.adapters.prompts import PREFIX_MODULE, PROMPT_MODULE, cache_keyword, kv_geometry
from fedpeft.config import ConfigError, ExperimentConfig
from fedpeft.data.types import TaskData
from fedpeft.experiment import build_model, load_data
from fedpeft.metrics.recorder import (
    CHECKPOINT,
    CONFIG,
    CheckpointError,
    ExportError,
    check_state,
    fingerprint_matches,
    read_saved_config,
)
from fedpeft.models.backbone import AUTO_CLASSES, Backbone, Head, load_backbone
from fedpeft.models.pooling import apply_pooling

EXPORT_FORMATS: tuple[str, ...] = ("peft", "merged", "bundle")
METADATA = "fedpeft_export.json"
BUNDLE_WEIGHTS = "trainable.safetensors"
BASE_DIR = "base"

LORA_KINDS = ("lora", "ffa_lora")
MERGEABLE_KINDS = (*LORA_KINDS, "ia3", "full", "bitfit")
PEFT_TASK_TYPES: dict[str, str] = {
    "sequence_classification": "SEQ_CLS", "token_classification": "TOKEN_CLS",
    "question_answering": "QUESTION_ANS", "causal_lm": "CAUSAL_LM", "seq2seq": "SEQ_2_SEQ_LM",
}
"""PEFT's task type of each head (multiple choice has none: PEFT's base ``PeftModel`` serves it)."""


@dataclass
class LoadedModel:
    """A ready model (eval mode) with what it needs to be used: its tokenizer, label names, task
    (meaning only, no examples), the experiment config it was trained with, and where it came from
    (``kind``: run, peft, merged or bundle)."""

    model: nn.Module
    tokenizer: PreTrainedTokenizerBase
    task: TaskData
    cfg: ExperimentConfig
    head: Head
    kind: str
    source: Path
    template: str | None = None

    @property
    def label_names(self) -> tuple[str, ...]:
        return self.task.label_names


# ------------------------------------------------------------------------------------------------
# Loading


def task_record(task: TaskData) -> dict[str, Any]:
    """The meaning of ``task`` (what a model's outputs are), without its examples."""
    return {"name": task.name, "problem_type": task.problem_type, "label_names": list(task.label_names),
            "metrics": list(task.metrics)}


def task_from_record(record: dict[str, Any]) -> TaskData:
    return TaskData(name=record["name"], problem_type=record["problem_type"],
                    label_names=tuple(record["label_names"]), metrics=tuple(record["metrics"]))


def read_config(directory: Path) -> ExperimentConfig:
    path = directory / CONFIG
    if not path.exists():
        raise ExportError(f"{directory} is neither a run directory nor a fedpeft export (no {CONFIG})")
    try:
        return read_saved_config(path)
    except (ConfigError, yaml.YAMLError) as err:
        raise ExportError(f"{path} is not a valid experiment config: {err}") from err


def read_checkpoint(run_dir: Path) -> dict[str, Any]:
    path = run_dir / CHECKPOINT
    if not path.exists():
        raise ExportError(f"no {CHECKPOINT} in {run_dir}: the run has not checkpointed a round yet")
    try:
        state = torch.load(path, weights_only=True)
    except Exception as err:
        raise ExportError(f"corrupt checkpoint {path}: {err}") from err
    if not isinstance(state, dict) or "global_state" not in state:
        raise ExportError(f"{path} is not a fedpeft checkpoint (no global_state)")
    return state


def trained_model(cfg: ExperimentConfig, task: TaskData, state: dict[str, torch.Tensor], source: Path
                  ) -> Backbone:
    """The run's model with ``state`` (its global trainable state) loaded, in eval mode."""
    backbone, slot = build_model(cfg, task)
    try:
        check_state(source, state, slot.read())
    except CheckpointError as err:
        raise ExportError(str(err)) from err
    slot.load(state)
    backbone.model.eval()
    return backbone


@dataclass
class Run:
    """A run directory read for export: its config, task, checkpointed round and trained model."""

    cfg: ExperimentConfig
    task: TaskData
    round: int
    backbone: Backbone
    run_dir: Path


def read_run(run_dir: Path, data_dir: str | None = None) -> Run:
    """Rebuild ``run_dir``'s model. The task's labels come from its data (as on resume), so the data
    must be where the run found it (or in ``data_dir``); an export needs no data."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ExportError(f"{run_dir} is not a directory")
    cfg = read_config(run_dir)
    checkpoint = read_checkpoint(run_dir)
    if not fingerprint_matches(checkpoint.get("fingerprint"), cfg):
        raise ExportError(f"{run_dir / CHECKPOINT} was written by another experiment config than {run_dir / CONFIG}")
    task, _ = load_data(cfg, data_dir)
    backbone = trained_model(cfg, task, checkpoint["global_state"], run_dir / CHECKPOINT)
    return Run(cfg, task, int(checkpoint["round"]), backbone, run_dir)


def load(path: str | os.PathLike[str], data_dir: str | None = None) -> LoadedModel:
    """A ready model for a run directory or any export directory (see the module docstring)."""
    source = Path(path)
    if (source / METADATA).exists():
        return _load_export(source)
    run = read_run(source, data_dir)
    backbone = run.backbone
    meaning = task_from_record(task_record(run.task))  # the labels and metrics, not the examples
    return LoadedModel(backbone.model, backbone.tokenizer, meaning, run.cfg, backbone.head, "run", source,
                       backbone.template)


def read_metadata(directory: Path) -> dict[str, Any]:
    try:
        return json.loads((directory / METADATA).read_text())
    except (OSError, ValueError) as err:
        raise ExportError(f"cannot read {directory / METADATA}: {err}") from err


def _load_export(directory: Path) -> LoadedModel:
    meta = read_metadata(directory)
    cfg = read_config(directory)
    task = task_from_record(meta["task"])
    fmt = meta.get("format")
    if fmt == "bundle":
        backbone = trained_model(cfg, task, load_file(str(directory / BUNDLE_WEIGHTS)), directory / BUNDLE_WEIGHTS)
        return LoadedModel(backbone.model, backbone.tokenizer, task, cfg, backbone.head, fmt, directory,
                           backbone.template)
    head: Head = meta["head"]
    pooling = meta.get("pooling", "head")  # exports before pooling was recorded were all refused unless head
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    if fmt == "merged":
        model = AUTO_CLASSES[head].from_pretrained(str(directory))
        apply_pooling(model, pooling)
    elif fmt == "peft":
        # the untouched base, as the export saw it, reading what the run's classifier read
        base = load_backbone(cfg.model.model_copy(update={"pooling": pooling}), task, cfg.seed)
        model = PeftModel.from_pretrained(base.model, str(directory))
        if isinstance(model.peft_config["default"], PrefixTuningConfig):
            model = PrefixTuned(model)
        elif head == "question_answering":
            # PEFT 0.21's question-answering forward drops token_type_ids (BERT's question/context
            # segments); its tuner model hands every input to the adapted backbone
            model = model.base_model
    else:
        raise ExportError(f"{directory / METADATA}: unknown format {fmt!r}; allowed: {', '.join(EXPORT_FORMATS)}")
    model.eval()
    return LoadedModel(model, tokenizer, task, cfg, head, fmt, directory)


class PrefixTuned(nn.Module):
    """PEFT's prefix-tuning forward: the prompt as every layer's cache, the attention mask extended
    by the prompt's length. PEFT 0.21 looks for a ``past_key_values`` parameter in the model's
    signature, which transformers 5 models name ``cache`` (``past_key_values`` is deprecated there),
    so ``PeftModel``'s own forward refuses them; this is that forward without the check, passing the
    prompt by the keyword the installed transformers takes."""

    def __init__(self, peft_model: PeftModel) -> None:
        super().__init__()
        self.peft_model = peft_model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> Any:
        batch = input_ids.shape[0]
        tokens = self.peft_model.peft_config["default"].num_virtual_tokens
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        mask = torch.cat([attention_mask.new_ones(batch, tokens), attention_mask], dim=1)
        model = self.peft_model.base_model
        kwargs[cache_keyword(model)] = self.peft_model.get_prompt(batch)
        return model(input_ids=input_ids, attention_mask=mask, **kwargs)


# ------------------------------------------------------------------------------------------------
# Exporting


def export_run(run_dir: Path, out: Path, fmt: str, data_dir: str | None = None) -> Path:
    """Write ``run_dir``'s model to ``out`` in ``fmt``; returns ``out``."""
    if fmt not in EXPORT_FORMATS:
        raise ExportError(f"--format: unknown format {fmt!r}; allowed: {', '.join(EXPORT_FORMATS)}")
    run = read_run(run_dir, data_dir)
    check_exportable(run, fmt)
    out.mkdir(parents=True, exist_ok=True)
    if fmt == "bundle":
        state = {name: param.detach().contiguous() for name, param in run.backbone.model.named_parameters()
                 if param.requires_grad}
        save_file(state, str(out / BUNDLE_WEIGHTS))
        base_path = None
    else:
        base_path = _write_standard(run, out, fmt)
    (out / CONFIG).write_text(run.cfg.to_yaml())
    metadata = {
        "format": fmt, "fedpeft_version": fedpeft.__version__, "method": run.cfg.method,
        "adapter": run.cfg.adapter.kind, "head": run.backbone.head, "task": task_record(run.task),
        "base_model": {"name": run.cfg.model.name, "path": base_path}, "pooling": run.backbone.pooling,
        "round": run.round,
        "run_dir": str(run.run_dir.resolve()),
    }
    (out / METADATA).write_text(json.dumps(metadata, indent=2) + "\n")
    return out


def pooling_note(directory: Path) -> str | None:
    """What a plain transformers/PEFT user must add to an export whose classifier reads a mean
    (``fedpeft.load`` adds it); None when it reads the model class's own first token."""
    meta = read_metadata(directory)
    pooling = meta.get("pooling", "head")
    if pooling == "head" or meta.get("format") == "bundle":
        return None
    return (f"this classifier reads the mean of the encoder's last layer (model.pooling {pooling}), not the first "
            "token transformers' class reads: fedpeft.load applies it; after a plain transformers/PEFT load call "
            f"fedpeft.models.pooling.apply_pooling(model, {pooling!r})")


def check_exportable(run: Run, fmt: str) -> None:
    """Refuse, in one line, a format that cannot represent the run's model."""
    kind, head, architecture = run.cfg.adapter.kind, run.backbone.head, run.backbone.architecture
    if fmt == "bundle":
        return
    if head == "masked_lm":
        raise ExportError(f"--format {fmt}: a masked_lm head reads label words through fedpeft's verbalizer, "
                          "which transformers has no class for; use --format bundle")
    if fmt == "merged":
        if kind not in MERGEABLE_KINDS:
            raise ExportError(f"--format merged: adapter {kind!r} cannot be folded into the backbone's weights "
                              f"(mergeable: {', '.join(MERGEABLE_KINDS)}); use --format peft or bundle")
        return
    if kind in ("full", "bitfit"):
        raise ExportError(f"--format peft: adapter {kind!r} changes the backbone's own weights, which PEFT does not "
                          "represent; use --format merged or bundle")
    if kind in ("prompt_tuning", "p_tuning_v2"):
        if head != "sequence_classification" or (kind == "prompt_tuning" and architecture != "encoder"):
            raise ExportError(f"--format peft: {kind} exports for an encoder's sequence classifier"
                              f"{'' if kind == 'prompt_tuning' else ' or a decoder'} only (this is a {architecture} "
                              f"with a {head} head); use --format bundle")
        return
    if kind not in (*LORA_KINDS, "ia3"):
        raise ExportError(f"--format peft: adapter {kind!r} has no PEFT equivalent; use --format bundle")


def _write_standard(run: Run, out: Path, fmt: str) -> str:
    """Write a ``peft`` or ``merged`` export plus the tokenizer; returns the base model's path."""
    cfg, backbone = run.cfg, run.backbone
    base_path = str(backbone.model.config._name_or_path or cfg.model.name)
    backbone.tokenizer.save_pretrained(str(out))
    if fmt == "merged" and cfg.adapter.kind in ("full", "bitfit"):  # the trained backbone is the model
        _name_labels(backbone.model, run.task)
        backbone.model.save_pretrained(str(out))
        return base_path
    pristine = load_backbone(cfg.model, run.task, cfg.seed)  # W0 and the seeded head, as before round 1
    _name_labels(pristine.model, run.task)
    if fmt == "peft" and cfg.model.name.startswith("tiny-"):  # a random base exists nowhere else
        pristine.model.save_pretrained(str(out / BASE_DIR))
        pristine.tokenizer.save_pretrained(str(out / BASE_DIR))
        base_path = BASE_DIR
    peft_model = peft_equivalent(run, pristine)
    if fmt == "merged":
        peft_model.merge_and_unload().save_pretrained(str(out))
    else:
        peft_model.save_pretrained(str(out))
    return base_path


def _name_labels(model: nn.Module, task: TaskData) -> None:
    """Record the label names in the model's config (what transformers' pipelines print)."""
    if task.problem_type in ("classification", "token_classification") and task.label_names:
        model.config.id2label = dict(enumerate(task.label_names))
        model.config.label2id = {name: index for index, name in enumerate(task.label_names)}


def _head_modules(backbone: Backbone) -> list[str]:
    """``modules_to_save`` of the task head: its top-level module, or the module of a parameter the
    checkpoint did not provide (e.g. a pooler that came without weights)."""
    modules = set()
    for name, _ in head_parameters(backbone):
        top = name.split(".")[0]
        modules.add(top if top in HEAD_MODULE_NAMES else name.rsplit(".", 1)[0])
    return sorted(modules)


def peft_config(run: Run, pristine: Backbone) -> PeftConfig:
    """The PEFT config that represents the run's adapter on the untouched ``pristine`` base."""
    cfg, backbone = run.cfg, run.backbone
    task_type = PEFT_TASK_TYPES.get(backbone.head)
    head = _head_modules(backbone)
    kind = cfg.adapter.kind
    if kind in LORA_KINDS:
        config: PeftConfig = lora_config(cfg.adapter, pristine)
        config.init_lora_weights = True  # the weights are loaded, not initialised
        if cfg.adapter.init == "svd":  # FeDeRA: [B, -B0] [A; A0], the same scale alpha / r
            config.r, config.lora_alpha = 2 * config.r, 2 * config.lora_alpha
    elif kind == "ia3":
        config = ia3_config(cfg.adapter, pristine)
    elif kind == "p_tuning_v2":
        layers, kv_heads, head_dim = kv_geometry(pristine.model.config)
        prefix = getattr(backbone.model, PREFIX_MODULE)
        config = PrefixTuningConfig(num_virtual_tokens=prefix.num_tokens, num_layers=layers,
                                    token_dim=kv_heads * head_dim, num_attention_heads=kv_heads,
                                    prefix_projection=False)
    else:
        prompt = getattr(backbone.model, PROMPT_MODULE)
        config = PromptTuningConfig(num_virtual_tokens=prompt.num_tokens, token_dim=prompt.embedding.shape[1],
                                    num_transformer_submodules=1)
    config.task_type = task_type
    config.modules_to_save = head
    return config


@torch.no_grad()
def peft_equivalent(run: Run, pristine: Backbone) -> PeftModel:
    """A PEFT model on ``pristine`` (consumed) that computes what the run's trained model computes."""
    cfg, trained = run.cfg, run.backbone.model
    config = peft_config(run, pristine)
    with warnings.catch_warnings():  # transformers 5 deprecates an attribute PEFT 0.21 reads: not the user's concern
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        peft_model = get_peft_model(pristine.model, config)
    targets = dict(peft_model.named_parameters())
    values = dict(trained.named_parameters())
    if cfg.adapter.init == "svd" and cfg.adapter.kind in LORA_KINDS:
        values.update(_federa_delta(run))
    adapter_marks = (".lora_A.", ".lora_B.", ".ia3_l.")
    for name, value in values.items():
        if any(mark in name for mark in adapter_marks):
            targets[_peft_name(name, targets)].copy_(value)
    for name, _ in head_parameters(run.backbone):
        targets[_peft_name(name, targets, head=True)].copy_(values[name])
    if cfg.adapter.kind == "p_tuning_v2":
        peft_model.prompt_encoder["default"].embedding.weight.copy_(getattr(trained, PREFIX_MODULE).embedding_weight())
    elif cfg.adapter.kind == "prompt_tuning":
        peft_model.prompt_encoder["default"].embedding.weight.copy_(getattr(trained, PROMPT_MODULE).embedding)
    peft_model.eval()
    return peft_model


def _peft_name(name: str, targets: dict[str, nn.Parameter], head: bool = False) -> str:
    """The PEFT model's parameter for the fedpeft parameter ``name`` (a head parameter: its trainable
    copy in ``modules_to_save``)."""
    module, leaf = name.rsplit(".", 1)
    if head:
        top, _, rest = name.partition(".")
        wrapped = top if top in HEAD_MODULE_NAMES else module
        suffix = f"{wrapped}.modules_to_save.default.{rest if top in HEAD_MODULE_NAMES else leaf}"
    else:
        suffix = name
    for prefix in ("base_model.model.", "base_model."):
        if prefix + suffix in targets:
            return prefix + suffix
    raise ExportError(f"the PEFT model has no parameter for {name}")


def _federa_delta(run: Run) -> dict[str, torch.Tensor]:
    """FeDeRA's LoRA as a delta on the pretrained W0 (PiSSA conversion): A' = [A; A0], B' = [B, -B0]."""
    initial, _ = build_model(run.cfg, run.task)  # A0, B0: the SVD init, rebuilt bit for bit
    start = dict(initial.model.named_parameters())
    out: dict[str, torch.Tensor] = {}
    for name, module in run.backbone.model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        for adapter in module.lora_A:
            a_name, b_name = f"{name}.lora_A.{adapter}.weight", f"{name}.lora_B.{adapter}.weight"
            out[a_name] = torch.cat([module.lora_A[adapter].weight, start[a_name]], dim=0)
            out[b_name] = torch.cat([module.lora_B[adapter].weight, -start[b_name]], dim=1)
    return out


def push_to_hub(out: Path, repo: str) -> str:
    """Upload the export folder ``out`` to the hub repository ``repo``; returns its URL."""
    check_hub_available()
    import huggingface_hub

    try:
        api = huggingface_hub.HfApi()
        api.create_repo(repo, exist_ok=True)
        return str(api.upload_folder(folder_path=str(out), repo_id=repo))
    except Exception as err:  # network, auth, naming: one line for the user, whatever the cause
        raise ExportError(f"--push-to-hub {repo}: {type(err).__name__}: {err}".splitlines()[0]) from err


def check_hub_available() -> None:
    """Fail before exporting when ``--push-to-hub`` cannot work (no huggingface_hub, or offline)."""
    try:
        from huggingface_hub import constants
    except ImportError as err:
        raise ExportError("--push-to-hub needs huggingface_hub (pip install huggingface_hub)") from err
    if constants.HF_HUB_OFFLINE:
        raise ExportError("--push-to-hub: the hub is offline here (HF_HUB_OFFLINE=1); unset it to upload")
