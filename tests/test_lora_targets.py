"""Default LoRA targets: the attention query/value projections of every backbone family, on tiny
random configs (DistilBERT, MPNet, ALBERT, Funnel are missing from PEFT's table)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from peft.tuners.lora import LoraLayer
from transformers import AutoConfig, AutoModelForSequenceClassification

from fedpeft.adapters.base import build_adapter
from fedpeft.adapters.lora import default_target_modules
from fedpeft.config import AdapterConfig, ConfigError
from fedpeft.models.backbone import Backbone

pytestmark = pytest.mark.usefixtures("single_torch_thread")

SMALL = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64}
CASES: dict[str, tuple[dict[str, Any], list[str]]] = {
    "distilbert": ({"dim": 32, "n_layers": 2, "n_heads": 4, "hidden_dim": 64}, ["q_lin", "v_lin"]),
    "mpnet": (SMALL, ["q", "v"]),
    "albert": ({**SMALL, "embedding_size": 16}, ["query", "value"]),
    "funnel": ({"d_model": 32, "n_head": 4, "d_head": 8, "d_inner": 64, "block_sizes": [1, 1]}, ["q_head", "v_head"]),
    "deberta-v2": (SMALL, ["query_proj", "value_proj"]),
    "bert": (SMALL, ["query", "value"]),
    "gpt2": ({"n_embd": 32, "n_layer": 2, "n_head": 4}, ["c_attn"]),
    "t5": ({"d_model": 32, "d_kv": 8, "d_ff": 64, "num_layers": 2, "num_heads": 4}, ["q", "v"]),
}


def tiny_backbone(model_type: str, sizes: dict[str, Any]) -> Backbone:
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, vocab_size=100, pad_token_id=0, num_labels=3, **sizes)
    model = AutoModelForSequenceClassification.from_config(config)
    return Backbone(model=model, tokenizer=None, architecture="encoder", head="sequence_classification",  # type: ignore[arg-type]
                    name=f"tiny-{model_type}")


@pytest.mark.parametrize("model_type", sorted(CASES))
def test_default_targets_are_query_and_value(model_type: str) -> None:
    sizes, expected = CASES[model_type]
    backbone = tiny_backbone(model_type, sizes)
    assert default_target_modules(backbone) == expected
    build_adapter(AdapterConfig(kind="lora", r=2, init="kaiming")).apply(backbone)
    wrapped = sorted({name.rsplit(".", 1)[-1] for name, module in backbone.model.named_modules()
                      if isinstance(module, LoraLayer)})
    assert wrapped == sorted(expected)


@pytest.mark.parametrize("model_type", ["distilbert", "mpnet"])
def test_svd_init_on_default_targets_keeps_the_output(model_type: str) -> None:
    """FeDeRA with no target_modules on DistilBERT/MPNet: every q/v is initialised, logits unchanged."""
    sizes, expected = CASES[model_type]
    backbone = tiny_backbone(model_type, sizes)
    backbone.model.eval()
    ids = torch.randint(1, 100, (3, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = backbone.model(input_ids=ids).logits
    build_adapter(AdapterConfig(kind="lora", r=2, init="svd")).apply(backbone)
    layers = [m for m in backbone.model.modules() if isinstance(m, LoraLayer)]
    assert len(layers) == 2 * len(expected) and all(m.lora_B["default"].weight.abs().sum() > 0 for m in layers)
    with torch.no_grad():
        after = backbone.model(input_ids=ids).logits
    torch.testing.assert_close(after, before, atol=1e-5, rtol=1e-5)


def test_unknown_attention_naming_asks_for_targets() -> None:
    backbone = tiny_backbone("xlnet", {"d_model": 32, "n_layer": 2, "n_head": 4, "d_inner": 64})
    with pytest.raises(ConfigError, match=r"adapter\.target_modules"):
        default_target_modules(backbone)
