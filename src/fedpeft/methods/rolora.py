"""RoLoRA (Chen et al., 2025, "Robust federated finetuning of LLMs via alternating optimization of LoRA").

Rounds alternate between the two LoRA matrices: in one round every selected client trains B
with A frozen and uploads only B; in the next it trains A with B frozen and uploads only A.
With one matrix fixed, the server's average of the trained one is the exact average of the
clients' products B A (no cross terms), and the uplink carries half the LoRA parameters.
The task head (when trainable) is trained and sent every round.

Choices: ``strategy.rolora_first`` (default ``B``) picks the matrix of round 1. B comes first
because LoRA starts from B = 0, where A's gradient is zero, so an A-first round would waste the
round. The downlink carries the whole global state (A, B and head): clients are sampled afresh
each round and keep no state, so a client needs the current frozen matrix too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from fedpeft.config import ConfigError
from fedpeft.federated.algorithm import register_algorithm
from fedpeft.federated.types import ClientTask, State
from fedpeft.methods.federa import LoraFedAvg, lora_matrix


class RoLoraOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    rolora_first: Literal["A", "B"] = "B"


def trained_matrix(round_idx: int, first: str) -> str:
    """The LoRA matrix trained and sent in ``round_idx`` (1-based): ``first`` in odd rounds."""
    other = "A" if first == "B" else "B"
    return first if round_idx % 2 == 1 else other


@register_algorithm
class RoLora(LoraFedAvg):
    name = "rolora"
    strategy_options = (RoLoraOptions,)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        try:
            self.options = RoLoraOptions.model_validate(self.cfg.strategy.model_dump())
        except ValidationError as err:
            raise ConfigError("strategy.rolora_first", err.errors()[0]["msg"] + "; allowed: A, B") from None
        if not any(lora_matrix(k) for k in self.ctx.slot.trainable):
            raise ConfigError("adapter.kind", "rolora alternates LoRA matrices; use adapter.kind lora")

    def round_keys(self, round_idx: int) -> frozenset[str]:
        """Trainable keys of this round: the active LoRA matrix plus every non-LoRA key (head)."""
        active = trained_matrix(round_idx, self.options.rolora_first)
        return frozenset(k for k in self.ctx.slot.trainable if lora_matrix(k) in (None, active))

    def configure_train(self, round_idx: int, clients: Sequence[int], global_state: State) -> list[ClientTask]:
        tasks = super().configure_train(round_idx, clients, global_state)
        keys = self.round_keys(round_idx)
        for task in tasks:
            task.train_keys = keys
            task.upload_keys = keys
        return tasks

    def round_metrics(self, round_idx: int, global_state: State) -> dict[str, Any]:
        return {**super().round_metrics(round_idx, global_state),
                "trained_matrix": trained_matrix(round_idx, self.options.rolora_first)}
