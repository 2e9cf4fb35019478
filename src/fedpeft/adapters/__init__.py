"""Adapters: what part of the backbone is trainable. Importing this package registers them all."""

from fedpeft.adapters import bottleneck, full, lora
from fedpeft.adapters.base import ADAPTERS, Adapter, build_adapter, register_adapter, trainable_state

__all__ = ["ADAPTERS", "Adapter", "bottleneck", "build_adapter", "full", "lora", "register_adapter", "trainable_state"]
