"""Soft prompts: exact prefix/prompt math on tiny models, the Embedding(T, L*2*H) layout, learning, errors."""

from __future__ import annotations

import inspect
import math
import warnings
from pathlib import Path

import pytest
import torch

from fedpeft.adapters import build_adapter
from fedpeft.adapters.base import trainable_names
from fedpeft.adapters.prompts import PREFIX_MODULE, PROMPT_MODULE, cache_keyword, prefix_layer_keys, prompts_disabled
from fedpeft.config import AdapterConfig, ConfigError, ModelConfig, build_config
from fedpeft.data.types import TaskData
from fedpeft.engines.local import LocalEngine
from fedpeft.experiment import prepare
from fedpeft.models.backbone import Backbone, load_backbone
from tests.conftest import tiny_raw_config

TASK = TaskData("toy", "classification", ("neg", "pos"), ("accuracy",))


def backbone_with(kind: str, name: str = "tiny-bert", head: str = "auto", layers: int = 2, attn: str | None = None,
                  **extra: object) -> Backbone:
    backbone = load_backbone(ModelConfig(name=name, head=head, tiny_layers=layers, attn_implementation=attn), TASK, 0)
    torch.manual_seed(0)
    build_adapter(AdapterConfig(kind=kind, **extra)).apply(backbone)
    backbone.model.eval()
    return backbone


def batch(length: int = 6, pad_row_from: int = 4) -> dict[str, torch.Tensor]:
    ids = torch.randint(1000, 2000, (2, length))
    mask = torch.ones(2, length, dtype=torch.long)
    mask[1, pad_row_from:] = 0
    ids[1, pad_row_from:] = 0
    return {"input_ids": ids, "attention_mask": mask}


@pytest.mark.parametrize("name,attn", [("tiny-bert", "eager"), ("tiny-bert", "sdpa"), ("tiny-roberta", "sdpa")])
def test_prefix_attention_matches_hand_computation(name: str, attn: str) -> None:
    """softmax(Q [P_k; K]^T / sqrt(d) + mask) [P_v; V] in layer 0, padding masked, prefix always visible."""
    backbone = backbone_with("p_tuning_v2", name, layers=1, attn=attn, num_virtual_tokens=3)
    model = backbone.model
    encoder = model.bert if name == "tiny-bert" else model.roberta
    attention = encoder.encoder.layer[0].attention.self
    seen: dict[str, torch.Tensor] = {}
    attention.register_forward_hook(
        lambda mod, args, kwargs, out: seen.update(h=kwargs.get("hidden_states", args[0] if args else None),
                                                   out=out[0]), with_kwargs=True)
    inputs = batch()
    with torch.no_grad():
        model(**inputs)
        h = seen["h"]
        b, s, _ = h.shape
        heads, head_dim = attention.num_attention_heads, attention.attention_head_size
        table = getattr(model, PREFIX_MODULE).layers[0]
        width = heads * head_dim

        def split(x: torch.Tensor) -> torch.Tensor:
            return x.view(x.shape[0], -1, heads, head_dim).transpose(1, 2)

        prefix_k = split(table[:, :width].unsqueeze(0).expand(b, -1, -1))
        prefix_v = split(table[:, width:].unsqueeze(0).expand(b, -1, -1))
        q = split(attention.query(h))
        k = torch.cat([prefix_k, split(attention.key(h))], dim=2)
        v = torch.cat([prefix_v, split(attention.value(h))], dim=2)
        scores = q @ k.transpose(-1, -2) / math.sqrt(head_dim)
        keep = torch.cat([torch.ones(b, 3), inputs["attention_mask"].float()], dim=1)
        scores = scores.masked_fill(keep[:, None, None, :] == 0, float("-inf"))
        expected = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, -1)
    assert torch.allclose(seen["out"], expected, atol=1e-5)


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama"])
def test_decoder_prefix_equals_a_real_key_value_cache(name: str) -> None:
    """Deep prompts set to the keys/values a decoder caches for tokens x1 reproduce the run on [x1; x2]."""
    backbone = backbone_with("p_tuning_v2", name, head="causal_lm", num_virtual_tokens=4, dropout=0.0)
    model = backbone.model
    ids = torch.randint(1000, 2000, (1, 9))
    prefix = getattr(model, PREFIX_MODULE)
    with torch.no_grad(), prompts_disabled(model):
        full = model(input_ids=ids, use_cache=True)
    cache = full.past_key_values
    with torch.no_grad():
        for layer, table in enumerate(prefix.layers):
            keys, values = cache.layers[layer].keys[0, :, :4], cache.layers[layer].values[0, :, :4]
            table.copy_(torch.cat([keys.transpose(0, 1).reshape(4, -1), values.transpose(0, 1).reshape(4, -1)], 1))
        tail = model(input_ids=ids[:, 4:]).logits
    assert torch.allclose(tail, full.logits[:, 4:], atol=1e-4)


@pytest.mark.parametrize("name,head", [("tiny-bert", "auto"), ("tiny-roberta", "auto"), ("tiny-llama", "causal_lm")])
def test_deep_prompts_use_the_cache_keyword_the_installed_transformers_takes(name: str, head: str) -> None:
    """transformers 5.2x renamed ``past_key_values`` to ``cache`` (the old name warns, and goes in 5.40):
    the prefix is passed by whichever name the backbone's forward declares, with no deprecation warning."""
    backbone = backbone_with("p_tuning_v2", name, head=head, num_virtual_tokens=3)
    inner = backbone.model.base_model
    declared = [k for k in ("cache", "past_key_values") if k in inspect.signature(inner.forward).parameters]
    assert cache_keyword(backbone.model) == declared[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        inputs = batch()
        with torch.no_grad():
            with_prompt = backbone.model(**inputs).logits
            with prompts_disabled(backbone.model):
                without = backbone.model(**inputs).logits
    assert not torch.allclose(with_prompt, without)


def test_cache_keyword_asks_the_backbone_when_the_head_names_neither() -> None:
    class Old(torch.nn.Module):
        def forward(self, input_ids: torch.Tensor, past_key_values: object = None) -> None: ...

    class New(torch.nn.Module):
        def forward(self, input_ids: torch.Tensor, cache: object = None) -> None: ...

    class Head(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.base_model = inner

        def forward(self, input_ids: torch.Tensor, **kwargs: object) -> None: ...

    assert cache_keyword(Old()) == "past_key_values"
    assert cache_keyword(Head(New())) == "cache"
    assert cache_keyword(Head(Old())) == "past_key_values"


def test_prefix_cache_is_the_embedding_table_of_p_tuning_v2() -> None:
    """P-tuning v2 views Embedding(T, L*2*H) as (T, 2L, heads, head_dim); layer l = rows 2l (keys), 2l+1 (values)."""
    backbone = backbone_with("p_tuning_v2", layers=3, num_virtual_tokens=5, dropout=0.0)
    prefix = getattr(backbone.model, PREFIX_MODULE)
    weight = prefix.embedding_weight()
    assert weight.shape == (5, 3 * 2 * 32)
    heads, head_dim = 4, 8
    reference = weight.view(5, 3 * 2, heads, head_dim).permute(1, 2, 0, 3)  # (2L, heads, T, head_dim)
    cache = prefix.cache(batch_size=2)
    for layer in range(3):
        assert torch.equal(cache.layers[layer].keys[1], reference[2 * layer])
        assert torch.equal(cache.layers[layer].values[1], reference[2 * layer + 1])
    assert prefix_layer_keys(backbone.model) == [f"{PREFIX_MODULE}.layers.{i}" for i in range(3)]


def test_only_prompts_and_head_are_trainable() -> None:
    deep = backbone_with("p_tuning_v2")
    assert sorted(trainable_names(deep.model)) == sorted(
        [*prefix_layer_keys(deep.model), "classifier.weight", "classifier.bias"])
    shallow = backbone_with("prompt_tuning")
    assert sorted(trainable_names(shallow.model)) == sorted(
        [f"{PROMPT_MODULE}.embedding", "classifier.weight", "classifier.bias"])


def test_soft_prompt_is_prepended_to_the_input_embeddings() -> None:
    backbone = backbone_with("prompt_tuning", num_virtual_tokens=3)
    model = backbone.model
    inputs = batch()
    with torch.no_grad():
        hooked = model(**inputs).logits
        prompt = getattr(model, PROMPT_MODULE).embedding
        embeds = torch.cat([prompt.expand(2, -1, -1), model.get_input_embeddings()(inputs["input_ids"])], dim=1)
        mask = torch.cat([torch.ones(2, 3, dtype=torch.long), inputs["attention_mask"]], dim=1)
        with prompts_disabled(model):
            manual = model(inputs_embeds=embeds, attention_mask=mask).logits
    assert torch.allclose(hooked, manual, atol=1e-6)


def test_soft_prompt_on_a_decoder_reads_each_rows_last_real_token() -> None:
    """GPT-2's classifier reads the last position of embeddings: padded rows must give the unpadded result."""
    backbone = backbone_with("prompt_tuning", "tiny-gpt2", num_virtual_tokens=2)
    model = backbone.model
    inputs = batch(length=6, pad_row_from=4)
    with torch.no_grad():
        both = model(**inputs).logits
        alone = model(input_ids=inputs["input_ids"][1:, :4], attention_mask=inputs["attention_mask"][1:, :4]).logits
    assert torch.allclose(both[1], alone[0], atol=1e-5)


def test_soft_prompt_causal_lm_logits_and_loss_align_with_the_labels() -> None:
    backbone = backbone_with("prompt_tuning", "tiny-llama", head="causal_lm", num_virtual_tokens=3)
    ids = torch.randint(1000, 2000, (2, 5))
    labels = ids.clone()
    labels[:, 0] = -100  # as in our generative batches: only target tokens carry labels
    out = backbone.model(input_ids=ids, labels=labels)
    assert out.logits.shape[:2] == (2, 5)
    shift = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, out.logits.shape[-1]),
                                              ids[:, 1:].reshape(-1))
    assert torch.allclose(out.loss, shift, atol=1e-5)


def test_bad_prompt_config_names_the_field() -> None:
    with pytest.raises(ConfigError, match=r"adapter\.num_virtual_tokens"):
        build_adapter(AdapterConfig(kind="p_tuning_v2", num_virtual_tokens=0))
    with pytest.raises(ConfigError, match=r"adapter\.prompt_init"):
        build_adapter(AdapterConfig(kind="prompt_tuning", prompt_init="zeros"))
    backbone = load_backbone(ModelConfig(name="tiny-t5"), TASK, 0)
    with pytest.raises(ConfigError, match=r"adapter\.kind.*encoder-decoder"):
        build_adapter(AdapterConfig(kind="p_tuning_v2")).apply(backbone)


def learnable_experiment(raw: dict) -> LocalEngine:
    """A tiny BERT (hidden 64) with its own dropout off: frozen random features plus a few prompt vectors
    learn the toy task in a handful of rounds (with dropout on, the noise of a random backbone dominates)."""
    exp = prepare(build_config(raw))
    for module in exp.backbone.model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return LocalEngine(exp, Path(raw["output"]["run_dir"]))


def learning_config(train: Path, eval_: Path, run_dir: Path, method: str, model: dict | None = None,
                    **sections: object) -> dict:
    raw = tiny_raw_config(train, eval_, run_dir, method=method, rounds=4,
                          model={"tiny_hidden_size": 64, **(model or {})},
                          partition={"num_clients": 2}, strategy={"clients_per_round": 2},
                          client={"optimizer": "adamw", "lr": 0.05, "local_epochs": 3}, **sections)
    raw["adapter"] = {"kind": RECIPE_ADAPTERS.get(method, method), "num_virtual_tokens": 4, "dropout": 0.0}
    return raw


RECIPE_ADAPTERS = {"fedpeptao": "p_tuning_v2"}


@pytest.mark.parametrize("method", ["p_tuning_v2", "prompt_tuning"])
def test_prompt_recipes_learn_the_toy_task(toy_files: tuple[Path, Path], tmp_path: Path, method: str) -> None:
    train, eval_ = toy_files
    records = learnable_experiment(learning_config(train, eval_, tmp_path / "run", method)).run()
    accuracies = [r["eval"]["accuracy"] for r in records]
    assert records[-1]["train_loss"] < 0.6 * records[0]["train_loss"]
    assert accuracies[-1] >= 0.75, accuracies  # chance is 0.5 on 64 balanced examples
