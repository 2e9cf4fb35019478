"""Adapters: what part of the backbone is trainable. Importing this package registers them all."""

from fedpeft.adapters import bitfit, bottleneck, federa, ffa_lora, full, ia3, lora, prompts, tt
from fedpeft.adapters.base import ADAPTERS, Adapter, build_adapter, register_adapter, trainable_state

__all__ = [
    "ADAPTERS", "Adapter", "bitfit", "bottleneck", "build_adapter", "federa", "ffa_lora", "full", "ia3", "lora",
    "prompts", "register_adapter", "trainable_state", "tt",
]
