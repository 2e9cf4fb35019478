"""Houlsby bottleneck adapters, with a pluggable linear layer (dense here, tensor-train in ``adapters/tt``).

A bottleneck adapter (Houlsby et al. 2019) maps a hidden state ``h`` to
``h + s * Up(act(Down(dropout(h))))`` with ``Down: d -> m`` and ``Up: m -> d`` (m = bottleneck
size, 64 by default). Placement follows the released LoRETTA code that FedTT builds on (SPEC,
"released code"): an *output* adapter on the output projection of every attention block and of
every feed-forward block (BERT family: ``attention.output.dense`` and ``output.dense``, applied
before their dropout + LayerNorm, as Houlsby places them); for LLaMA-style MLPs, *input* adapters
on ``gate_proj``/``up_proj`` (``f(x + B(x))``) and an output adapter on ``down_proj``, and none
after attention. ``decoder_layout: after_blocks`` gives LLaMA-style decoders what the FedTT paper's
text describes instead (Sec. 4.1, "after the attention and feed-forward blocks"): an output adapter on
the attention's ``o_proj`` and one on the MLP's ``down_proj`` (:data:`AFTER_BLOCK_PLACEMENTS`); the
other models' default placement already is after each block, so the option changes nothing there.
Encoder-decoder models get an adapter after every attention block (self and cross) and every
feed-forward block of both stacks.

What a projection is made of is a :data:`LinearFactory`: :class:`HoulsbyAdapter` (kind
``houlsby``) uses dense ``nn.Linear`` layers; FedTT's tensorized adapter (kind ``tt``) passes
tensor-train layers and reuses everything else here.

Choices (the Houlsby paper leaves them open, LoRETTA's code fixes them): ReLU, scaling 1,
dropout 0, dense weights ~ N(0, 0.02) with zero biases (near-identity at round 0, the
``init_bert_weights`` of adapter-transformers/LoRETTA); unlike LoRETTA's dense variant, whose
projections have no bias, ours keep Houlsby's biases.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from torch import nn
from transformers.activations import ACT2FN

from fedpeft.adapters.base import Adapter, register_adapter
from fedpeft.config import AdapterConfig, ConfigError
from fedpeft.models.backbone import Backbone

Placement = Literal["input", "output"]
LinearFactory = Callable[[int, int], nn.Module]
"""Builds a layer mapping ``(..., in_features) -> (..., out_features)``."""

ADAPTER_PLACEMENTS: dict[str, dict[str, Placement]] = {
    "bert": {"attention.output.dense": "output", "output.dense": "output"},
    "roberta": {"attention.output.dense": "output", "output.dense": "output"},
    "xlm-roberta": {"attention.output.dense": "output", "output.dense": "output"},
    "deberta": {"attention.output.dense": "output", "output.dense": "output"},
    "deberta-v2": {"attention.output.dense": "output", "output.dense": "output"},
    "electra": {"attention.output.dense": "output", "output.dense": "output"},
    "distilbert": {"attention.out_lin": "output", "ffn.lin2": "output"},
    "gpt2": {"attn.c_proj": "output", "mlp.c_proj": "output"},
    "mpnet": {"attention.attn.o": "output", "output.dense": "output"},
    "llama": {"mlp.gate_proj": "input", "mlp.up_proj": "input", "mlp.down_proj": "output"},
    "mistral": {"mlp.gate_proj": "input", "mlp.up_proj": "input", "mlp.down_proj": "output"},
    "qwen2": {"mlp.gate_proj": "input", "mlp.up_proj": "input", "mlp.down_proj": "output"},
    "t5": {"SelfAttention.o": "output", "EncDecAttention.o": "output", "DenseReluDense.wo": "output"},
    "mt5": {"SelfAttention.o": "output", "EncDecAttention.o": "output", "DenseReluDense.wo": "output"},
    "bart": {"self_attn.out_proj": "output", "encoder_attn.out_proj": "output", "fc2": "output"},
    "mbart": {"self_attn.out_proj": "output", "encoder_attn.out_proj": "output", "fc2": "output"},
}
"""Module-name suffix -> placement, per ``model_type``: after each attention and FFN block (LLaMA-style
decoders: LoRETTA's MLP input and output adapters)."""

AFTER_BLOCK_PLACEMENTS: dict[str, dict[str, Placement]] = {
    model_type: {"self_attn.o_proj": "output", "mlp.down_proj": "output"}
    for model_type in ("llama", "mistral", "qwen2")
}
"""``decoder_layout: after_blocks``: LLaMA-style decoders with an adapter after attention and after the MLP."""


class BottleneckOptions(BaseModel):
    """The adapter-specific fields of ``adapter:`` for bottleneck adapters (``target_modules`` and
    ``dropout`` are the common fields of :class:`~fedpeft.config.AdapterConfig`)."""

    model_config = ConfigDict(extra="forbid")

    bottleneck_size: int = Field(64, gt=0)
    non_linearity: str = "relu"
    scaling: float = 1.0
    input_target_modules: list[str] | None = None
    decoder_layout: Literal["loretta", "after_blocks"] = "loretta"

    @field_validator("non_linearity")
    @classmethod
    def _known_activation(cls, value: str) -> str:
        if value not in ACT2FN:
            raise ValueError(f"unknown activation {value!r}; allowed: {', '.join(sorted(ACT2FN))}")
        return value


def parse_options(cfg: AdapterConfig, options: type[BaseModel]) -> Any:
    """Validate the extra fields of ``cfg`` against ``options``; errors name ``adapter.<field>``."""
    try:
        return options.model_validate(cfg.model_extra or {})
    except ValidationError as err:
        first = err.errors()[0]
        field = "adapter." + ".".join(str(p) for p in first["loc"])
        message = first["msg"].removeprefix("Value error, ")
        if first["type"] == "extra_forbidden":
            allowed = ", ".join(sorted(options.model_fields))
            message = f"unknown field for adapter kind {cfg.kind!r}; its fields: {allowed}"
        raise ConfigError(field, message) from None


class Bottleneck(nn.Module):
    """``s * up(act(down(dropout(h))))``: the adapter's branch (the residual is the caller's)."""

    def __init__(self, features: int, bottleneck_size: int, linear_factory: LinearFactory,
                 non_linearity: str = "relu", dropout: float = 0.0, scaling: float = 1.0) -> None:
        super().__init__()
        self.down = linear_factory(features, bottleneck_size)
        self.up = linear_factory(bottleneck_size, features)
        self.act = ACT2FN[non_linearity]
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.scaling = scaling

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.up(self.act(self.down(self.dropout(hidden)))) * self.scaling


class AdaptedLayer(nn.Module):
    """A frozen layer with a bottleneck adapter at its output (``y = f(x); y + B(y)``) or its
    input (``f(x + B(x))``). ``weight``/``bias`` stay reachable, as models sometimes read them."""

    def __init__(self, base_layer: nn.Module, adapter: Bottleneck, placement: Placement) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.adapter = adapter
        self.placement = placement

    @property
    def weight(self) -> torch.Tensor:
        return self.base_layer.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base_layer.bias

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.placement == "input":
            return self.base_layer(x + self.adapter(x), *args, **kwargs)
        out = self.base_layer(x, *args, **kwargs)
        return out + self.adapter(out)


def layer_features(module: nn.Module) -> tuple[int, int]:
    """(in, out) features of a projection: ``nn.Linear`` or GPT-2's ``Conv1D``."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if hasattr(module, "nf") and hasattr(module, "nx"):
        return int(module.nx), int(module.nf)
    raise TypeError(f"cannot adapt a {type(module).__name__}: not a Linear or Conv1D projection")


def _matches(name: str, suffix: str) -> bool:
    return name == suffix or name.endswith("." + suffix)


def resolve_targets(model: nn.Module, cfg: AdapterConfig, options: BottleneckOptions) -> dict[str, Placement]:
    """Module name -> placement for every layer that gets an adapter.

    ``adapter.target_modules`` (output adapters) and ``adapter.input_target_modules`` (input
    adapters), given as name suffixes, replace the per-model default of :data:`ADAPTER_PLACEMENTS`
    (:data:`AFTER_BLOCK_PLACEMENTS` with ``decoder_layout: after_blocks``).
    """
    model_type = model.config.model_type
    if cfg.target_modules is None and options.input_target_modules is None:
        if model_type not in ADAPTER_PLACEMENTS:
            raise ConfigError("adapter.target_modules", f"no default adapter placement for model type "
                              f"{model_type!r}; set adapter.target_modules (and input_target_modules)")
        suffixes = ADAPTER_PLACEMENTS[model_type]
        if options.decoder_layout == "after_blocks":
            suffixes = AFTER_BLOCK_PLACEMENTS.get(model_type, suffixes)
    else:
        suffixes = {s: "output" for s in cfg.target_modules or []}
        suffixes.update({s: "input" for s in options.input_target_modules or []})
    targets: dict[str, Placement] = {}
    for name, module in model.named_modules():
        if isinstance(module, AdaptedLayer) or ".adapter." in f".{name}.":
            continue
        # the most specific suffix wins: "attention.output.dense" over "output.dense"
        hits = sorted((s for s in suffixes if _matches(name, s)), key=len, reverse=True)
        if hits:
            targets[name] = suffixes[hits[0]]
    if not targets:
        field = "adapter.target_modules" if cfg.target_modules else "adapter.input_target_modules"
        raise ConfigError(field, f"no module of the {model_type} model matches {sorted(suffixes)}")
    return targets


def inject_bottlenecks(model: nn.Module, cfg: AdapterConfig, options: BottleneckOptions,
                       linear_factory: LinearFactory) -> list[AdaptedLayer]:
    """Wrap every target layer of ``model`` with a bottleneck adapter whose projections come from
    ``linear_factory``; the adapters' parameters are left trainable, the wrapped layers frozen."""
    adapted = []
    for name, placement in resolve_targets(model, cfg, options).items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        base = getattr(parent, child)
        try:
            in_features, out_features = layer_features(base)
        except TypeError as err:
            raise ConfigError("adapter.target_modules", f"{name}: {err}") from err
        features = in_features if placement == "input" else out_features
        adapter = Bottleneck(features, options.bottleneck_size, linear_factory, options.non_linearity,
                             cfg.dropout, options.scaling)
        adapter.requires_grad_(True)
        layer = AdaptedLayer(base, adapter, placement)
        setattr(parent, child, layer)
        adapted.append(layer)
    return adapted


def dense_linear(in_features: int, out_features: int) -> nn.Linear:
    """A dense projection initialised N(0, 0.02), bias 0 (adapter-transformers' BERT init)."""
    layer = nn.Linear(in_features, out_features)
    nn.init.normal_(layer.weight, std=0.02)
    nn.init.zeros_(layer.bias)
    return layer


@register_adapter
class HoulsbyAdapter(Adapter):
    """Dense Houlsby bottleneck adapters (recipe ``adapter``): the baseline FedTT tensorizes."""

    kind: ClassVar[str] = "houlsby"
    adapter_options = (BottleneckOptions,)

    def __init__(self, cfg: AdapterConfig) -> None:
        super().__init__(cfg)
        self.options: BottleneckOptions = parse_options(cfg, BottleneckOptions)

    def inject(self, backbone: Backbone) -> None:
        inject_bottlenecks(backbone.model, self.cfg, self.options, dense_linear)

