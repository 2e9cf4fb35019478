"""Full fine-tuning: every parameter of the backbone is trained and exchanged."""

from __future__ import annotations

from fedpeft.adapters.base import Adapter, register_adapter
from fedpeft.models.backbone import Backbone


@register_adapter
class FullFineTuning(Adapter):
    kind = "full"

    def inject(self, backbone: Backbone) -> None:
        for param in backbone.model.parameters():
            param.requires_grad_(True)
