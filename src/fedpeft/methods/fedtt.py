"""FedTT+ (Ghiasvand et al., "Communication-Efficient and Tensorized Federated Fine-Tuning of
Large Language Models", Alg. 2): round-robin freezing of tensor-train cores.

FedTT (Alg. 1) needs no code of its own: the ``fedtt`` recipe is the TT adapter
(:mod:`fedpeft.adapters.tt`) with the default FedAvg round, which averages every core separately.
Averaging cores separately is not averaging the clients' products (Eq. 2); FedTT+ removes most
of the cross terms by training, in round t, only G_1, G_r and G_J of every TT adapter layer:

    r - 1 = mod(t, J - 2)         (Alg. 2, line 3)

The other cores stay frozen, hence identical on all clients, and only the trained cores and the
classification head are uploaded and averaged (lines 5-10). The adapters' biases are frozen at
their initial values: Alg. 2 trains and sends only {G_1, G_r, G_J} (+ the always-trainable head),
and the paper's parameter counts (Table 1: 0.02M for FedTT+ vs 0.06M for FedTT on DeBERTa-base;
Tables 12, 14) only add up without the 24 x (64 + 768) adapter biases. ``strategy.train_adapter_biases:
true`` trains and uploads them every round as well (FedTT's trainable set minus the frozen cores).

Choices, with reasons:
- Index convention. Read with 1-based cores, ``r = mod(t, J-2) + 1`` would give r = 1 (= G_1)
  whenever t is a multiple of J-2, contradicting "r in {2, ..., J-1}" in the text. The formula
  is consistent with 0-based cores (middle cores 1..J-2), so we take r = mod(t, J-2) + 2 in the
  paper's 1-based numbering: t = 1, 2, ... visits G_3, G_4, ..., G_{J-1}, G_2, G_3, ...
- Layers with J <= 3 cores have no core to freeze (J = 3: r is always 2); all their cores train.
- The classification head is "always trainable" (Sec. 4.3); we read this as covering a
  tensorized classifier too: every core of ``adapter.tt_classifier``'s layer trains every round.
- Downlink: Alg. 2 line 11 sends only the cores updated in the round: the clients keep the rest
  from earlier rounds. With ``strategy.partial_download`` (default: on in cross-silo mode,
  ``selection: all``, the setting of Alg. 2) each device keeps its copy of the global state it
  last received (device-side state: it moves with the client in every engine) and the server sends
  it only the keys that changed since then (exactly G_1, G_r, G_J of the previous round and the
  head when it took part in that round); a client the server has no reply from yet gets the whole
  state. Cross-device (a random subset each round) clients are stateless by default and download
  the whole TT state, whose frozen cores are the server's, identical for every client. The server
  learns which state a client holds only from the replies it aggregated, so a lost reply costs a
  larger download, never a wrong model. The uplink is exactly Alg. 2's: the trained cores and the head.
- Aggregation is the configured strategy (FedAvg, sample-weighted, in the recipe), per key over
  the clients that sent it, so frozen cores are never touched by the server.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict

from fedpeft.adapters.tt import tt_layers
from fedpeft.config import ConfigError, ExperimentConfig
from fedpeft.federated.algorithm import Algorithm, MethodContext, register_algorithm
from fedpeft.federated.client import ModelSlot, TrainStats
from fedpeft.federated.strategy.fedadamw import validate_options
from fedpeft.federated.types import ClientResult, ClientTask, State
from fedpeft.models.encoding import EncodedData


class FedTTPlusOptions(BaseModel):
    """FedTT+'s own knobs in the ``strategy`` section."""

    model_config = ConfigDict(extra="ignore")

    train_adapter_biases: bool = False  # Alg. 2: biases frozen; true: trained and sent every round
    partial_download: bool | None = None  # Alg. 2 line 11: send only what changed; None: on when cross-silo


def round_robin_core(round_idx: int, num_cores: int) -> int | None:
    """The middle core G_r (1-based) trained in round ``round_idx`` (1-based t): r = mod(t, J-2) + 2.
    None when the layer has no middle core (J <= 2)."""
    if num_cores <= 2:
        return None
    return round_idx % (num_cores - 2) + 2


def trainable_cores(round_idx: int, num_cores: int) -> tuple[int, ...]:
    """The cores (1-based) trained in round ``round_idx``: {1, r, J} (Alg. 2, line 5)."""
    middle = round_robin_core(round_idx, num_cores)
    return tuple(sorted({1, num_cores} | ({middle} if middle is not None else set())))


@register_algorithm
class FedTTPlus(Algorithm):
    """Alg. 2: per round, G_1, G_r, G_J of every TT adapter layer (+ the head) train and go up."""

    name = "fedtt_plus"
    strategy_options = (FedTTPlusOptions,)

    def __init__(self, cfg: ExperimentConfig, ctx: MethodContext) -> None:
        super().__init__(cfg, ctx)
        self.options: FedTTPlusOptions = validate_options(FedTTPlusOptions, cfg.strategy.model_extra or {},
                                                          "strategy")
        layers = tt_layers(ctx.backbone.model)
        if not layers:
            raise ConfigError("adapter.kind", "fedtt_plus freezes tensor-train cores; use adapter.kind tt")
        trainable = set(ctx.slot.trainable)
        # Round-robin layers: every TT layer of an adapter (the classifier's trains fully).
        self.round_robin: dict[str, int] = {
            name: layer.num_cores for name, layer in layers.items()
            if ".adapter." in f".{name}." and all(f"{name}.cores.{j}" in trainable for j in range(layer.num_cores))
        }
        self.frozen_biases = frozenset() if self.options.train_adapter_biases else frozenset(
            f"{name}.bias" for name in self.round_robin if f"{name}.bias" in trainable)
        partial = self.options.partial_download
        self.partial_download = cfg.strategy.selection == "all" if partial is None else partial
        self.changed_at: dict[str, int] = {}  # server: the last round whose aggregation changed a key
        self.synced: dict[int, int] = {}  # server: the round whose global state a client last received
        self.known: dict[int, State] = {}  # device side: each client's copy of that global state

    def round_keys(self, round_idx: int) -> frozenset[str]:
        """The keys trained and uploaded in ``round_idx``: every trainable key except the frozen cores
        (and, by default, the adapters' biases)."""
        frozen = set(self.frozen_biases)
        for layer, num_cores in self.round_robin.items():
            active = trainable_cores(round_idx, num_cores)
            frozen.update(f"{layer}.cores.{j - 1}" for j in range(1, num_cores + 1) if j not in active)
        return frozenset(k for k in self.ctx.slot.trainable if k not in frozen)

    def configure_train(self, round_idx: int, clients: Sequence[int], global_state: State) -> list[ClientTask]:
        keys = self.round_keys(round_idx)
        tasks = super().configure_train(round_idx, clients, global_state)
        for task in tasks:
            task.train_keys = keys
            task.upload_keys = keys
            since = self.synced.get(task.client_id) if self.partial_download else None
            if since is not None:
                task.payload = {k: v for k, v in global_state.items() if self.changed_at.get(k, 0) >= since}
        return tasks

    def aggregate(self, round_idx: int, global_state: State, results: Sequence[ClientResult]) -> State:
        new_state = super().aggregate(round_idx, global_state, results)
        for key, value in new_state.items():
            if not torch.equal(value, global_state[key]):
                self.changed_at[key] = round_idx
        self.synced.update((r.client_id, round_idx) for r in results)
        return new_state

    # ----- device side -------------------------------------------------------------------------
    def client_update(self, slot: ModelSlot, data: EncodedData, shard: np.ndarray, task: ClientTask,
                      seed: int, count_flops: bool) -> tuple[ClientResult, TrainStats]:
        known = self.known.get(task.client_id)
        current = dict(task.payload) if known is None else {**known, **task.payload}
        missing = set(slot.trainable) - set(current)
        if missing:
            raise ValueError(f"client {task.client_id} holds no copy of {len(missing)} keys the server did not "
                             "resend (its device state was lost); the server resends everything next time")
        if self.partial_download:
            self.known[task.client_id] = {k: v.clone() for k, v in current.items()}
        slot.load(current)
        return super().client_update(slot, data, shard, task, seed, count_flops)

    def device_state(self, client_id: int) -> State | None:
        return self.known.get(client_id)

    def load_device_state(self, client_id: int, state: State | None) -> None:
        if state is None:
            self.known.pop(client_id, None)
        else:
            self.known[client_id] = dict(state)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["fedtt_plus"] = {"changed_at": dict(self.changed_at),
                               "synced": {str(c): r for c, r in self.synced.items()},
                               "known": {str(c): s for c, s in self.known.items()}}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        own = state.get("fedtt_plus", {})
        self.changed_at = dict(own.get("changed_at", {}))
        self.synced = {int(c): int(r) for c, r in own.get("synced", {}).items()}
        self.known = {int(c): dict(s) for c, s in own.get("known", {}).items()}

    def round_metrics(self, round_idx: int, global_state: State) -> dict[str, Any]:
        keys = self.round_keys(round_idx)
        middle = {str(j): round_robin_core(round_idx, j) for j in sorted(set(self.round_robin.values()))}
        return {
            "middle_core_by_num_cores": middle,
            "trained_params": int(sum(global_state[k].numel() for k in keys)),
        }
