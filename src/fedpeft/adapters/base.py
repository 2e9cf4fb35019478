"""The adapter interface: what part of a backbone is trainable, and how it gets there.

An adapter modifies the model in place (injects modules, rewrites frozen weights) and leaves
``requires_grad=True`` exactly on the parameters that clients train and exchange. Everything
else about the federated round (selection, codec, aggregation) is the recipe's business.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch
from pydantic import BaseModel
from torch import nn

from fedpeft.config import AdapterConfig, ConfigError, refuse_unread
from fedpeft.models.backbone import HEAD_MODULE_NAMES, Backbone


class Adapter(ABC):
    """Base class. Subclasses set ``kind`` and implement :meth:`inject`; ``adapter_options`` are the
    models of their own ``adapter.*`` fields (the section allows extras for them)."""

    kind: ClassVar[str]
    adapter_options: ClassVar[tuple[type[BaseModel], ...]] = ()

    @classmethod
    def option_models(cls, cfg: AdapterConfig) -> tuple[type[BaseModel], ...]:
        """What reads ``cfg``'s extra fields (an adapter whose options depend on another field overrides it)."""
        del cfg
        return cls.adapter_options

    def __init__(self, cfg: AdapterConfig) -> None:
        self.cfg = cfg

    @abstractmethod
    def inject(self, backbone: Backbone) -> None:
        """Modify ``backbone.model`` in place and set ``requires_grad`` on the trainable parameters."""

    def apply(self, backbone: Backbone) -> None:
        """Freeze everything, inject, then unfreeze the task head if configured.

        The head is found before injection (an adapter may wrap and rename modules; the parameter
        objects stay the same)."""
        head = [param for _, param in head_parameters(backbone)] if self.cfg.train_head else []
        for param in backbone.model.parameters():
            param.requires_grad_(False)
        self.inject(backbone)
        for param in head:
            param.requires_grad_(True)


def head_parameters(backbone: Backbone) -> list[tuple[str, nn.Parameter]]:
    """Parameters of the task head: the top-level :data:`HEAD_MODULE_NAMES` modules, and every
    parameter the checkpoint did not provide (random at load, so it must learn with the head)."""
    new = set(backbone.new_parameters)
    return [(n, p) for n, p in backbone.model.named_parameters() if n.split(".")[0] in HEAD_MODULE_NAMES or n in new]


def trainable_names(model: nn.Module) -> list[str]:
    return [name for name, param in model.named_parameters() if param.requires_grad]


def trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Detached copies of the trainable parameters: the state clients and server exchange."""
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


ADAPTERS: dict[str, type[Adapter]] = {}


def register_adapter(cls: type[Adapter]) -> type[Adapter]:
    ADAPTERS[cls.kind] = cls
    return cls


def check_adapter_fields(cfg: AdapterConfig, given: set[str]) -> None:
    """Refuse an ``adapter.*`` field the user ``given`` that the adapter does not read
    (:func:`fedpeft.config.refuse_unread`)."""
    if cfg.kind in ADAPTERS:  # an unknown kind is named by build_adapter
        refuse_unread("adapter", given, cfg.model_extra or {}, ADAPTERS[cfg.kind].option_models(cfg),
                      f"adapter {cfg.kind!r} (init {cfg.init!r})", AdapterConfig.model_fields)


def build_adapter(cfg: AdapterConfig) -> Adapter:
    if cfg.kind not in ADAPTERS:
        raise ConfigError("adapter.kind", f"unknown adapter {cfg.kind!r}; allowed: {', '.join(sorted(ADAPTERS))}")
    return ADAPTERS[cfg.kind](cfg)

