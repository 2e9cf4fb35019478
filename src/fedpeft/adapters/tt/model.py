"""Injecting FedTT's tensorized adapters into a backbone (FedTT Sec. 4.1, Fig. 1b/c).

The bottleneck adapters of :mod:`fedpeft.adapters.bottleneck` (same placement, ReLU, bottleneck
64, scaling 1, dropout 0), with every Down/Up projection a :class:`TTLinear` of rank
``adapter.tt_rank`` whose shape comes from :func:`~fedpeft.adapters.tt.shapes.tt_shape`.
Trainable: every core and bias of the adapters, the task head (``adapter.train_head``), and,
with ``adapter.tt_classifier`` (``auto``: where the checkpoint did not provide the head's hidden x
hidden dense layer, see :func:`tensorize_classifier`), the TT layer that replaces that layer.
"""

from __future__ import annotations

from typing import ClassVar

from torch import nn

from fedpeft.adapters.base import Adapter, register_adapter
from fedpeft.adapters.bottleneck import inject_bottlenecks, parse_options
from fedpeft.adapters.tt.config import TTOptions
from fedpeft.adapters.tt.layer import TTLinear
from fedpeft.adapters.tt.shapes import tt_shape
from fedpeft.config import AdapterConfig, ConfigError
from fedpeft.models.backbone import Backbone

CLASSIFIER_DENSE_NAMES = ("classifier.dense", "pooler.dense", "classification_head.dense")
"""The hidden x hidden dense layer of a classification head: RoBERTa/DeBERTa-v3's classifier,
BERT's pooler (before its tanh), BART's classification head."""


def tt_layers(model: nn.Module) -> dict[str, TTLinear]:
    """Module name -> TT layer, in model order."""
    return {name: module for name, module in model.named_modules() if isinstance(module, TTLinear)}


def classifier_dense_name(model: nn.Module) -> str | None:
    """Name of the head's square dense layer, if the model has one."""
    for name, module in model.named_modules():
        if (any(name == n or name.endswith("." + n) for n in CLASSIFIER_DENSE_NAMES)
                and isinstance(module, nn.Linear) and module.in_features == module.out_features):
            return name
    return None


def tensorize_classifier(backbone: Backbone, setting: bool | str) -> bool:
    """Whether ``adapter.tt_classifier`` (``setting``) replaces the head's dense layer: ``auto`` does
    where that layer is new (not in the checkpoint, so trained and sent in full otherwise)."""
    if setting != "auto":
        return bool(setting)
    name = classifier_dense_name(backbone.model) if backbone.head == "sequence_classification" else None
    return name is not None and f"{name}.weight" in backbone.new_parameters


@register_adapter
class TTAdapter(Adapter):
    """Tensorized bottleneck adapters (kind ``tt``): recipes ``fedtt`` and ``fedtt_plus``."""

    kind: ClassVar[str] = "tt"
    adapter_options = (TTOptions,)

    def __init__(self, cfg: AdapterConfig) -> None:
        super().__init__(cfg)
        self.options: TTOptions = parse_options(cfg, TTOptions)

    def linear(self, in_features: int, out_features: int) -> TTLinear:
        modes = tt_shape(in_features, out_features, self.options.tt_max_mode, self.options.tt_shapes)
        try:
            return TTLinear(in_features, out_features, modes, self.options.tt_rank,
                            contraction=self.options.tt_contraction)
        except ValueError as err:
            raise ConfigError("adapter.tt_contraction", f"{err}: use rebuild or auto, or reorder "
                              f"adapter.tt_shapes['{in_features}x{out_features}']") from err

    def inject(self, backbone: Backbone) -> None:
        adapted = inject_bottlenecks(backbone.model, self.cfg, self.options, self.linear)
        if self.options.tt_up_init_scale != 1.0:
            for layer in adapted:
                layer.adapter.up.scale_init(self.options.tt_up_init_scale)
        if tensorize_classifier(backbone, self.options.tt_classifier):
            self._tensorize_classifier(backbone)

    def _tensorize_classifier(self, backbone: Backbone) -> None:
        name = classifier_dense_name(backbone.model) if backbone.head == "sequence_classification" else None
        if name is None:
            raise ConfigError("adapter.tt_classifier", f"the {backbone.model.config.model_type} {backbone.head} "
                              f"model has no hidden x hidden head layer ({', '.join(CLASSIFIER_DENSE_NAMES)})")
        parent_name, _, child = name.rpartition(".")
        parent = backbone.model.get_submodule(parent_name) if parent_name else backbone.model
        dense: nn.Linear = getattr(parent, child)
        layer = self.linear(dense.in_features, dense.out_features)
        layer.requires_grad_(True)
        setattr(parent, child, layer)
