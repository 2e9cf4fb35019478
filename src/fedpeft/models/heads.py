"""Attention heads of a ``transformers`` model: find them, score them, and really remove them.

Used by head pruning ("Assortment of Attention Heads", ``papers/003``, Sec. 3.1), but nothing
here is federated:

- :func:`find_head_sites` lists every multi-head attention block (encoder and decoder
  self-attention, encoder-decoder cross-attention) with its query/key/value projections (whose
  output features belong to heads) and its output projection (whose input features do).
- :func:`head_confidence` is Voita et al.'s confidence (the paper's Eq. 6): per head, the mean
  over query tokens of the maximum attention weight, end tokens and padding excluded;
  :func:`head_importance` averages it over a client's data in a no-grad pass.
- :func:`pruned_heads` removes heads for the duration of a ``with`` block by slicing the
  projections, so the matrix products (and the FLOPs ``FlopCounterMode`` counts) really shrink.
  transformers 5.x dropped ``head_mask`` and ``prune_heads``, hence our own slicing.
  :func:`masked_heads` is the reference semantics (head outputs zeroed, nothing saved) that tests
  compare it with.

Supported families: BERT/RoBERTa-style (``query``/``key``/``value`` + ``output.dense``), T5
(``q``/``k``/``v``/``o`` with relative position bias), BART/LLaMA-style (``q_proj``/``k_proj``/
``v_proj`` + ``out_proj``/``o_proj``; no grouped-query attention) and GPT-2 (fused ``c_attn`` +
``c_proj``). A projection may be a plain ``nn.Linear``, a GPT-2 ``Conv1D`` or a HF PEFT LoRA layer
around either.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from peft.tuners.lora.layer import LoraLayer
from torch import nn
from transformers.pytorch_utils import Conv1D

from fedpeft.config import ConfigError
from fedpeft.models.encoding import model_inputs

Family = Literal["bert", "t5", "bart", "gpt2"]
Stream = Literal["input", "decoder"]
EndTokenExclusion = Literal["both", "keys", "queries", "none"]


@dataclass(frozen=True)
class HeadSite:
    """One multi-head attention block and the projections whose features belong to its heads.

    ``streams`` names the token sequences of the queries and of the keys: ``input`` (the
    encoder's or a decoder-only model's tokens) or ``decoder`` (an encoder-decoder's decoder
    tokens). For GPT-2 the single ``in_projections`` entry is the fused ``c_attn`` whose outputs
    are ``[q | k | v]``, each ``num_heads * head_dim`` wide.
    """

    name: str
    family: Family
    num_heads: int
    head_dim: int
    streams: tuple[Stream, Stream]
    in_projections: tuple[str, ...]
    out_projection: str

    @property
    def fused(self) -> bool:
        return self.family == "gpt2"

    def in_features(self, heads: Sequence[int]) -> torch.Tensor:
        """Output features of the q/k/v projection(s) that belong to ``heads`` (fused: all three parts)."""
        per_head = [h * self.head_dim + j for h in heads for j in range(self.head_dim)]
        width = self.num_heads * self.head_dim
        parts = 3 if self.fused else 1
        return torch.tensor([p * width + i for p in range(parts) for i in per_head], dtype=torch.long)

    def out_features(self, heads: Sequence[int]) -> torch.Tensor:
        """Input features of the output projection that belong to ``heads``."""
        return torch.tensor([h * self.head_dim + j for h in heads for j in range(self.head_dim)], dtype=torch.long)


def _linear_out_in(module: nn.Module) -> tuple[int, int]:
    base = module.base_layer if isinstance(module, LoraLayer) else module
    if isinstance(base, nn.Linear):
        return base.out_features, base.in_features
    if isinstance(base, Conv1D):
        return base.nf, base.weight.shape[0]
    raise ConfigError("strategy.head_pruning", f"cannot slice a {type(base).__name__}; heads need Linear/Conv1D")


def projection_in_features(model: nn.Module, site: HeadSite) -> int:
    """The model width a site's query projection reads (``d_model``; T5's inner width may differ)."""
    return _linear_out_in(model.get_submodule(site.in_projections[0]))[1]


def _stream(name: str, cross: bool, encoder_decoder: bool) -> tuple[Stream, Stream]:
    if cross:
        return ("decoder", "input")
    if encoder_decoder and (".decoder." in f".{name}."):
        return ("decoder", "decoder")
    return ("input", "input")


def find_head_sites(model: nn.Module) -> list[HeadSite]:
    """Every multi-head attention block of ``model``, in module order."""
    encoder_decoder = bool(getattr(model.config, "is_encoder_decoder", False))
    modules = dict(model.named_modules())
    sites: list[HeadSite] = []
    for name, module in modules.items():
        site: HeadSite | None = None
        if all(hasattr(module, a) for a in ("query", "key", "value", "attention_head_size", "num_attention_heads")):
            parent = name.rsplit(".", 1)[0]
            out = f"{parent}.output.dense"
            if out not in modules:
                raise ConfigError("strategy.head_pruning", f"{name}: no output projection {out}")
            cross = "crossattention" in name
            site = HeadSite(name, "bert", module.num_attention_heads, module.attention_head_size,
                            _stream(name, cross, encoder_decoder),
                            (f"{name}.query", f"{name}.key", f"{name}.value"), out)
        elif all(hasattr(module, a) for a in ("q", "k", "v", "o", "n_heads", "key_value_proj_dim")):
            cross = name.endswith("EncDecAttention")
            site = HeadSite(name, "t5", module.n_heads, module.key_value_proj_dim,
                            _stream(name, cross, encoder_decoder), (f"{name}.q", f"{name}.k", f"{name}.v"),
                            f"{name}.o")
        elif all(hasattr(module, a) for a in ("q_proj", "k_proj", "v_proj", "head_dim")) and (
            hasattr(module, "out_proj") or hasattr(module, "o_proj")
        ):
            q_out = _linear_out_in(module.q_proj)[0]
            if _linear_out_in(module.k_proj)[0] != q_out:
                raise ConfigError("strategy.head_pruning", f"{name}: grouped-query attention is not supported")
            cross = name.endswith("encoder_attn")
            out = f"{name}.out_proj" if hasattr(module, "out_proj") else f"{name}.o_proj"
            site = HeadSite(name, "bart", q_out // module.head_dim, module.head_dim,
                            _stream(name, cross, encoder_decoder),
                            (f"{name}.q_proj", f"{name}.k_proj", f"{name}.v_proj"), out)
        elif all(hasattr(module, a) for a in ("c_attn", "c_proj", "head_dim", "split_size", "num_heads")):
            if getattr(module, "is_cross_attention", False):
                raise ConfigError("strategy.head_pruning", f"{name}: GPT-2 cross-attention is not supported")
            site = HeadSite(name, "gpt2", module.num_heads, module.head_dim, ("input", "input"),
                            (f"{name}.c_attn",), f"{name}.c_proj")
        if site is not None:
            sites.append(site)
    if not sites:
        raise ConfigError("strategy.head_pruning", f"found no attention heads in {type(model).__name__}")
    return sites


# ----------------------------------------------------------------------------------------------
# Which trainable tensors belong to which heads


@dataclass(frozen=True)
class HeadOwnership:
    """``owner`` gives, along ``dim`` of a tensor, the global id (site * num_heads + h) of the head
    each slice belongs to."""

    dim: int
    owner: torch.Tensor


def _head_ids(site_index: int, site: HeadSite, features: int, fused: bool) -> torch.Tensor:
    width = site.num_heads * site.head_dim
    local = torch.arange(features) % width if fused else torch.arange(features)
    return site_index * site.num_heads + local // site.head_dim


def head_ownership(model: nn.Module, sites: Sequence[HeadSite]) -> dict[str, HeadOwnership]:
    """Parameter name -> which heads own which of its rows/columns.

    Head ``h`` owns, in each q/k/v projection, output features ``[h*d, (h+1)*d)``: rows of LoRA
    ``B`` (and of the base weight and bias when those are trained); in the output projection,
    input features ``[h*d, (h+1)*d)``: columns of LoRA ``A`` (and of the base weight). LoRA ``A``
    of q/k/v and ``B`` of the output projection are shared by all heads and owned by none.
    """
    if len({s.num_heads for s in sites}) != 1:
        raise ConfigError("strategy.head_pruning", "all attention blocks must have the same number of heads")
    modules = dict(model.named_modules())
    owned: dict[str, HeadOwnership] = {}
    for index, site in enumerate(sites):
        for path in site.in_projections:
            out_features = _linear_out_in(modules[path])[0]
            ids = _head_ids(index, site, out_features, site.fused)
            for name, dim in _projection_tensors(modules[path], path, output_side=True):
                owned[name] = HeadOwnership(dim, ids)
        path = site.out_projection
        in_features = _linear_out_in(modules[path])[1]
        ids = _head_ids(index, site, in_features, False)
        for name, dim in _projection_tensors(modules[path], path, output_side=False):
            owned[name] = HeadOwnership(dim, ids)
    return owned


def _projection_tensors(module: nn.Module, path: str, output_side: bool) -> list[tuple[str, int]]:
    """(parameter name, dim) of the head-owned features of one projection."""
    found: list[tuple[str, int]] = []
    base, base_path = (module.base_layer, f"{path}.base_layer") if isinstance(module, LoraLayer) else (module, path)
    conv = isinstance(base, Conv1D)  # weight is (in, out)
    found.append((f"{base_path}.weight", (1 if conv else 0) if output_side else (0 if conv else 1)))
    if output_side and base.bias is not None:
        found.append((f"{base_path}.bias", 0))
    if isinstance(module, LoraLayer):
        for adapter in module.lora_A:
            if output_side:
                found.append((f"{path}.lora_B.{adapter}.weight", 0))
                if module.lora_B[adapter].bias is not None:
                    found.append((f"{path}.lora_B.{adapter}.bias", 0))
            else:
                found.append((f"{path}.lora_A.{adapter}.weight", 1))
    return found


# ----------------------------------------------------------------------------------------------
# Importance: Voita's confidence (Eq. 6)


def head_confidence(attention: torch.Tensor, query_valid: torch.Tensor, key_valid: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per example and head: mean over valid queries of the largest weight on a valid key.

    ``attention`` is ``(batch, heads, queries, keys)`` softmax weights, ``query_valid``
    ``(batch, queries)`` and ``key_valid`` ``(batch, keys)`` booleans. Returns ``(confidence
    (batch, heads), has_queries (batch,))``; an example without a valid query scores 0 and is
    flagged so that the caller leaves it out of the mean over examples.
    """
    weights = attention.float().masked_fill(~key_valid[:, None, None, :], 0.0)
    peak = weights.amax(dim=-1)  # (batch, heads, queries)
    mask = query_valid[:, None, :].float()
    count = mask.sum(dim=-1)
    confidence = (peak * mask).sum(dim=-1) / count.clamp(min=1.0)
    return confidence, query_valid.any(dim=-1)


@contextmanager
def eager_attention(model: nn.Module) -> Iterator[None]:
    """Switch to eager attention (the only kind that returns attention weights) for a while."""
    previous = model.config._attn_implementation
    if previous != "eager":
        model.set_attn_implementation("eager")
    try:
        yield
    finally:
        if previous != "eager":
            model.set_attn_implementation(previous)


def _token_streams(model: nn.Module, batch: dict[str, torch.Tensor], end_ids: set[int]
                   ) -> tuple[dict[str, torch.Tensor], dict[Stream, tuple[torch.Tensor, torch.Tensor]]]:
    """Model inputs for the scoring pass, and per stream (valid tokens, non-end tokens)."""
    def end_mask(ids: torch.Tensor) -> torch.Tensor:
        ends = torch.zeros_like(ids, dtype=torch.bool)
        for token in end_ids:
            ends |= ids == token
        return ends

    inputs = model_inputs(batch)
    ids = batch["input_ids"]
    valid = batch.get("attention_mask", torch.ones_like(ids)).bool()
    streams: dict[Stream, tuple[torch.Tensor, torch.Tensor]] = {"input": (valid, ~end_mask(ids))}
    if getattr(model.config, "is_encoder_decoder", False):
        labels = batch.get("labels")
        if labels is not None and labels.dim() == 2:  # seq2seq: the decoder reads the shifted targets
            decoder_ids = model.prepare_decoder_input_ids_from_labels(labels=labels)
            decoder_valid = labels != -100
        else:  # classification heads of encoder-decoders feed the shifted input to the decoder
            start = torch.full_like(ids[:, :1], model.config.decoder_start_token_id)
            decoder_ids = torch.cat([start, ids[:, :-1]], dim=1)
            decoder_valid = torch.cat([torch.ones_like(valid[:, :1]), valid[:, :-1]], dim=1)
        inputs["decoder_input_ids"] = decoder_ids
        streams["decoder"] = (decoder_valid, ~end_mask(decoder_ids))
    return inputs, streams


@torch.no_grad()
def head_importance(model: nn.Module, sites: Sequence[HeadSite], batches: Iterable[dict[str, torch.Tensor]],
                    end_token_ids: Iterable[int], exclude: EndTokenExclusion = "both") -> torch.Tensor:
    """Eq. 6: per site and head, the mean over examples of the head's confidence.

    ``batches`` are training batches (with ``labels``: an encoder-decoder's decoder inputs are
    derived from them). Padding is never a query or a key; end-of-sequence / separator tokens
    (``end_token_ids``) are left out as keys, queries, both or neither (``exclude``). Returns a
    ``(num_sites, num_heads)`` tensor. The model is put in eval mode for the pass.
    """
    end_ids = {int(t) for t in end_token_ids if t is not None}
    modules = dict(model.named_modules())
    captured: dict[int, torch.Tensor] = {}
    totals = torch.zeros(len(sites), sites[0].num_heads)
    examples = torch.zeros(len(sites))

    def recorder(index: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            weights = output[-1] if isinstance(output, tuple) else None
            if not isinstance(weights, torch.Tensor) or weights.dim() != 4:
                raise RuntimeError(f"{sites[index].name} returned no attention weights under eager attention")
            captured[index] = weights
        return hook

    was_training = model.training
    model.eval()
    with eager_attention(model), ExitStack() as stack:
        for index, site in enumerate(sites):
            handle = modules[site.name].register_forward_hook(recorder(index))
            stack.callback(handle.remove)
        for batch in batches:
            inputs, streams = _token_streams(model, batch, end_ids)
            captured.clear()
            model(**inputs)
            for index, site in enumerate(sites):
                q_valid, q_not_end = streams[site.streams[0]]
                k_valid, k_not_end = streams[site.streams[1]]
                if exclude in ("both", "queries"):
                    q_valid = q_valid & q_not_end
                if exclude in ("both", "keys"):
                    k_valid = k_valid & k_not_end
                confidence, has_queries = head_confidence(captured[index], q_valid, k_valid)
                totals[index] += confidence[has_queries].sum(dim=0).cpu()
                examples[index] += has_queries.sum().cpu()
    model.train(was_training)
    return totals / examples.clamp(min=1.0)[:, None]


# ----------------------------------------------------------------------------------------------
# Pruning: slice the projections so that pruned heads cost nothing


def _lora_parts(module: LoraLayer) -> tuple[nn.Linear, nn.Linear, nn.Module, float] | None:
    """(A, B, dropout, scaling) of a LoRA layer's single active plain adapter; None if inactive."""
    if module.merged:
        raise ConfigError("strategy.head_pruning", "cannot prune heads of a merged LoRA layer")
    if module.disable_adapters:
        return None
    active = [a for a in module.active_adapters if a in module.lora_A]
    if not active:
        return None
    if len(active) > 1 or active[0] in getattr(module, "lora_variant", {}):
        raise ConfigError("strategy.head_pruning", "head pruning supports one plain LoRA adapter per layer")
    adapter = active[0]
    return module.lora_A[adapter], module.lora_B[adapter], module.lora_dropout[adapter], module.scaling[adapter]


def sliced_projection(module: nn.Module, out_index: torch.Tensor | None, in_index: torch.Tensor | None
                      ) -> Callable[..., torch.Tensor]:
    """A forward for ``module`` computing only output features ``out_index`` from input features
    ``in_index`` (None: all). Frozen base weights are sliced once; trained ones (and LoRA A/B) are
    sliced in every call so that gradients reach exactly the kept rows/columns."""
    lora = _lora_parts(module) if isinstance(module, LoraLayer) else None
    base = module.base_layer if isinstance(module, LoraLayer) else module
    weight = base.weight.t() if isinstance(base, Conv1D) else base.weight  # (out, in)
    bias = base.bias

    def take(w: torch.Tensor, b: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        if out_index is not None:
            w = w.index_select(0, out_index)
            b = None if b is None else b.index_select(0, out_index)
        if in_index is not None:
            w = w.index_select(1, in_index)
        return w, b

    trained = weight.requires_grad or (bias is not None and bias.requires_grad)
    if not trained:
        frozen_w, frozen_b = take(weight.detach(), None if bias is None else bias.detach())
        frozen_w = frozen_w.contiguous()

    def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        w, b = take(weight, bias) if trained else (frozen_w, frozen_b)
        result = F.linear(x, w, b)
        if lora is not None:
            lora_a, lora_b, dropout, scaling = lora
            a = lora_a.weight if in_index is None else lora_a.weight.index_select(1, in_index)
            b_w = lora_b.weight if out_index is None else lora_b.weight.index_select(0, out_index)
            b_b = lora_b.bias
            if b_b is not None and out_index is not None:
                b_b = b_b.index_select(0, out_index)
            result = result + F.linear(F.linear(dropout(x), a), b_w, b_b) * scaling
        return result

    return forward


def _t5_forward(module: nn.Module, original: Callable[..., Any], kept: torch.Tensor) -> Callable[..., Any]:
    """T5 shares one position bias (all heads) between layers: slice it here, pass the full one on."""

    def forward(hidden_states: torch.Tensor, mask: torch.Tensor | None = None,
                key_value_states: torch.Tensor | None = None, position_bias: torch.Tensor | None = None,
                **kwargs: Any) -> tuple[Any, ...]:
        if position_bias is None:
            query_length = hidden_states.shape[1]
            key_length = (hidden_states if key_value_states is None else key_value_states).shape[1]
            if module.has_relative_attention_bias:
                position_bias = module.compute_bias(query_length, key_length, device=hidden_states.device)
            else:
                position_bias = hidden_states.new_zeros(1, module.n_heads, query_length, key_length)
        if kept.numel() == 0:
            output = module.o(hidden_states.new_zeros(*hidden_states.shape[:-1], 0))
            return output, position_bias, None
        output, _, weights = original(hidden_states, mask=mask, key_value_states=key_value_states,
                                      position_bias=position_bias.index_select(1, kept), **kwargs)
        return output, position_bias, weights

    return forward


def _empty_forward(site: HeadSite, module: nn.Module, out_module: nn.Module) -> Callable[..., Any]:
    """A block with every head pruned adds nothing but the output projection's bias."""

    def forward(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        empty = hidden_states.new_zeros(*hidden_states.shape[:-1], 0)
        if site.family == "bert":  # the output projection lives outside (BertSelfOutput)
            return empty, None
        output = out_module(empty)
        if site.family == "gpt2":
            output = module.resid_dropout(output)
        return output, None

    return forward


def _device_of(module: nn.Module) -> torch.device:
    return next(module.parameters()).device


def _patch(stack: ExitStack, obj: nn.Module, attribute: str, value: Any) -> None:
    had = attribute in obj.__dict__
    previous = obj.__dict__.get(attribute)
    setattr(obj, attribute, value)

    def restore() -> None:
        if had:
            setattr(obj, attribute, previous)
        else:
            delattr(obj, attribute)

    stack.callback(restore)


@contextmanager
def pruned_heads(model: nn.Module, sites: Sequence[HeadSite], kept: Sequence[Sequence[int]]) -> Iterator[None]:
    """Within the block, site ``i`` runs with heads ``kept[i]`` only (Eq. 7's pruned heads removed).

    The q/k/v projections compute only the kept heads' features and the output projection reads
    only theirs, so the pruned heads cost no FLOPs and their parameters get no gradient. The
    result equals zeroing the pruned heads' outputs (:func:`masked_heads`).
    """
    modules = dict(model.named_modules())
    with ExitStack() as stack:
        for site, heads in zip(sites, kept, strict=True):
            heads = sorted(int(h) for h in heads)
            if len(heads) == site.num_heads:
                continue
            module = modules[site.name]
            out_module = modules[site.out_projection]
            device = _device_of(out_module)  # index_select wants its indices where the weights are
            rows = site.in_features(heads).to(device)
            for path in site.in_projections:
                _patch(stack, modules[path], "forward", sliced_projection(modules[path], rows, None))
            _patch(stack, out_module, "forward",
                   sliced_projection(out_module, None, site.out_features(heads).to(device)))
            kept_index = torch.tensor(heads, dtype=torch.long, device=device)
            if site.family == "t5":
                _patch(stack, module, "forward", _t5_forward(module, type(module).forward.__get__(module), kept_index))
            elif not heads:
                _patch(stack, module, "forward", _empty_forward(site, module, out_module))
            if site.family == "gpt2":
                _patch(stack, module, "split_size", len(heads) * site.head_dim)
        yield


@contextmanager
def masked_heads(model: nn.Module, sites: Sequence[HeadSite], kept: Sequence[Sequence[int]]) -> Iterator[None]:
    """Reference semantics of pruning: the pruned heads run but their outputs are zeroed before
    the output projection (what ``head_mask`` did in transformers 4). No compute is saved."""
    modules = dict(model.named_modules())
    with ExitStack() as stack:
        for site, heads in zip(sites, kept, strict=True):
            mask = torch.zeros(site.num_heads * site.head_dim, device=_device_of(modules[site.out_projection]))
            mask[site.out_features(sorted(int(h) for h in heads))] = 1.0

            def zero_pruned(module: nn.Module, args: tuple[Any, ...], mask: torch.Tensor = mask) -> tuple[Any, ...]:
                return (args[0] * mask, *args[1:])

            handle = modules[site.out_projection].register_forward_pre_hook(zero_pruned)
            stack.callback(handle.remove)
        yield


def end_token_ids(tokenizer: Any) -> list[int]:
    """End-of-sequence and separator ids of a tokenizer (Voita's excluded end symbols)."""
    return sorted({t for t in (tokenizer.eos_token_id, tokenizer.sep_token_id) if t is not None})

