"""LoRA through HF PEFT: low-rank ``B @ A`` added to frozen target projections.

``init`` selects A's initialisation: ``kaiming`` (PEFT's default, B = 0), ``gaussian``
(A ~ N(0, 1/r), B = 0). Both leave the model's output unchanged at round 0. Other
initialisations (e.g. FeDeRA's SVD) register themselves in :data:`LORA_INITS`.

Targets: ``adapter.target_modules``, else the attention query and value projections of the
backbone (:func:`default_target_modules`): HF PEFT's table by model type, else the first
attention naming of :data:`ATTENTION_NAMINGS` the model's linear layers all carry (DistilBERT's
``q_lin``/``v_lin``, MPNet's ``q``/``v``, ALBERT, Funnel, ... which PEFT's table lacks).
"""

from __future__ import annotations

from collections.abc import Callable

from peft import LoraConfig, inject_adapter_in_model
from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
from pydantic import BaseModel
from torch import nn
from transformers.pytorch_utils import Conv1D

from fedpeft.adapters.base import Adapter, register_adapter
from fedpeft.config import AdapterConfig, ConfigError
from fedpeft.models.backbone import Backbone

LoraInit = Callable[[Backbone, AdapterConfig], None]
PEFT_INITS: dict[str, bool | str] = {"kaiming": True, "gaussian": "gaussian"}
LORA_INITS: dict[str, LoraInit] = {}
LORA_INIT_OPTIONS: dict[str, type[BaseModel]] = {}  # the extra ``adapter.*`` fields an init reads


ATTENTION_NAMINGS: tuple[tuple[str, ...], ...] = (
    ("query", "value"),  # BERT, RoBERTa, ALBERT, ELECTRA, ERNIE, Longformer, BigBird, MiniLM, ...
    ("query_proj", "value_proj"),  # DeBERTa-v2/v3
    ("q_proj", "v_proj"),  # BART, LLaMA, OPT, Mistral, Qwen, ...
    ("q_lin", "v_lin"),  # DistilBERT
    ("q_head", "v_head"),  # Funnel
    ("q", "v"),  # T5, MPNet
    ("c_attn",),  # GPT-2 (fused q/k/v)
    ("in_proj",),  # DeBERTa v1 (fused)
    ("query_key_value",),  # GPT-NeoX, BLOOM, Falcon (fused)
    ("Wqkv",),  # ModernBERT (fused)
    ("qkv_proj",),  # Phi-3 (fused)
)
"""Names of the attention query/value projections by model family, tried in this order."""


def default_target_modules(backbone: Backbone) -> list[str]:
    """Query/value projections: PEFT's table by model type, else the first of :data:`ATTENTION_NAMINGS`
    whose names are all linear layers of the model."""
    model_type = backbone.model.config.model_type
    targets = TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.get(model_type)
    if targets:
        return list(targets)
    linear = {name.rsplit(".", 1)[-1] for name, module in backbone.model.named_modules()
              if isinstance(module, nn.Linear | Conv1D)}
    for naming in ATTENTION_NAMINGS:
        if linear.issuperset(naming):
            return list(naming)
    raise ConfigError("adapter.target_modules", f"no known attention projection names in model type {model_type!r}; "
                      "set adapter.target_modules (e.g. [query, value])")


def lora_config(cfg: AdapterConfig, backbone: Backbone) -> LoraConfig:
    init = PEFT_INITS.get(cfg.init, True)
    return LoraConfig(
        r=cfg.r,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.dropout,
        target_modules=cfg.target_modules or default_target_modules(backbone),
        init_lora_weights=init,
    )


@register_adapter
class LoraAdapter(Adapter):
    kind = "lora"

    @classmethod
    def option_models(cls, cfg: AdapterConfig) -> tuple[type[BaseModel], ...]:
        return (LORA_INIT_OPTIONS[cfg.init],) if cfg.init in LORA_INIT_OPTIONS else ()

    def inject(self, backbone: Backbone) -> None:
        allowed = sorted({*PEFT_INITS, *LORA_INITS})
        if self.cfg.init not in allowed:
            raise ConfigError("adapter.init", f"unknown LoRA init {self.cfg.init!r}; allowed: {', '.join(allowed)}")
        try:
            inject_adapter_in_model(lora_config(self.cfg, backbone), backbone.model)
        except ValueError as err:
            raise ConfigError("adapter.target_modules", str(err)) from err
        for name, param in backbone.model.named_parameters():
            if ".lora_" in name:
                param.requires_grad_(True)
        if self.cfg.init in LORA_INITS:
            LORA_INITS[self.cfg.init](backbone, self.cfg)
