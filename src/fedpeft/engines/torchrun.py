"""The torchrun engine: K processes share each round's clients.

``torchrun --nproc-per-node K -m fedpeft run CONFIG`` (with ``engine.kind: torchrun``) starts K
ranks; each prepares the experiment, so each holds one frozen backbone. Rank 0 runs the shared
round loop (selection, configuration, reply validation, aggregation, evaluation, metrics and
checkpoints); its transport scatters each round's wire tasks (task i to rank i mod K), every rank
serves its share with :func:`serve_task`, and the replies are gathered back to rank 0 in task
order, so the aggregation sees exactly what the local engine would. Workers wait for the next
command in between; rank 0 sends ``stop`` at the end (also when it fails).

Gather, not all_reduce: aggregation belongs to the method (coordinate medians, Eq. 8 head
weights, DP clipping, control variates all need each client's update), so rank 0 needs the
individual replies; they are adapter-sized codec messages. A client's device-side memory
(:func:`~fedpeft.engines.protocol.device_state`: the method's, and its DP-SGD accountant under
``client.dp``) travels with its task from rank 0 and back, so any rank can serve any client and
rank 0's checkpoint holds everything a resume needs.

Collectives use gloo on CPU and NCCL when the backbone sits on a CUDA device (``engine.backend``
overrides). Several machines: the same command on each with ``--nnodes N --node-rank i
--rdzv-backend c10d --rdzv-endpoint HOST:PORT`` (see the README).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from fedpeft.config import ConfigError, ExperimentConfig
from fedpeft.engines.protocol import Outcome, WireTask, device_state, load_device_state, serve_task
from fedpeft.engines.rounds import evaluate_on_shards
from fedpeft.experiment import Experiment
from fedpeft.federated.types import State

TRAIN = "train"
STOP = "stop"


@dataclass
class RankTask:
    """A wire task plus the client's device state (None: it has none yet)."""

    wire: WireTask
    device_state: State | None


def process_rank() -> int:
    """This process's global rank under torchrun (0 when started on its own)."""
    return int(os.environ.get("RANK", "0"))


def collective_backend(cfg: ExperimentConfig, exp: Experiment) -> str:
    if cfg.engine.backend == "nccl" and not torch.cuda.is_available():
        raise ConfigError("engine.backend", "nccl needs CUDA, which this machine lacks; use gloo or auto")
    if cfg.engine.backend != "auto":
        return cfg.engine.backend
    on_cuda = any(p.is_cuda for p in exp.slot.params.values())
    return "nccl" if on_cuda else "gloo"


def check_launched() -> None:
    """Fail early, before any model is built, when this process was not started by torchrun."""
    if "WORLD_SIZE" not in os.environ or "MASTER_ADDR" not in os.environ:
        raise ConfigError("engine.kind", "torchrun: start it with `torchrun --nproc-per-node K -m fedpeft run CONFIG`")


@contextmanager
def process_group(cfg: ExperimentConfig, exp: Experiment) -> Iterator[int]:
    """Join the torchrun job (environment rendezvous) for the duration; yields this rank."""
    check_launched()
    backend = collective_backend(cfg, exp)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    # Workers wait in a collective while rank 0 evaluates and checkpoints: allow long rounds.
    dist.init_process_group(backend=backend, timeout=timedelta(hours=6))
    try:
        yield dist.get_rank()
    finally:
        dist.destroy_process_group()


def serve_share(exp: Experiment, share: Sequence[RankTask], keep_device_state: bool) -> list[tuple[Outcome, Any]]:
    """Serve this rank's tasks; each reply goes back with the client's device state after training."""
    replies: list[tuple[Outcome, Any]] = []
    for item in share:
        cid = item.wire.client_id
        load_device_state(exp, cid, item.device_state)
        outcome = serve_task(exp, item.wire)
        replies.append((outcome, device_state(exp, cid)))
        if not keep_device_state:  # rank 0 is the keeper; a worker forgets what it served
            load_device_state(exp, cid, None)
    return replies


def _scatter(inputs: list[tuple[str, list[RankTask]]] | None) -> tuple[str, list[RankTask]]:
    """Rank 0 gives ``inputs[r]`` (a command and a share of tasks) to rank r; every rank returns its own."""
    received: list[Any] = [None]
    dist.scatter_object_list(received, inputs, src=0)
    return received[0]


class TorchrunTransport:
    """Rank 0's transport: scatter the tasks, serve rank 0's share, gather every reply in task order."""

    def __init__(self, exp: Experiment) -> None:
        self.exp = exp
        self.world_size = dist.get_world_size()
        self.closed = False

    def train(self, round_idx: int, tasks: Sequence[WireTask]) -> list[Outcome]:
        shares: list[list[RankTask]] = [[] for _ in range(self.world_size)]
        for i, wire in enumerate(tasks):
            shares[i % self.world_size].append(RankTask(wire, device_state(self.exp, wire.client_id)))
        _, mine = _scatter([(TRAIN, share) for share in shares])
        gathered: list[Any] = [None] * self.world_size
        dist.gather_object(serve_share(self.exp, mine, keep_device_state=True), gathered, dst=0)
        outcomes: list[Outcome | None] = [None] * len(tasks)
        for rank, replies in enumerate(gathered):
            for j, (outcome, state) in enumerate(replies):
                outcomes[rank + j * self.world_size] = outcome
                load_device_state(self.exp, outcome.client_id, state)
        return [o for o in outcomes if o is not None]

    def evaluate_clients(self, round_idx: int, state: State, clients: Sequence[int]) -> dict[int, dict[str, float]]:
        return evaluate_on_shards(self.exp, state, clients)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            _scatter([(STOP, [])] * self.world_size)


def serve_until_stopped(exp: Experiment) -> None:
    """A worker rank: serve each round's share until rank 0 says stop."""
    while True:
        command, share = _scatter(None)
        if command == STOP:
            return
        dist.gather_object(serve_share(exp, share, keep_device_state=False), None, dst=0)
