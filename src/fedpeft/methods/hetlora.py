"""HetLoRA (Cho et al., 2023) as FLASC's paper (``002_...txt``, Section 4.3) runs it.

The server holds a rank-r LoRA. Each client c has a rank tier r_c <= r (its compute budget):
it downloads the uppermost r_c rows of every A and the leftmost r_c columns of every B, trains
that rank-r_c LoRA, and uploads the update of the same slices. The server zero-pads every
update back to rank r and averages over all sampled clients, so ranks a client does not hold
count as "no change" from it (FLASC's ``train_sparse_lora_het.py`` does exactly this: the
pseudo-gradient of a masked-out entry is zero), then applies the configured server step.

FeDeRA's ``adapter.init: svd`` is refused when a tier is below r: a rank-r_i client's model would
lack components r_i..r of W0's principal part (they live in the A rows / B columns it does not
hold, not in the frozen residual W0 - scale B0 A0).

Choices: ``strategy.rank_tiers`` (default: FLASC's 4^b tiers up to r, e.g. [1, 4, 16] for r = 16)
and ``strategy.rank_assignment``: ``random`` (default; the paper draws each client's tier
uniformly at random, seeded from the run seed) or ``modulo`` (tier = client id mod #tiers, as
FLASC's released code does). The client's LoRA keeps the global scale alpha / r (FLASC's clients
mask the global module rather than re-scaling). The ``hetlora`` recipe averages sample-weighted
into Reddi et al.'s FedAdam (the paper's "FedAdam"); the ``hetlora_released`` recipe is the
released ``train_sparse_lora_het.py``: tiers by client id mod 3, the plain mean over the sampled
clients (``weighting: uniform``) into ``torch.optim.AdamW`` (``fedadamw``: lr 5e-3, betas
0.9/0.999, weight decay 0.01, bias correction), LoRA dropout 0.1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fedpeft.adapters.federa import refuse_svd_init
from fedpeft.config import ConfigError
from fedpeft.federated.algorithm import register_algorithm
from fedpeft.federated.client import ModelSlot, TrainStats, train_client
from fedpeft.federated.types import ClientResult, ClientTask, State
from fedpeft.methods.federa import LoraFedAvg, lora_matrix
from fedpeft.models.encoding import EncodedData
from fedpeft.seeding import rng_for

TierAssignment = Literal["random", "modulo"]


class HetLoraOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    rank_tiers: list[int] | None = Field(default=None, min_length=1)
    rank_assignment: TierAssignment = "random"


def default_tiers(rank: int) -> list[int]:
    """FLASC's tiers 4^b, b = 0, 1, ..., up to the server rank (which is always the top tier)."""
    tiers = [4**b for b in range(rank.bit_length()) if 4**b < rank]
    return [*tiers, rank]


def assign_tiers(num_clients: int, num_tiers: int, assignment: TierAssignment, seed: int) -> np.ndarray:
    """Each client's tier index: ``modulo`` (client id mod #tiers, FLASC's released code) or ``random``
    (uniform, seeded from the run seed; the paper). One stream for every tiered method, so HetLoRA and
    FLASC's density tiers give a client the same tier index under the same seed."""
    if assignment == "modulo":
        return np.arange(num_clients) % num_tiers
    return rng_for(seed, "hetlora_tiers").integers(num_tiers, size=num_clients)


def slice_lora(state: State, rank: int) -> State:
    """Top-left rank-``rank`` slice: the first ``rank`` rows of each A, columns of each B."""
    sliced = {}
    for key, value in state.items():
        kind = lora_matrix(key)
        sliced[key] = value[:rank] if kind == "A" else value[:, :rank] if kind == "B" else value
    return sliced


def pad_lora(state: State, shapes: dict[str, torch.Size]) -> State:
    """Zero-pad sliced LoRA tensors back to the full ``shapes`` (the inverse of :func:`slice_lora`)."""
    padded = {}
    for key, value in state.items():
        if tuple(value.shape) == tuple(shapes[key]):
            padded[key] = value
            continue
        full = torch.zeros(shapes[key], dtype=value.dtype)
        full[: value.shape[0], : value.shape[1]] = value
        padded[key] = full
    return padded


@register_algorithm
class HetLora(LoraFedAvg):
    name = "hetlora"
    strategy_options = (HetLoraOptions,)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        try:
            options = HetLoraOptions.model_validate(self.cfg.strategy.model_dump())
        except ValidationError as err:
            first = err.errors()[0]
            raise ConfigError(f"strategy.{first['loc'][0]}", first["msg"]) from None
        rank = self.cfg.adapter.r
        tiers = options.rank_tiers or default_tiers(rank)
        bad = [t for t in tiers if not 1 <= t <= rank]
        if bad:
            raise ConfigError("strategy.rank_tiers", f"tiers {bad} outside 1..adapter.r ({rank})")
        if not any(lora_matrix(k) for k in self.ctx.slot.trainable):
            raise ConfigError("adapter.kind", "hetlora slices LoRA matrices; use adapter.kind lora")
        if min(tiers) < rank:
            refuse_svd_init(self.cfg.adapter, f"hetlora's rank-{min(tiers)} slices of the rank-{rank} LoRA")
            for direction in ("down", "up"):
                if getattr(self.cfg.codec, direction).pack:  # a packed message holds whole tensors of the schema
                    raise ConfigError(f"codec.{direction}.pack", f"hetlora sends rank-{min(tiers)} slices, whose "
                                      "shapes a packed message cannot carry; set it to false")
        tier_of = assign_tiers(self.cfg.partition.num_clients, len(tiers), options.rank_assignment, self.cfg.seed)
        self.tiers = list(tiers)
        self.client_ranks = [int(tiers[t]) for t in tier_of]
        self._round_ranks: list[int] = []

    def configure_train(self, round_idx: int, clients: Sequence[int], global_state: State) -> list[ClientTask]:
        tasks = super().configure_train(round_idx, clients, global_state)
        for task in tasks:
            rank = self.client_ranks[task.client_id]
            task.payload = slice_lora(task.payload, rank)
            task.config["rank"] = rank
        self._round_ranks = [self.client_ranks[c] for c in clients]
        return tasks

    def client_update(self, slot: ModelSlot, data: EncodedData, shard: np.ndarray, task: ClientTask,
                      seed: int, count_flops: bool) -> tuple[ClientResult, TrainStats]:
        """Train the rank-r_c LoRA: the padding is zero, and zero A rows / B columns get zero gradient."""
        shapes = {k: slot.params[k].shape for k in task.payload}
        full = replace(task, payload=pad_lora(task.payload, shapes))
        result, stats = train_client(slot, data, shard, full, self.cfg.client, seed, count_flops)
        result.update = slice_lora(result.update, int(task.config["rank"]))
        return result, stats

    def aggregate(self, round_idx: int, global_state: State, results: Sequence[ClientResult]) -> State:
        shapes = {k: v.shape for k, v in global_state.items()}
        padded = [replace(r, update=pad_lora(r.update, shapes)) for r in results]
        return super().aggregate(round_idx, global_state, padded)

    def round_metrics(self, round_idx: int, global_state: State) -> dict[str, Any]:
        return {**super().round_metrics(round_idx, global_state), "client_ranks": list(self._round_ranks)}
