"""Mean pooling for an encoder's sequence classifier (``model.pooling: mean``).

transformers' encoder classifiers read the first token: BERT's pooler (a dense + tanh pretrained
for next-sentence prediction) and RoBERTa/MPNet/DeBERTa/DistilBERT's heads all start from
``hidden[:, 0]``. Sentence encoders such as all-MiniLM-L6-v2 and all-mpnet-base-v2 were trained
on the *mean* of the last layer over real tokens, so their first token carries little of what
they learned: on SST-2 (2,000 training sentences, 872 dev) a logistic regression on MiniLM's
frozen features scores 0.794 on the mean, 0.718 on the first token and 0.705 on BERT's pooler
output (``benchmarks/probe.py``, ``benchmarks/results/probe.md``).

With ``mean`` the first position of the encoder's output is replaced by the masked mean of all
positions (padding excluded), so whatever head the model class has reads the mean and keeps its
own parameters and names (BERT's pooler then sees the mean: 0.790 by the same probe). Positions
a soft prompt adds count as tokens; a deep prompt's prefix is not a position of the output and is
left out. Only position 0 of the encoder's output changes (it is also the last entry of
``output_hidden_states``); the layers' inner states are untouched.

With ``mean_no_pooler`` the mean goes straight to the classifier, skipping BERT's pooler, as a
sentence-transformers user puts a linear layer on the sentence embedding. The pooler's dense +
tanh was pretrained for next-sentence prediction, which all-MiniLM-L6-v2's training never used, and
stays frozen under PEFT. A linear probe separates the two nearly equally (0.794 on the mean,
0.790 through the pooler), yet trained federated on the same setting LoRA ends at 0.740 +- 0.055
past the pooler against 0.701 +- 0.075 through it, and prompt tuning at 0.748 against 0.679 (3
seeds, ``benchmarks/results/pooling.md``; higher on every seed, within noise over three): the
frozen tanh seems to hinder training more than separation. Only models with a pooler (BERT's
family) take it; for the others ``mean`` already reads the mean with the head's own trainable
layers.

``auto`` (the default) reads the checkpoint: a sentence-transformers model whose Pooling module
pools by the mean (``modules.json`` -> ``1_Pooling/config.json``: all-MiniLM-L6-v2, all-mpnet-base-v2)
gets ``mean_no_pooler`` when its classifier has a pooler (BERT's family, MiniLM) and ``mean``
otherwise (MPNet); anything else (a CLS-pooled or plain checkpoint, random ``tiny-*`` models,
other heads) keeps ``head``. Why the default: in the short-run SST-2 setting (10 rounds, Dirichlet
0.5) every recipe at its defaults with ``mean_no_pooler`` ended higher on seed 0 than with ``head``
for 23 of 25 recipes, nine of the ten that sat at the majority class left it, and the only
recipes whose 3-seed mean reaches 0.80 read the mean (``benchmarks/results/no_pooler.md``,
``no_pooler_tuned.md``). A run can still pin ``head`` (the committed head-pooling benchmarks do).
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fedpeft.config import ConfigError

ENCODER_STACKS = ("encoder", "transformer")  # BERT/RoBERTa/MPNet/DeBERTa/ELECTRA; DistilBERT
_MASK = "_fedpeft_pooling_mask"


def masked_mean(hidden: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Mean over the positions where ``mask`` is 1 (all positions when it is None): (B, L, H) -> (B, H)."""
    if mask is None:
        return hidden.mean(dim=1)
    weights = mask.to(hidden.dtype).unsqueeze(-1)
    return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1.0)


def _capture_mask(stack_name: str, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
    setattr(getattr(module, stack_name), _MASK, mask)


def _first_token_is_mean(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
    hidden = output[0]
    mask = getattr(module, _MASK, None)
    setattr(module, _MASK, None)  # one forward's mask, not kept for a later direct call
    if mask is not None:
        mask = mask[:, -hidden.shape[1]:]  # a deep prompt's prefix columns come first and are not outputs
    pooled = torch.cat([masked_mean(hidden, mask).unsqueeze(1), hidden[:, 1:]], dim=1)
    if isinstance(output, tuple):
        return (pooled, *output[1:])
    output.last_hidden_state = pooled
    return output


def _pooler_passes_first_token(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
    hidden = args[0] if args else kwargs["hidden_states"]
    return hidden[:, 0]


def attach_mean_pooling(model: nn.Module, skip_pooler: bool = False) -> None:
    """Make ``model``'s classification head read the masked mean of the encoder's last layer.

    Hooks on the base model (which receives the attention mask, already extended by any prompt)
    and on its encoder stack; no parameter is added or renamed, so checkpoints, adapters and
    exports see the same names. ``skip_pooler`` makes the base model's pooler pass position 0 (the
    mean) through unchanged; a model without one is refused."""
    base = getattr(model, "base_model", None)
    stack_name = next((name for name in ENCODER_STACKS if isinstance(getattr(base, name, None), nn.Module)), None)
    if base is None or base is model or stack_name is None:
        raise ConfigError("model.pooling", f"mean pooling needs an encoder whose stack is one of "
                                           f"{', '.join(ENCODER_STACKS)}; {type(model).__name__} has none")
    base.register_forward_pre_hook(partial(_capture_mask, stack_name), with_kwargs=True)
    getattr(base, stack_name).register_forward_hook(_first_token_is_mean, with_kwargs=True)
    if skip_pooler:
        pooler = getattr(base, "pooler", None)
        if not isinstance(pooler, nn.Module):
            raise ConfigError("model.pooling", f"mean_no_pooler skips a pretrained pooler, and "
                                               f"{type(model).__name__} has none; use mean")
        pooler.register_forward_hook(_pooler_passes_first_token, with_kwargs=True)


def sentence_pooling_mode(source: str | None) -> str | None:
    """How a sentence-transformers checkpoint pools (``mean``, ``cls``, ``max``, ``mean_sqrt_len``,
    ...), from its ``modules.json`` and Pooling module config; None when ``source`` is not one, or
    (a hub id) its files are neither local nor in the hub cache."""
    if source is None:
        return None

    def read(name: str) -> Any:
        path = Path(source) / name
        if not path.is_file():
            if Path(source).is_dir():
                return None
            try:  # a hub id: the cache, or a download where the hub is reachable
                from huggingface_hub import hf_hub_download

                path = Path(hf_hub_download(source, name))
            except Exception:  # any hub failure means "not known to be a sentence encoder"
                return None
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return None

    modules = read("modules.json")
    if not isinstance(modules, list):
        return None
    pooling = next((m for m in modules if isinstance(m, dict) and str(m.get("type", "")).endswith(".Pooling")), None)
    if pooling is None:
        return None
    options = read(f"{pooling.get('path', '')}/config.json".lstrip("/"))
    if not isinstance(options, dict):
        return None
    modes = [key.removeprefix("pooling_mode_").removesuffix("_tokens").removesuffix("_token")
             for key, on in options.items() if key.startswith("pooling_mode_") and on is True]
    return modes[0] if len(modes) == 1 else None


def pooling_applies(architecture: str, head: str) -> bool:
    """Whether ``model.pooling`` means anything: only an encoder's sequence classifier reads a first token
    that a mean can stand in for."""
    return architecture == "encoder" and head == "sequence_classification"


def resolve_pooling(requested: str, model: nn.Module, source: str | None, architecture: str, head: str) -> str:
    """``requested`` unless it is ``auto``; then ``mean_no_pooler``/``mean`` for a mean-pooled sentence
    encoder's sequence classifier (with/without a pretrained pooler), else ``head``."""
    if requested != "auto":
        return requested
    if not pooling_applies(architecture, head) or sentence_pooling_mode(source) != "mean":
        return "head"
    base = getattr(model, "base_model", None)
    return "mean_no_pooler" if isinstance(getattr(base, "pooler", None), nn.Module) else "mean"


def apply_pooling(model: nn.Module, pooling: str) -> None:
    """Make ``model`` read what ``pooling`` (a resolved ``model.pooling``) says: nothing to do for
    ``head``. For a plain transformers/PEFT load of a fedpeft export whose metadata names a mean pooling."""
    if pooling not in ("head", "mean", "mean_no_pooler"):
        raise ConfigError("model.pooling", f"{pooling!r} is not a resolved pooling (head, mean, mean_no_pooler)")
    if pooling != "head":
        attach_mean_pooling(model, skip_pooler=pooling == "mean_no_pooler")
