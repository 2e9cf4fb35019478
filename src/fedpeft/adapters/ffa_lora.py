"""FFA-LoRA (Sun et al., ICLR 2024, "Improving LoRA in privacy-preserving federated learning").

LoRA whose A matrices stay frozen at their random initialisation; only B (and the task head)
is trained, averaged and sent. Because A is not trainable it is not part of the exchanged state:
every client and the server build the same A from the run's seed (the adapter is injected right
after ``torch.manual_seed(cfg.seed)``), so A never crosses the network. With A fixed the
server's average of B is the exact average of the clients' B A, which is the method's point.
"""

from __future__ import annotations

from fedpeft.adapters.base import register_adapter
from fedpeft.adapters.lora import LoraAdapter
from fedpeft.config import ConfigError
from fedpeft.models.backbone import Backbone


@register_adapter
class FfaLoraAdapter(LoraAdapter):
    kind = "ffa_lora"

    def inject(self, backbone: Backbone) -> None:
        if self.cfg.init == "svd":
            raise ConfigError("adapter.init", "ffa_lora needs a random A (B = 0); the svd init would freeze "
                                              "the principal part; allowed: kaiming, gaussian")
        super().inject(backbone)
        for name, param in backbone.model.named_parameters():
            if ".lora_A." in name:
                param.requires_grad_(False)
