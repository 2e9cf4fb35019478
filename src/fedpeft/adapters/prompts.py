"""Soft prompts: ``prompt_tuning`` (an input soft prompt) and ``p_tuning_v2`` (deep prompts in every layer).

**prompt_tuning** (Lester et al., 2021): T trainable vectors are prepended to the input word
embeddings; the backbone is frozen. Initialised from the embeddings of T vocabulary tokens drawn
at random (Lester et al.'s "sampled vocabulary" init, their best) or N(0, initializer_range^2).

**p_tuning_v2** (Liu et al., 2022; the deep prompts FedPepTAO builds on): trainable prefix keys
and values of length T in the self-attention of every layer, no reparameterisation MLP, dropout on
the prefix. P-tuning v2 and FedPepTAO's released code store them as one ``Embedding(T, L*2*H)``
(H = key/value width of a layer); here layer l's column block ``[2lH, (2l+2)H)`` is its own
parameter ``prefix_encoder.layers.<l>`` of shape (T, 2H) (keys then values), so that layers can be
exchanged one by one as separate keys. :meth:`PrefixEncoder.embedding_weight` rebuilds the single
``(T, L*2*H)`` table. Init N(0, 1), the default of ``nn.Embedding`` that both codes use.

Injection goes through the model's own cache interface, which transformers 5 shares across
BERT/RoBERTa (encoders) and GPT-2/LLaMA (decoders): a forward pre-hook builds a ``DynamicCache``
already holding the prefix of every layer and extends the 2-D attention mask by T ones, so every
query also attends to the T prefix positions (checked against a hand-written attention in the
tests). As in P-tuning v2, the real tokens' positions start after the prefix. We do not use HF
PEFT's prefix tuning: it wraps the model in a ``PeftModel`` (renaming every parameter) for the same
cache mechanism. Encoder-decoder models (T5, BART) would need prefixes in three attention kinds
and are rejected with a clear error; ``prompt_tuning`` works with them.

Both adapters register their module on the top-level model (stable parameter names) and hook the
"language model" inside a verbalizer wrapper when there is one (see :mod:`fedpeft.models.verbalizer`).
The input soft prompt shifts every token by T places: per-token targets (token labels, QA start/end
positions) are shifted with them and per-token outputs are cut back to the real tokens, so token
classification and QA heads see the prompt only through attention.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from torch import nn
from transformers import DynamicCache

from fedpeft.adapters.base import Adapter, register_adapter
from fedpeft.config import AdapterConfig, ConfigError
from fedpeft.models.backbone import Backbone

PREFIX_MODULE = "prefix_encoder"
PROMPT_MODULE = "prompt_encoder"
IGNORE_INDEX = -100
SPAN_POSITIONS = ("start_positions", "end_positions")
SPAN_LOGITS = ("start_logits", "end_logits")


class _PromptOptions(BaseModel):
    """Extra ``adapter.*`` fields of the prompt adapters."""

    model_config = ConfigDict(extra="ignore")

    num_virtual_tokens: int = Field(20, gt=0)
    prompt_init: str = "vocab"
    prefix_init_std: float = Field(1.0, gt=0)


def _options(cfg: AdapterConfig) -> _PromptOptions:
    try:
        options = _PromptOptions.model_validate(cfg.model_extra or {})
    except ValidationError as err:
        first = err.errors()[0]
        raise ConfigError(f"adapter.{first['loc'][0]}", first["msg"]) from None
    if options.prompt_init not in ("vocab", "normal"):
        raise ConfigError("adapter.prompt_init", f"unknown init {options.prompt_init!r}; allowed: normal, vocab")
    return options


def language_model(model: nn.Module) -> nn.Module:
    """The module whose forward takes ``input_ids`` (the MLM inside a verbalizer wrapper, else the model)."""
    return getattr(model, "language_model", model)


def cache_keyword(model: nn.Module) -> str:
    """The keyword ``model``'s forward takes a key/value cache by: ``cache`` in transformers >= 5.2x
    (where ``past_key_values`` is deprecated, to be removed in 5.40), ``past_key_values`` before.
    A forward that names neither (a task head passing ``**kwargs`` on) is answered by its backbone."""
    seen: set[int] = set()
    while id(model) not in seen:
        seen.add(id(model))
        parameters = inspect.signature(model.forward).parameters
        for name in ("cache", "past_key_values"):
            if name in parameters:
                return name
        model = getattr(model, "base_model", model)
    return "past_key_values"


def kv_geometry(config: Any) -> tuple[int, int, int]:
    """(layers, key/value heads, head dim) of a decoder or encoder config (GQA-aware)."""
    layers = config.num_hidden_layers
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return layers, kv_heads, head_dim


class PrefixEncoder(nn.Module):
    """Deep prompts: per layer a (T, 2 * kv_heads * head_dim) table of prefix keys and values."""

    def __init__(self, num_layers: int, num_tokens: int, kv_heads: int, head_dim: int, dropout: float,
                 init_std: float) -> None:
        super().__init__()
        self.num_tokens, self.kv_heads, self.head_dim = num_tokens, kv_heads, head_dim
        width = 2 * kv_heads * head_dim
        self.layers = nn.ParameterList(
            [nn.Parameter(torch.randn(num_tokens, width) * init_std) for _ in range(num_layers)]
        )
        self.dropout = nn.Dropout(dropout)
        self.enabled = True

    def embedding_weight(self) -> torch.Tensor:
        """The equivalent ``Embedding(T, L*2*H)`` weight of P-tuning v2 / the released code."""
        return torch.cat(list(self.layers), dim=1)

    def cache(self, batch_size: int) -> DynamicCache:
        """A cache holding every layer's prefix keys/values, shape (B, kv_heads, T, head_dim) each."""
        cache = DynamicCache()
        width = self.kv_heads * self.head_dim
        for index, table in enumerate(self.layers):
            table = self.dropout(table)
            keys, values = table[:, :width], table[:, width:]
            cache.update(self._heads(keys, batch_size), self._heads(values, batch_size), index)
        return cache

    def _heads(self, flat: torch.Tensor, batch_size: int) -> torch.Tensor:
        per_head = flat.view(self.num_tokens, self.kv_heads, self.head_dim).transpose(0, 1)
        return per_head.unsqueeze(0).expand(batch_size, -1, -1, -1)


class SoftPrompt(nn.Module):
    """An input soft prompt of T embedding vectors."""

    def __init__(self, init: torch.Tensor) -> None:
        super().__init__()
        self.embedding = nn.Parameter(init.clone())
        self.enabled = True

    @property
    def num_tokens(self) -> int:
        return self.embedding.shape[0]


def _kwargs_with_inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    kwargs = dict(kwargs)
    if args:
        kwargs["input_ids"] = args[0]
    if len(args) > 1:
        raise TypeError("prompt adapters need keyword arguments after input_ids")
    return kwargs


def _extend_mask(mask: torch.Tensor | None, batch: int, length: int, extra: int, device: torch.device) -> torch.Tensor:
    if mask is None:
        mask = torch.ones(batch, length, dtype=torch.long, device=device)
    return torch.cat([torch.ones(batch, extra, dtype=mask.dtype, device=mask.device), mask], dim=1)


def _prefix_hook(prefix: PrefixEncoder, keyword: str):
    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[()], dict[str, Any]]:
        kwargs = _kwargs_with_inputs(args, kwargs)
        if not prefix.enabled:
            return (), kwargs
        if kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None:
            raise ValueError("p_tuning_v2 supplies the key/value cache itself; do not pass one")
        reference = kwargs.get("input_ids")
        if reference is None:
            reference = kwargs["inputs_embeds"]
        batch, length = reference.shape[:2]
        kwargs[keyword] = prefix.cache(batch)
        kwargs["attention_mask"] = _extend_mask(kwargs.get("attention_mask"), batch, length, prefix.num_tokens,
                                                reference.device)
        return (), kwargs

    return hook


def _soft_prompt_hooks(prompt: SoftPrompt, embeddings: nn.Module, left_align: bool):
    """Pre-hook prepending the prompt to the input embeddings; post-hook dropping its logits."""

    def pre_hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[()], dict[str, Any]]:
        kwargs = _kwargs_with_inputs(args, kwargs)
        if not prompt.enabled:
            return (), kwargs
        input_ids = kwargs.pop("input_ids", None)
        embeds = kwargs.pop("inputs_embeds", None)
        if embeds is None:
            embeds = embeddings(input_ids)
        batch, length = embeds.shape[:2]
        n = prompt.num_tokens
        embeds = torch.cat([prompt.embedding.unsqueeze(0).expand(batch, -1, -1).to(embeds.dtype), embeds], dim=1)
        mask = _extend_mask(kwargs.get("attention_mask"), batch, length, n, embeds.device)
        if kwargs.get("token_type_ids") is not None:
            types = kwargs["token_type_ids"]
            kwargs["token_type_ids"] = torch.cat([types.new_zeros(batch, n), types], dim=1)
        labels = kwargs.get("labels")
        if labels is not None and labels.dim() == 2:  # token-level labels (causal LM, NER): prompt positions ignored
            kwargs["labels"] = torch.cat([labels.new_full((batch, n), IGNORE_INDEX), labels], dim=1)
        for key in SPAN_POSITIONS:  # QA targets index tokens, which now sit n places later
            if kwargs.get(key) is not None:
                kwargs[key] = kwargs[key] + n
        if left_align:
            embeds, mask, kwargs["position_ids"] = _left_align(embeds, mask)
        kwargs["inputs_embeds"] = embeds
        kwargs["attention_mask"] = mask
        return (), kwargs

    def post_hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        if not prompt.enabled:
            return output
        logits = getattr(output, "logits", None)
        if logits is not None and logits.dim() == 3:
            output.logits = logits[:, prompt.num_tokens :]
        for key in SPAN_LOGITS:
            if getattr(output, key, None) is not None:
                setattr(output, key, getattr(output, key)[:, prompt.num_tokens :])
        return output

    return pre_hook, post_hook


def _left_align(embeds: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Move padding to the left so a decoder's classification head (which reads the last position
    when it only sees embeddings) reads each row's last real token; positions count real tokens."""
    order = torch.argsort(mask.to(torch.int64), dim=1, stable=True)  # zeros (padding) first, order kept
    embeds = embeds.gather(1, order.unsqueeze(-1).expand_as(embeds))
    mask = mask.gather(1, order)
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    return embeds, mask, positions


@contextmanager
def prompts_disabled(model: nn.Module) -> Iterator[None]:
    """Run ``model`` as if it had no prompts (FedPepTAO scores layers without them)."""
    modules = [m for m in model.modules() if isinstance(m, PrefixEncoder | SoftPrompt)]
    states = [m.enabled for m in modules]
    for m in modules:
        m.enabled = False
    try:
        yield
    finally:
        for m, state in zip(modules, states):
            m.enabled = state


def prefix_layer_keys(model: nn.Module) -> list[str]:
    """Parameter names of the deep prompts, layer 0 first (the units FedPepTAO exchanges)."""
    prefix = getattr(model, PREFIX_MODULE, None)
    if not isinstance(prefix, PrefixEncoder):
        raise ConfigError("adapter.kind", "this method needs deep prompts (adapter.kind: p_tuning_v2)")
    return [f"{PREFIX_MODULE}.layers.{i}" for i in range(len(prefix.layers))]


@register_adapter
class PTuningV2Adapter(Adapter):
    """Deep prompts (prefix keys/values) in every self-attention layer; ``adapter.dropout`` on the prefix."""

    kind = "p_tuning_v2"
    adapter_options = (_PromptOptions,)

    def __init__(self, cfg: AdapterConfig) -> None:
        super().__init__(cfg)
        self.options = _options(cfg)

    def inject(self, backbone: Backbone) -> None:
        if backbone.architecture == "encoder_decoder":
            raise ConfigError("adapter.kind", "p_tuning_v2 supports encoder and decoder models, not encoder-decoder "
                                              "(T5/BART); use prompt_tuning or lora there")
        host = language_model(backbone.model)
        layers, kv_heads, head_dim = kv_geometry(host.config)
        prefix = PrefixEncoder(layers, self.options.num_virtual_tokens, kv_heads, head_dim, self.cfg.dropout,
                               self.options.prefix_init_std)
        backbone.model.add_module(PREFIX_MODULE, prefix)
        host.register_forward_pre_hook(_prefix_hook(prefix, cache_keyword(host)), with_kwargs=True)


@register_adapter
class PromptTuningAdapter(Adapter):
    """An input soft prompt of ``adapter.num_virtual_tokens`` vectors (init ``adapter.prompt_init``)."""

    kind = "prompt_tuning"
    adapter_options = (_PromptOptions,)

    def __init__(self, cfg: AdapterConfig) -> None:
        super().__init__(cfg)
        self.options = _options(cfg)

    def inject(self, backbone: Backbone) -> None:
        host = language_model(backbone.model)
        embeddings = host.get_input_embeddings()
        n = self.options.num_virtual_tokens
        if self.options.prompt_init == "vocab":
            token_ids = torch.randint(0, embeddings.weight.shape[0], (n,))
            init = embeddings.weight.detach()[token_ids]
        else:
            std = getattr(host.config, "initializer_range", 0.02)
            init = torch.randn(n, embeddings.weight.shape[1]) * std
        prompt = SoftPrompt(init)
        backbone.model.add_module(PROMPT_MODULE, prompt)
        left_align = backbone.architecture == "decoder" and backbone.head == "sequence_classification"
        pre_hook, post_hook = _soft_prompt_hooks(prompt, embeddings, left_align)
        host.register_forward_pre_hook(pre_hook, with_kwargs=True)
        host.register_forward_hook(post_hook, with_kwargs=True)
