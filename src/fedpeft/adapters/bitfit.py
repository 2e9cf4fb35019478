"""BitFit (Ben Zaken et al., ACL 2022): train only the bias terms of the backbone.

Every parameter named ``*.bias`` is trainable (attention q/k/v and output, FFN, and LayerNorm
biases, as in the paper), plus the task head when ``adapter.train_head``. FeDeRA's FedBF baseline.
"""

from __future__ import annotations

from fedpeft.adapters.base import Adapter, head_parameters, register_adapter
from fedpeft.config import ConfigError
from fedpeft.models.backbone import Backbone


@register_adapter
class BitFitAdapter(Adapter):
    kind = "bitfit"

    def inject(self, backbone: Backbone) -> None:
        head = {name for name, _ in head_parameters(backbone)}
        biases = [p for n, p in backbone.model.named_parameters() if n.endswith(".bias") and n not in head]
        if not biases:
            raise ConfigError("adapter.kind", f"bitfit: model {backbone.name!r} has no bias terms to train")
        for param in biases:
            param.requires_grad_(True)
