"""LoRA through HF PEFT: low-rank ``B @ A`` added to frozen target projections.

``init`` selects A's initialisation: ``kaiming`` (PEFT's default, B = 0), ``gaussian``
(A ~ N(0, 1/r), B = 0). Both leave the model's output unchanged at round 0. Other
initialisations (e.g. FeDeRA's SVD) register themselves in :data:`LORA_INITS`.
"""

from __future__ import annotations

from collections.abc import Callable

from peft import LoraConfig, inject_adapter_in_model
from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING

from fedpeft.adapters.base import Adapter, register_adapter
from fedpeft.config import AdapterConfig, ConfigError
from fedpeft.models.backbone import Backbone

LoraInit = Callable[[Backbone, AdapterConfig], None]
PEFT_INITS: dict[str, bool | str] = {"kaiming": True, "gaussian": "gaussian"}
LORA_INITS: dict[str, LoraInit] = {}


def default_target_modules(backbone: Backbone) -> list[str]:
    model_type = backbone.model.config.model_type
    targets = TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.get(model_type)
    if not targets:
        raise ConfigError("adapter.target_modules", f"no default LoRA targets for model type {model_type!r}; set them")
    return list(targets)


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
