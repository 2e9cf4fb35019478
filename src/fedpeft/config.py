"""Experiment configuration: pydantic models, YAML loading and ``--set`` overrides.

An experiment is ``task + partition + model + adapter + client + strategy + codec + engine +
evaluation + output``. A ``method`` names a recipe (see :mod:`fedpeft.recipes`) whose defaults
sit under the user's values: the user's YAML always wins. Every value is validated before any
training starts; a bad value raises :class:`ConfigError` naming the field and what is allowed.
"""

from __future__ import annotations

import copy
import difflib
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)


class ConfigError(ValueError):
    """A configuration value is wrong. ``field`` is the dotted path of the offending value."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


PositiveInt = Annotated[int, Field(gt=0)]
PositiveFloat = Annotated[float, Field(gt=0)]
Density = Annotated[float, Field(gt=0, le=1)]


class TaskConfig(_Strict):
    """Which data and what it means.

    ``name`` is a built-in task (``sst2``, ``mnli``, ``20newsgroups``, ...), ``file`` for a
    user's own files described by the fields below, or ``hf`` for a Hugging Face dataset id.

    Token classification (NER): ``label_all_subtokens`` labels every sub-token of a word (B-X
    becomes I-X after the first) instead of the first only; ``token_class_by`` says what a
    sentence's class is for label-skewed partitions: the set of its tags (FeDeRA App. A.2,
    Table 6) or of its entity types. Extractive QA: ``doc_stride`` is the overlap, in tokens,
    of consecutive windows over a long context; ``qa_class_by`` is a question's class for
    label-skewed partitions: its article ``title``, or one of ``qa_clusters`` k-means clusters of
    the questions' MiniLM sentence embeddings (``question_clusters``, FeDeRA App. A.2: 30).
    """

    name: str = "sst2"
    data_dir: str | None = None
    eval_split: str | None = None
    max_train_examples: PositiveInt | None = None
    max_eval_examples: PositiveInt | None = None
    max_length: PositiveInt = 128
    strip_newsgroup_metadata: bool = True
    # generic file / hf tasks
    train_file: str | None = None
    eval_file: str | None = None
    format: Literal["auto", "csv", "tsv", "json", "jsonl", "parquet"] = "auto"
    header: bool = True
    text_columns: list[str | int] = Field(default_factory=list)
    text_pair_columns: list[str | int] = Field(default_factory=list)
    join_with: str = " "
    label_column: str | int | None = None
    label_names: list[str] | None = None
    label_map: dict[str, int] | None = None
    problem_type: Literal["classification", "regression", "multiple_choice", "generation", "token_classification",
                          "extractive_qa"] | None = None
    metrics: list[str] | None = None
    group_column: str | int | None = None
    hf_dataset: str | None = None
    hf_config: str | None = None
    hf_train_split: str = "train"
    hf_eval_split: str = "validation"
    # token classification and extractive QA
    label_all_subtokens: bool = False
    token_class_by: Literal["tags", "entity_types"] = "tags"
    doc_stride: PositiveInt = 128
    qa_class_by: Literal["title", "question_clusters"] = "title"
    qa_clusters: PositiveInt = 30
    # a validation split for tuning, never used for reporting (see fedpeft.data.validation)
    validation_fraction: float | None = None
    validation_file: str | None = None

    @field_validator("validation_fraction")
    @classmethod
    def _fraction_inside(cls, value: float | None) -> float | None:
        if value is not None and not 0 < value < 1:
            raise ValueError(f"must lie strictly between 0 and 1, got {value}")
        return value

    @model_validator(mode="after")
    def _one_validation_source(self) -> TaskConfig:
        if self.validation_fraction is not None and self.validation_file is not None:
            raise ConfigError("task.validation_file", "set task.validation_fraction or task.validation_file, not both")
        return self


class PartitionConfig(_Strict):
    """How the training set is split across clients (deterministic for ``seed``). ``preset`` names
    a paper's setting (:mod:`fedpeft.data.presets`) whose values sit under the user's own.

    ``centralized`` is the non-federated reference (the ceiling every federated number is read
    against): one client holds all the training data and trains one local epoch per round, with
    the same recipe and model (:meth:`ExperimentConfig._centralized` sets the participation).
    """

    kind: Literal["iid", "dirichlet", "quantity_skew", "label_proportions", "natural", "centralized"] = "iid"
    num_clients: PositiveInt = 10
    alpha: PositiveFloat = 0.5
    # dirichlet: split each class over clients (NIID-Bench; sizes vary) or draw each client's label mix
    # (Hsu et al. 2019; equal sizes)
    dirichlet_over: Literal["classes", "clients"] = "classes"
    label_proportions: list[list[float]] | None = None
    min_examples_per_client: PositiveInt = 1
    seed: int | None = None
    preset: str | None = None


class ModelConfig(_Strict):
    """The backbone: ``minilm`` (offline alias), a local directory, a hub id, or ``tiny-<arch>``.

    ``dtype`` holds the frozen backbone in bf16/fp16 (half its memory; needs ``engine.precision`` of
    the same dtype); ``quantization: 4bit`` loads its linear layers as bitsandbytes NF4 with double
    quantisation and bf16 compute (QLoRA), ``8bit`` as LLM.int8(): LoRA-family adapters only, on a
    CUDA GPU, with ``pip install 'fedpeft[quant]'``.
    """

    name: str = "minilm"
    head: Literal["auto", "sequence_classification", "causal_lm", "seq2seq", "multiple_choice", "masked_lm",
                  "token_classification", "question_answering"] = "auto"
    tokenizer: str | None = None
    attn_implementation: str | None = None
    tiny_hidden_size: PositiveInt = 32
    tiny_layers: PositiveInt = 2
    tiny_heads: PositiveInt = 4
    template: str | None = None  # masked_lm: LM-BFF template with {0}, {1}, {mask} (default: per task)
    label_words: list[str] | None = None  # masked_lm: one word per label (default: LM-BFF's per label name)
    # the FROZEN backbone's storage (trainable parameters and optimizer state stay fp32), and QLoRA-style
    # bitsandbytes quantisation of its linear layers (see fedpeft.devices)
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    quantization: Literal["none", "4bit", "8bit"] = "none"
    # what an encoder's sequence classifier reads: ``head`` the model class's own (the first token),
    # ``mean`` the masked mean of the last layer, as sentence encoders (MiniLM, MPNet) were trained,
    # ``mean_no_pooler`` that mean straight into the classifier, past BERT's frozen pretrained pooler;
    # ``auto`` the mean where the checkpoint is a sentence encoder that pools by the mean (MiniLM:
    # mean_no_pooler, MPNet: mean), else head (fedpeft.models.pooling.resolve_pooling)
    pooling: Literal["auto", "head", "mean", "mean_no_pooler"] = "auto"


class AdapterConfig(_Strict):
    """What is trainable. ``kind`` names a registered adapter; extra fields are adapter-specific.

    LoRA's ``alpha`` sets its scale ``alpha / r``; left unset (None) it is the same as ``r``
    (scale 1, FeDeRA's beta = r), whatever ``r`` the user picks. Every LoRA recipe but ``federa``
    sets it explicitly. Read it through :attr:`lora_alpha`.
    """

    model_config = ConfigDict(extra="allow", validate_assignment=True)

    kind: str = "lora"
    r: PositiveInt = 8
    alpha: PositiveFloat | None = None
    dropout: Annotated[float, Field(ge=0, lt=1)] = 0.0
    target_modules: list[str] | None = None
    init: str = "gaussian"
    train_head: bool = True

    @property
    def lora_alpha(self) -> float:
        """The effective alpha: ``alpha`` when set, else ``r``."""
        return float(self.r) if self.alpha is None else self.alpha


class DPConfig(_Strict):
    """Local differential privacy: every client trains with DP-SGD (Abadi et al. 2016) through Opacus.

    Each step clips every example's gradient to L2 norm ``clip_norm`` (C) and adds N(0, sigma^2 C^2)
    to their sum; batches are Poisson samples at rate q = batch_size / n_i. The noise multiplier
    sigma of client i is the smallest that keeps its whole run, ``rounds`` x its local steps per
    round, within (``epsilon``, ``delta``) under ``accountant`` (FedTT Prop. 1, App. D). ``rounds``
    defaults to the experiment's ``rounds`` (a client may be selected in every round). The noise
    is drawn from OS entropy with Opacus's secure sampling unless ``noise_seed`` is set: whoever
    knows the seed can regenerate the noise and subtract it, so a seed is for reproducible
    experiments only (a seeded run resumes bit-identically). Each client's accountant
    is device-side state (it moves or stays with the client in every engine); replies report the
    epsilon spent. See :mod:`fedpeft.federated.dp_sgd` and :class:`fedpeft.federated.privacy.PrivacyLedger`.
    """

    epsilon: PositiveFloat
    delta: Annotated[float, Field(gt=0, lt=1)] = 1e-5
    clip_norm: PositiveFloat = 1.0
    accountant: Literal["rdp", "prv"] = "rdp"
    rounds: PositiveInt | None = None
    noise_seed: int | None = None

    @model_validator(mode="before")
    @classmethod
    def _reproducible_noise_was_replaced(cls, data: Any) -> Any:
        """Configs written before ``noise_seed`` seeded the noise with ``reproducible_noise: true``."""
        if isinstance(data, dict) and "reproducible_noise" in data:
            raise ConfigError("client.dp.reproducible_noise", "replaced by client.dp.noise_seed: leave it unset "
                              "for noise nobody can predict, or set an integer for a reproducible experiment")
        return data


class ClientConfig(_Strict):
    """Local training on a client's shard. Optimizer state is reset every round.

    ``dp`` turns on DP-SGD (:class:`DPConfig`). ``timeout_seconds`` is the server's deadline for a
    reply: in every engine a client whose simulated round time (download + measured compute x
    ``network.compute_scale`` x straggler slowdown + upload) exceeds it is dropped and recorded; in
    the Flower engine it also bounds the real wait for a SuperNode's reply (per client it serves).

    ``logit_adjustment`` (tau, classification only): local training adds ``tau * log(prior)`` to the
    logits before the cross-entropy, the prior being the client's own label frequencies (add-one
    smoothed), so a client that holds mostly one class learns the boundary instead of its own prior
    (:func:`fedpeft.federated.client.logit_adjusted_loss`; with ``optimizer: sgd``, whose steps scale
    with the gradient, unlike Adam's). 0 (default): the model's own loss.
    """

    optimizer: Literal["sgd", "adam", "adamw"] = "sgd"
    lr: PositiveFloat = 0.01
    momentum: Annotated[float, Field(ge=0, lt=1)] = 0.0
    weight_decay: Annotated[float, Field(ge=0)] = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    local_epochs: PositiveInt = 1
    local_steps: PositiveInt | None = None
    batch_size: PositiveInt = 16
    grad_clip: PositiveFloat | None = None
    logit_adjustment: Annotated[float, Field(ge=0)] = 0.0
    dp: DPConfig | None = None
    timeout_seconds: PositiveFloat | None = None

    @model_validator(mode="after")
    def _private_prior(self) -> ClientConfig:
        if self.dp is not None and self.logit_adjustment > 0:
            raise ConfigError("client.logit_adjustment", "not with client.dp: the prior is counted from the client's "
                              "labels, so one example would change every example's loss and DP-SGD's bound would not "
                              "hold")
        return self


class StrategyConfig(_Strict):
    """Server side: selection, aggregation and the server optimizer."""

    model_config = ConfigDict(extra="allow", validate_assignment=True)

    name: str = "fedavg"
    selection: str = "uniform"
    clients_per_round: PositiveInt | None = None
    fraction: Density | None = None
    min_clients: PositiveInt = 1
    server_lr: PositiveFloat = 1.0
    server_momentum: Annotated[float, Field(ge=0, lt=1)] = 0.9
    beta1: Annotated[float, Field(ge=0, lt=1)] = 0.9
    beta2: Annotated[float, Field(ge=0, lt=1)] = 0.99
    tau: PositiveFloat = 1e-3
    proximal_mu: Annotated[float, Field(ge=0)] = 0.0
    # the mean over clients: by sample count, or 1/N; None: the strategy's own default (samples, except
    # fedadamw: uniform, as FLASC's released code)
    weighting: Literal["samples", "uniform"] | None = None
    robust: Literal["none", "clip", "median", "trimmed_mean"] = "none"
    clip_norm: PositiveFloat = 1.0
    trim_fraction: Annotated[float, Field(ge=0, lt=0.5)] = 0.1
    max_update_bytes: PositiveInt | None = None


class DirectionCodecConfig(_Strict):
    """How one direction (down or up) is encoded. ``pack`` (dense codec only): one packed buffer
    behind a 17-byte header and a presence bitmask instead of safetensors' per-tensor JSON header,
    names and shapes being known to both sides (:func:`fedpeft.federated.codec.pack_state`)."""

    model_config = ConfigDict(extra="allow", validate_assignment=True)

    kind: str = "dense"
    dtype: Literal["fp32", "fp16", "bf16"] = "fp32"
    density: Density = 1.0
    pack: bool = False

    @model_validator(mode="after")
    def _pack_is_dense(self) -> DirectionCodecConfig:
        if self.pack and self.kind != "dense":
            raise ValueError(f"pack is an option of the dense codec, not of {self.kind!r} (which has its own "
                             "compact format)")
        return self


class CodecConfig(_Strict):
    down: DirectionCodecConfig = Field(default_factory=DirectionCodecConfig)
    up: DirectionCodecConfig = Field(default_factory=DirectionCodecConfig)


class EngineConfig(_Strict):
    """Where the clients run; every engine gives the same results for the same seeds.

    ``local``: this process. ``torchrun``: ranks share each round's clients (start it with
    ``torchrun --nproc-per-node K -m fedpeft run CONFIG``); ``backend`` picks the collectives
    (``auto``: NCCL when the model is on CUDA, else gloo). ``flower``: a Flower ServerApp and
    ClientApp over a SuperLink and SuperNodes (``fedpeft deploy``); ``round_timeout`` bounds the
    wait for a round's replies in seconds (null: until every node replies or the SuperLink
    declares it offline), ``connect_timeout`` the wait for every partition's SuperNode at start.
    ``cudnn_attention`` lets PyTorch pick cuDNN's fused attention for bf16/fp16 on CUDA (see
    :meth:`fedpeft.devices.Placement.autocast` for why it is off by default).
    """

    kind: Literal["local", "torchrun", "flower"] = "local"
    threads: PositiveInt | None = None
    measure_flops: Literal["first_round", "every_round", "never"] = "first_round"
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    round_timeout: PositiveFloat | None = None
    connect_timeout: PositiveFloat = 300.0
    device: str = "auto"
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    gradient_checkpointing: bool = False
    deterministic: bool = False
    cudnn_attention: bool = False

    @field_validator("device")
    @classmethod
    def _device_present(cls, value: str, info: ValidationInfo) -> str:
        if not re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", value):
            raise ValueError(f"allowed: auto, cpu, cuda, cuda:N, mps (got {value!r})")
        # asking torch costs an import; the defaults need no answer; a saved run's record is not checked
        # against this machine (see build_config's `here`)
        if value not in ("auto", "cpu") and _checks_hardware(info):
            from fedpeft.devices import device_problem

            problem = device_problem(value)
            if problem is not None:
                raise ValueError(problem)
        return value


class NetworkConfig(_Strict):
    """Simulated links for the time model (:mod:`fedpeft.federated.timing`); nothing is slowed down.

    Per client: ``down_mbps``/``up_mbps`` bandwidth, ``latency_ms`` per message, either the same
    for everyone (``constant``) or drawn per round and client (``lognormal`` with sigma ``spread``).
    ``compute_scale`` multiplies the measured client compute time (slower or faster devices).
    """

    down_mbps: PositiveFloat = 10.0
    up_mbps: PositiveFloat = 1.0
    latency_ms: Annotated[float, Field(ge=0)] = 0.0
    distribution: Literal["constant", "lognormal"] = "constant"
    spread: Annotated[float, Field(ge=0)] = 0.5
    compute_scale: PositiveFloat = 1.0


class EvaluationConfig(_Strict):
    """When and how the global model is evaluated. ``max_new_tokens`` and ``num_beams`` (1 = greedy)
    bound the decoding of generation tasks; ``task.max_eval_examples`` bounds how many are generated.
    Extractive QA keeps the ``n_best_size`` best start and end logits of each window and answers of
    at most ``max_answer_length`` tokens; token classification reads each word's tag off its first
    sub-token (``bio_decoding: argmax``) or left to right among the tags a BIO sequence allows next
    (``constrained``)."""

    every: PositiveInt = 1
    batch_size: PositiveInt = 64
    max_new_tokens: PositiveInt = 64
    num_beams: PositiveInt = 1
    n_best_size: PositiveInt = 20
    max_answer_length: PositiveInt = 30
    bio_decoding: Literal["argmax", "constrained"] = "argmax"
    per_client: bool = False
    at_start: bool = False
    # which splits are scored each evaluated round: the eval split (reported) and, when the task has
    # one, the validation split (for tuning); `fedpeft tune` scores the validation split only
    splits: list[Literal["eval", "validation"]] = Field(default_factory=lambda: ["eval", "validation"], min_length=1)


class OutputConfig(_Strict):
    run_dir: str | None = None
    checkpoint_every: PositiveInt = 1
    progress: bool = True


class FaultConfig(_Strict):
    """A fault injected into clients (any engine, where the client runs), to test what the server survives.

    Update faults corrupt the reply (``nan``, ``inf``, ``wrong_shape``, ``unknown_key``,
    ``missing_key``, ``oversize``, ``zero_samples``, ``huge`` = x1e6); message faults damage the
    encoded upload (``truncated``: cut in half; ``wrong_dtype``: a tensor sent as int64 under the
    codec's header); ``raise`` makes the client fail; ``dropout`` makes it vanish; ``straggler``
    multiplies its compute time by ``slowdown`` in the time model; ``timeout`` makes it never reply
    within ``client.timeout_seconds`` (required). ``clients``/``rounds`` restrict where (None:
    anywhere); ``probability`` draws per client and round from a seeded generator.
    """

    kind: Literal["nan", "inf", "wrong_shape", "unknown_key", "missing_key", "oversize", "zero_samples", "huge",
                  "truncated", "wrong_dtype", "raise", "dropout", "straggler", "timeout"]
    clients: list[int] | None = None
    rounds: list[int] | None = None
    probability: Density = 1.0
    slowdown: PositiveFloat = 4.0


class ExperimentConfig(_Strict):
    """A whole experiment. ``method`` picks a recipe; ``rounds`` federated rounds from ``seed``.

    ``paper_defaults: true`` layers the recipe's ``paper_values`` (the paper's settings for its
    runs of hundreds of rounds, where they differ from the recipe's defaults that learn in short
    runs) over its defaults, still under the user's own values.
    """

    method: str = "lora"
    paper_defaults: bool = False
    seed: int = 0
    rounds: PositiveInt = 10
    task: TaskConfig = Field(default_factory=TaskConfig)
    partition: PartitionConfig = Field(default_factory=PartitionConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    adapter: AdapterConfig = Field(default_factory=AdapterConfig)
    client: ClientConfig = Field(default_factory=ClientConfig)
    strategy: StrategyConfig = Field(default_factory=StrategyConfig)
    codec: CodecConfig = Field(default_factory=CodecConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    network: NetworkConfig = Field(default_factory=NetworkConfig)
    evaluation: EvaluationConfig = Field(default_factory=EvaluationConfig)
    output: OutputConfig = Field(default_factory=OutputConfig)
    faults: list[FaultConfig] = Field(default_factory=list)

    @field_validator("method")
    @classmethod
    def _known_method(cls, value: str) -> str:
        from fedpeft.recipes import RECIPES

        if value not in RECIPES:
            raise ValueError(f"unknown method {value!r}; allowed: {', '.join(sorted(RECIPES))}")
        return value

    @model_validator(mode="before")
    @classmethod
    def _centralized(cls, data: Any) -> Any:
        """``partition.kind: centralized``: one client with all the data, trained every round for one
        local epoch (whatever the recipe's participation and local steps say)."""
        partition = data.get("partition") if isinstance(data, dict) else None
        if not isinstance(partition, dict) or partition.get("kind") != "centralized":
            return data
        data = copy.deepcopy(data)
        data["partition"]["num_clients"] = 1
        strategy = data.setdefault("strategy", {})
        strategy.pop("fraction", None)
        strategy.update(clients_per_round=1, min_clients=1)
        data.setdefault("client", {}).update(local_epochs=1, local_steps=None)
        return data

    @model_validator(mode="after")
    def _participation(self) -> ExperimentConfig:
        if self.strategy.clients_per_round is not None and self.strategy.fraction is not None:
            raise ConfigError("strategy.fraction", "set clients_per_round or fraction, not both")
        k = self.clients_per_round()
        if k > self.partition.num_clients:
            raise ConfigError(
                "strategy.clients_per_round", f"{k} exceeds partition.num_clients ({self.partition.num_clients})"
            )
        if self.strategy.min_clients > k:
            raise ConfigError("strategy.min_clients", f"{self.strategy.min_clients} exceeds the {k} sampled per round")
        return self

    @model_validator(mode="after")
    def _strategy_fields(self) -> ExperimentConfig:
        """The strategy's own fields (``strategy.dp_*``, ...) checked with the rest, not when a run has
        loaded its model: building the strategy validates them, and asking it for its privacy guarantee
        checks the cohort against the population (a sweep validates every run before it starts any)."""
        from fedpeft.federated.strategy import build_strategy

        build_strategy(self.strategy).server_privacy(0, self.clients_per_round(), self.partition.num_clients)
        return self

    @model_validator(mode="after")
    def _validation_source(self) -> ExperimentConfig:
        if self.evaluation.splits == ["validation"] and self.task.validation_fraction is None \
                and self.task.validation_file is None:
            raise ConfigError("evaluation.splits", "scoring only the validation split needs one: set "
                              "task.validation_fraction or task.validation_file")
        return self

    @model_validator(mode="after")
    def _reliability(self) -> ExperimentConfig:
        if self.client.timeout_seconds is None and any(f.kind == "timeout" for f in self.faults):
            raise ConfigError("faults", "a timeout fault needs a deadline: set client.timeout_seconds")
        if self.client.dp is not None and self.client.dp.rounds is None:
            # pinned in the saved config, so a resumed run keeps the noise it was planned with
            self.client.dp.rounds = self.rounds
        return self

    @model_validator(mode="after")
    def _svd_init_unmasked(self) -> ExperimentConfig:
        # a lossy download codec zeroes LoRA entries in the model clients train; with FeDeRA's SVD init
        # those entries hold W0's principal part (see fedpeft.adapters.federa.refuse_svd_init)
        if self.adapter.init == "svd" and self.codec.down.kind == "topk" and self.codec.down.density < 1:
            raise ConfigError("adapter.init", "svd puts W0's top-r part into LoRA A and B, so a topk download codec "
                              "(codec.down.density < 1) would cut pretrained weight out of the clients' model; use "
                              "init kaiming or gaussian, or a lossless download")
        return self

    @model_validator(mode="after")
    def _accelerator(self, info: ValidationInfo) -> ExperimentConfig:
        engine, model = self.engine, self.model
        if (engine.precision, model.dtype, model.quantization, engine.gradient_checkpointing) == \
                ("fp32", "fp32", "none", False) or not _checks_hardware(info):
            return self
        from fedpeft.devices import accelerator_problem

        problem = accelerator_problem(self)
        if problem is not None:
            raise ConfigError(*problem)
        return self

    def clients_per_round(self) -> int:
        """Number of clients sampled each round (all of them in cross-silo mode)."""
        n = self.partition.num_clients
        if self.strategy.selection == "all":
            return n
        if self.strategy.clients_per_round is not None:
            return self.strategy.clients_per_round
        if self.strategy.fraction is not None:
            return max(1, round(self.strategy.fraction * n))
        return n

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` layered on ``base``: nested dicts merge key by key, anything else replaces; both
    inputs stay untouched."""
    merged = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def parse_override(item: str) -> tuple[list[str], Any]:
    """Parse ``a.b.c=value``; the value is read as YAML (numbers, bools, lists, null)."""
    if "=" not in item:
        raise ConfigError("--set", f"expected KEY=VALUE with a dotted key, got {item!r}")
    key, raw = item.split("=", 1)
    path = [part for part in key.strip().split(".") if part]
    if not path:
        raise ConfigError("--set", f"empty key in {item!r}")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as err:
        raise ConfigError(key, f"cannot parse value {raw!r}: {err}") from err
    return path, value


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    result = copy.deepcopy(raw)
    for item in overrides:
        path, value = parse_override(item)
        node = result
        for part in path[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(".".join(path), f"{part!r} is a value, not a section")
            node = child
        node[path[-1]] = value
    return result


def _format_validation_error(err: ValidationError) -> ConfigError:
    first = err.errors()[0]
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, ConfigError):
        return ConfigError(cause.field, str(cause).removeprefix(f"{cause.field}: "))
    field = ".".join(str(p) for p in first["loc"]) or "config"
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        message = "unknown field"
    elif first["type"] == "literal_error":
        message = f"{message} (got {first.get('input')!r})"
    more = len(err.errors()) - 1
    if more:
        message += f" (and {more} more error{'s' if more > 1 else ''})"
    return ConfigError(field, message)


def refuse_unread(section: str, given: set[str], extra: dict[str, Any], models: Sequence[type[BaseModel]],
                  owner: str, common: Iterable[str]) -> None:
    """Refuse a field of ``section`` that the user ``given`` and none of its readers' ``models`` names.

    The ``strategy`` and ``adapter`` sections allow extra fields because each method, strategy or
    adapter validates its own; without this a misspelt or misplaced one (``down_densty``, FLASC's
    ``density_tiers`` on LoRA) would be ignored and the run silently be another experiment. A recipe's
    default that the user's choice no longer reads (FedAdamW's ``weight_decay`` after ``name: fedavg``)
    is not the user's error, so only ``given`` fields are checked.
    """
    own = sorted({field for model in models for field in model.model_fields})
    for key in extra:
        if key in given and key not in own:
            close = difflib.get_close_matches(key, [*own, *common], n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            listed = ", ".join(own) if own else "none beyond the common ones"
            raise ConfigError(f"{section}.{key}", f"unknown field for {owner}; {hint}its own fields: {listed}")


def _checks_hardware(info: ValidationInfo) -> bool:
    return not (info.context or {}).get("elsewhere", False)


def build_config(raw: dict[str, Any], *, here: bool = True) -> ExperimentConfig:
    """Merge the recipe's defaults under ``raw`` and validate. ``here=False``: a config that ran
    elsewhere (a saved run's ``config.yaml``, read to compare, resume or export it), so what it asks of
    the hardware (``engine.device``, precision, quantisation) is not checked against this machine."""
    from fedpeft.recipes import RECIPES

    method = raw.get("method", "lora")
    if not isinstance(method, str) or method not in RECIPES:
        raise ConfigError("method", f"unknown method {method!r}; allowed: {', '.join(sorted(RECIPES))}")
    from fedpeft.data.presets import preset_sections

    recipe = RECIPES[method]
    defaults = deep_merge(recipe.defaults, recipe.paper_values) if raw.get("paper_defaults") else recipe.defaults
    merged = deep_merge(deep_merge(defaults, preset_sections(raw)), raw)
    merged["method"] = method
    try:
        cfg = ExperimentConfig.model_validate(merged, context={"elsewhere": not here})
    except ValidationError as err:
        raise _format_validation_error(err) from None
    if here:  # a config that already ran is read as it ran
        import fedpeft.methods  # noqa: F401  (registers the algorithms)
        from fedpeft.adapters.base import check_adapter_fields
        from fedpeft.federated.algorithm import check_strategy_fields

        check_strategy_fields(cfg, recipe.algorithm, _given(raw, defaults, "strategy"))
        check_adapter_fields(cfg.adapter, _given(raw, defaults, "adapter"))
    return cfg


def _given(raw: dict[str, Any], defaults: dict[str, Any], section: str) -> set[str]:
    """The fields of ``raw[section]`` the user chose: those that do not repeat the recipe's default (a
    resolved config read back, such as a tune's ``best.yaml``, holds every default)."""
    theirs = defaults.get(section) or {}
    return {key for key, value in (raw.get(section) or {}).items() if key not in theirs or theirs[key] != value}


def load_raw(path: str | Path | None, overrides: list[str] | None = None) -> dict[str, Any]:
    """A YAML experiment file (or nothing) as a mapping, with ``--set`` overrides applied; the
    recipe's values are not merged in yet (see :func:`build_config`)."""
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError("config", f"file not found: {path}")
        loaded = yaml.safe_load(path.read_text()) or {}
        if not isinstance(loaded, dict):
            raise ConfigError("config", f"{path} must hold a mapping at top level")
        raw = loaded
    return apply_overrides(raw, overrides or [])


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> ExperimentConfig:
    """Read a YAML experiment file (or start empty), apply ``--set`` overrides, validate."""
    return build_config(load_raw(path, overrides))
