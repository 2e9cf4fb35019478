"""The round logic of a method: select, configure clients, train locally, aggregate.

:class:`Algorithm` is the FedAvg-family default (the global trainable state goes down, client
updates come up, the configured strategy aggregates). A method that needs more (masks,
frozen factors, head pruning, control variates) subclasses it and registers under a name that
its recipe refers to; engines only ever call these hooks, so they never know the method.
Server hooks run in the server process; :meth:`Algorithm.client_update` runs wherever the
client runs (another rank, another machine), so it may use only its arguments, what the
constructor built from the config, and the client's :meth:`Algorithm.device_state`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from pydantic import BaseModel

from fedpeft.config import ConfigError, ExperimentConfig, StrategyConfig, refuse_unread
from fedpeft.data.types import TaskData
from fedpeft.federated.client import ModelSlot, TrainStats, train_client
from fedpeft.federated.selection import build_selector
from fedpeft.federated.strategy import OPTIMIZER_FIELDS, STRATEGIES, build_strategy
from fedpeft.federated.types import ClientResult, ClientTask, State
from fedpeft.models.backbone import Backbone
from fedpeft.models.encoding import EncodedData


@dataclass
class MethodContext:
    """What a method may look at when it is built: the model, the task and the shards (per client,
    the rows of ``train_data`` it trains on)."""

    backbone: Backbone
    slot: ModelSlot
    task: TaskData
    shards: Sequence[np.ndarray]
    train_data: EncodedData


class Algorithm:
    """FedAvg-family round logic; subclass and override hooks for a method's specifics.

    ``robust_aggregations`` lists the ``strategy.robust`` options the method's aggregation honours
    (all of them when it aggregates through the strategy); any other is rejected up front.
    ``server_dp`` says whether it aggregates through ``strategy.aggregate``, where the server's DP
    (FedAdamW's clipping and noise) happens; a method that does not refuses a DP strategy.
    ``strategy_options`` are the models of the method's own ``strategy.*`` fields (the section allows
    extras for them; :func:`check_strategy_fields` refuses any that no model names);
    ``optimizer_fields`` the server-optimiser fields of ``StrategyConfig`` its own server step reads.
    """

    name: ClassVar[str] = "default"
    robust_aggregations: ClassVar[tuple[str, ...]] = ("none", "clip", "median", "trimmed_mean")
    server_dp: ClassVar[bool] = True
    strategy_options: ClassVar[tuple[type[BaseModel], ...]] = ()
    optimizer_fields: ClassVar[frozenset[str]] = frozenset()  # OPTIMIZER_FIELDS its own server reads

    def __init__(self, cfg: ExperimentConfig, ctx: MethodContext) -> None:
        if cfg.strategy.robust not in self.robust_aggregations:
            raise ConfigError("strategy.robust", f"method {cfg.method!r} aggregates with its own rule and supports "
                              f"only: {', '.join(self.robust_aggregations)} (got {cfg.strategy.robust!r})")
        self.cfg = cfg
        self.ctx = ctx
        self.strategy = build_strategy(cfg.strategy)
        self.selector = build_selector(cfg.strategy.selection, cfg.partition.num_clients)
        private = self.strategy.server_privacy(0, cfg.clients_per_round(), cfg.partition.num_clients) is not None
        if private and not self.server_dp:
            raise ConfigError("strategy.dp_clip_norm", f"method {cfg.method!r} aggregates with its own rule, which "
                              "the server's DP clipping and noise never reach; set it to 0")

    def attach_run_dir(self, run_dir: Path) -> None:
        """The run's directory, where a method may keep per-client state on disk (nothing by default)."""

    def initial_state(self, state: State) -> State:
        """The global state before round 1 (the adapter's initialisation by default)."""
        return state

    def select(self, round_idx: int, rng: np.random.Generator) -> list[int]:
        return self.selector.select(round_idx, self.cfg.clients_per_round(), rng)

    def configure_train(self, round_idx: int, clients: Sequence[int], global_state: State) -> list[ClientTask]:
        config = self.strategy.client_config()
        return [ClientTask(client_id=c, payload=global_state, config=dict(config)) for c in clients]

    def client_update(self, slot: ModelSlot, data: EncodedData, shard: np.ndarray, task: ClientTask,
                      seed: int, count_flops: bool) -> tuple[ClientResult, TrainStats]:
        """Runs on the client (in whichever engine): local training by default."""
        return train_client(slot, data, shard, task, self.cfg.client, seed, count_flops)

    def device_state(self, client_id: int) -> State | None:
        """What the device of ``client_id`` keeps between its rounds (None: nothing).

        Device-side memory must live here, not in server-side attributes: engines that run
        clients in other processes move it with the client (torchrun) or keep it on the device
        (Flower's node state), and the server never reads it.
        """
        return None

    def load_device_state(self, client_id: int, state: State | None) -> None:
        """Restore (or, with None, forget) what :meth:`device_state` returned for ``client_id``."""

    def extra_upload_shapes(self, task: ClientTask) -> dict[str, torch.Size]:
        """Non-parameter tensors a reply to ``task`` carries besides its updates (e.g. per-head
        scores), with their shapes: the engine's reply validation accepts exactly these extras."""
        return {}

    def aggregate(self, round_idx: int, global_state: State, results: Sequence[ClientResult]) -> State:
        return self.strategy.aggregate(global_state, results)

    def observe(self, round_idx: int, results: Sequence[ClientResult], eval_metrics: dict[str, float]) -> None:
        self.selector.observe(round_idx, results, eval_metrics)

    def round_metrics(self, round_idx: int, global_state: State) -> dict[str, Any]:
        """Method-specific values logged with the round (densities, active factors, ...)."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {"strategy": self.strategy.state_dict(), "selector": self.selector.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.strategy.load_state_dict(state.get("strategy", {}))
        self.selector.load_state_dict(state.get("selector", {}))


ALGORITHMS: dict[str, type[Algorithm]] = {"default": Algorithm}


def register_algorithm(cls: type[Algorithm]) -> type[Algorithm]:
    ALGORITHMS[cls.name] = cls
    return cls


def check_strategy_fields(cfg: ExperimentConfig, algorithm: str, given: set[str]) -> None:
    """Refuse a ``strategy.*`` field the user ``given`` that neither the method's algorithm nor the
    strategy reads: an extra field no options model names (:func:`fedpeft.config.refuse_unread`), or a
    server-optimiser field (:data:`OPTIMIZER_FIELDS`) set away from its default for a server that never
    reads it. A given value equal to the default changes nothing (a resolved config holds them all)."""
    if algorithm not in ALGORITHMS or cfg.strategy.name not in STRATEGIES:
        return  # an unknown algorithm or strategy is named by its own error
    method, strategy = ALGORITHMS[algorithm], STRATEGIES[cfg.strategy.name]
    owner = f"method {cfg.method!r} with strategy {cfg.strategy.name!r}"
    refuse_unread("strategy", given, cfg.strategy.model_extra or {},
                  (*method.strategy_options, *strategy.strategy_options), owner, StrategyConfig.model_fields)
    read = method.optimizer_fields | strategy.optimizer_fields
    for field in sorted(given & OPTIMIZER_FIELDS - read):
        value = getattr(cfg.strategy, field)
        if value == StrategyConfig.model_fields[field].default:
            continue
        readers = sorted(name for name, cls in STRATEGIES.items() if field in cls.optimizer_fields)
        raise ConfigError(f"strategy.{field}", f"{owner} never reads it, so {value} would change nothing; "
                          f"it is read by strategy {' or '.join(readers)} (set strategy.name), or remove it")


def build_algorithm(name: str, cfg: ExperimentConfig, ctx: MethodContext) -> Algorithm:
    if name not in ALGORITHMS:
        raise ConfigError("method", f"recipe {cfg.method!r} needs algorithm {name!r}, which is not registered")
    return ALGORITHMS[name](cfg, ctx)
