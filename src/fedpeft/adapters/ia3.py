"""(IA)^3 (Liu et al., NeurIPS 2022) through HF PEFT: learned vectors rescale keys, values and FFN.

``adapter.target_modules`` / ``adapter.feedforward_modules`` default to PEFT's per-architecture
mapping (BERT: key, value, output.dense; output.dense counted as feed-forward, so its input is
rescaled). The vectors start at 1, so the model's output is unchanged at round 0.
"""

from __future__ import annotations

from peft import IA3Config, inject_adapter_in_model
from peft.utils import (
    TRANSFORMERS_MODELS_TO_IA3_FEEDFORWARD_MODULES_MAPPING,
    TRANSFORMERS_MODELS_TO_IA3_TARGET_MODULES_MAPPING,
)
from pydantic import BaseModel, ConfigDict, ValidationError

from fedpeft.adapters.base import Adapter, register_adapter
from fedpeft.config import AdapterConfig, ConfigError
from fedpeft.models.backbone import Backbone


class Ia3Options(BaseModel):
    model_config = ConfigDict(extra="ignore")

    feedforward_modules: list[str] | None = None


def ia3_config(cfg: AdapterConfig, backbone: Backbone) -> IA3Config:
    """PEFT's IA3 config for ``adapter.*`` on ``backbone`` (also what a PEFT export records)."""
    try:
        options = Ia3Options.model_validate(cfg.model_dump())
    except ValidationError as err:
        raise ConfigError("adapter.feedforward_modules", err.errors()[0]["msg"]) from None
    model_type = backbone.model.config.model_type
    targets = cfg.target_modules or TRANSFORMERS_MODELS_TO_IA3_TARGET_MODULES_MAPPING.get(model_type)
    if not targets:
        raise ConfigError("adapter.target_modules", f"no default IA3 targets for model type {model_type!r}; set them")
    feedforward = options.feedforward_modules
    if feedforward is None:
        default_ff = TRANSFORMERS_MODELS_TO_IA3_FEEDFORWARD_MODULES_MAPPING.get(model_type, [])
        feedforward = [m for m in default_ff if m in targets]
    return IA3Config(target_modules=list(targets), feedforward_modules=list(feedforward))


@register_adapter
class Ia3Adapter(Adapter):
    kind = "ia3"
    adapter_options = (Ia3Options,)

    def inject(self, backbone: Backbone) -> None:
        try:
            inject_adapter_in_model(ia3_config(self.cfg, backbone), backbone.model)
        except ValueError as err:
            raise ConfigError("adapter.target_modules", str(err)) from err
        for name, param in backbone.model.named_parameters():
            if ".ia3_l" in name:
                param.requires_grad_(True)
