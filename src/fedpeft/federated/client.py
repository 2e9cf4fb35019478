"""Local training on one client's shard.

There is one model in memory (:class:`ModelSlot`); a client's state is loaded into it, trained
and read back out, so memory does not grow with the number of clients. The optimizer is built
fresh for every client and round (its state is reset), as the papers' clients do. With
``client.dp`` the same loop runs DP-SGD (:mod:`fedpeft.federated.dp_sgd`): Poisson batches,
per-example clipping and noise, for whichever method called it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import fedpeft.metrics.flops  # noqa: F401  (lets FlopCounterMode see CPU fused attention)
from fedpeft.config import ClientConfig
from fedpeft.devices import Placement
from fedpeft.federated.dp_sgd import backward, poisson_batches, private_optimizer, private_step
from fedpeft.federated.types import ClientResult, ClientTask, State
from fedpeft.models.encoding import EncodedData, example_mean_loss, training_batch


class ModelSlot:
    """The shared model plus fast access to its parameters by name.

    The model lives on ``placement.device`` (see :mod:`fedpeft.devices`); states go in from the CPU
    (:meth:`load`) and come back out on the CPU (:meth:`read`): the server never holds a device tensor.
    """

    def __init__(self, model: nn.Module, trainable: Sequence[str], placement: Placement | None = None) -> None:
        self.model = model
        self.params: dict[str, nn.Parameter] = dict(model.named_parameters())
        self.trainable = list(trainable)
        self.placement = placement or Placement()

    @property
    def device(self) -> torch.device:
        return self.placement.device

    @torch.no_grad()
    def load(self, state: State) -> None:
        for key, value in state.items():
            self.params[key].copy_(value)

    def read(self, keys: Sequence[str] | None = None) -> State:
        """CPU copies of the parameters ``keys`` (default: the trainable ones)."""
        return {k: self.params[k].detach().to("cpu", copy=True) for k in (self.trainable if keys is None else keys)}

    def snapshot(self, keys: Sequence[str]) -> State:
        """Copies of the parameters ``keys`` on the model's device (a client's reference point)."""
        return {k: self.params[k].detach().clone() for k in keys}

    def set_trainable(self, keys: Sequence[str] | frozenset[str] | None) -> list[nn.Parameter]:
        """Enable gradients on ``keys`` (default: all trainable), disable on the other trainable ones."""
        active = set(self.trainable if keys is None else keys)
        for name in self.trainable:
            self.params[name].requires_grad_(name in active)
        return [self.params[n] for n in self.trainable if n in active]


def build_optimizer(params: list[nn.Parameter], cfg: ClientConfig, lr: float | None = None) -> torch.optim.Optimizer:
    lr = cfg.lr if lr is None else lr
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=lr, betas=cfg.betas, weight_decay=cfg.weight_decay)


def batches(num_examples: int, batch_size: int, steps: int, generator: torch.Generator) -> Iterator[list[int]]:
    """``steps`` mini-batches of local positions, reshuffling at each pass over the shard."""
    produced = 0
    while produced < steps:
        order = torch.randperm(num_examples, generator=generator).tolist()
        for start in range(0, num_examples, batch_size):
            yield order[start : start + batch_size]
            produced += 1
            if produced == steps:
                return


def local_steps(num_examples: int, cfg: ClientConfig) -> int:
    if cfg.local_steps is not None:
        return cfg.local_steps
    return cfg.local_epochs * math.ceil(num_examples / cfg.batch_size)


@dataclass
class TrainStats:
    """Where a client's time went: ``step_seconds`` is forward + backward + optimizer only."""

    steps: int = 0
    step_seconds: float = 0.0
    total_seconds: float = 0.0
    flops_per_step: int | None = None
    losses: list[float] = field(default_factory=list)


def train_client(slot: ModelSlot, data: EncodedData, shard: np.ndarray, task: ClientTask, cfg: ClientConfig,
                 seed: int, count_flops: bool = False) -> tuple[ClientResult, TrainStats]:
    """Load ``task.payload``, train on ``shard``, return the update of the upload keys."""
    start_time = time.perf_counter()
    slot.load(task.payload)
    params = slot.set_trainable(task.train_keys)
    train_names = [n for n in slot.trainable if slot.params[n].requires_grad]
    upload = sorted(task.upload_keys if task.upload_keys is not None else train_names)
    start = slot.snapshot(sorted(set(upload) | set(train_names)))
    optimizer = build_optimizer(params, cfg, task.config.get("lr"))
    mu = float(task.config.get("proximal_mu", 0.0))
    anchors = [start[n] for n in train_names] if mu > 0 else []
    counts = np.bincount([int(data.labels[i]) for i in shard]) if cfg.logit_adjustment > 0 else None

    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    scaler = slot.placement.grad_scaler()
    stats = TrainStats()
    slot.model.train()
    steps = int(task.config.get("local_steps") or local_steps(len(shard), cfg))
    dp = task.privacy
    if dp is None:
        schedule = batches(len(shard), cfg.batch_size, steps, generator)
        private = nullcontext(optimizer)
    else:  # DP-SGD: the proximal gradient and grad_clip post-process the noisy gradient
        schedule = poisson_batches(len(shard), dp.sample_rate, steps, generator)
        private = private_optimizer(slot.model, optimizer, dp, seed,
                                    lambda: _post_process(params, anchors, mu, cfg.grad_clip))
    with private as step_optimizer:
        for positions in schedule:
            t0 = time.perf_counter()
            if not positions:  # an empty Poisson sample: DP-SGD still adds its noise
                private_step(step_optimizer, 0)
                stats.step_seconds += time.perf_counter() - t0
                stats.steps += 1
                continue
            batch = training_batch(data, [int(shard[p]) for p in positions])
            counter = FlopCounterMode(display=False) if count_flops and stats.flops_per_step is None else None
            with counter if counter is not None else nullcontext():
                step_optimizer.zero_grad(set_to_none=True)
                if dp is None:
                    loss = (slot.model(**batch).loss if counts is None
                            else logit_adjusted_loss(slot.model, batch, counts, cfg.logit_adjustment))
                    objective = loss
                    if mu > 0:
                        objective = loss + 0.5 * mu * sum(((p - a) ** 2).sum() for p, a in zip(params, anchors))
                    (objective if scaler is None else scaler.scale(objective)).backward()
                else:
                    loss = example_mean_loss(slot.model, data, batch)
                    backward(loss)
            if dp is not None:
                private_step(step_optimizer, len(positions))
            else:
                if scaler is not None:  # fp16: clip the true gradient
                    scaler.unscale_(step_optimizer)
                if cfg.grad_clip is not None:
                    torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
                if scaler is None:
                    step_optimizer.step()
                else:  # skips a step whose gradients overflowed, and adapts the loss scale
                    scaler.step(step_optimizer)
                    scaler.update()
            stats.step_seconds += time.perf_counter() - t0
            if counter is not None:
                stats.flops_per_step = int(counter.get_total_flops())
            stats.losses.append(float(loss.detach()))
            stats.steps += 1

    with torch.no_grad():
        update = {k: (slot.params[k].detach() - start[k]).cpu() for k in upload}
    slot.set_trainable(None)
    stats.total_seconds = time.perf_counter() - start_time
    result = ClientResult(
        client_id=task.client_id,
        update=update,
        num_samples=len(shard),
        train_loss=float(np.mean(stats.losses)) if stats.losses else float("nan"),
        metrics={"steps": float(stats.steps)},
    )
    return result, stats


def logit_adjusted_loss(model: nn.Module, batch: dict[str, torch.Tensor], counts: np.ndarray,
                        tau: float) -> torch.Tensor:
    """Cross-entropy of ``logits + tau * log(prior)`` (``client.logit_adjustment``): the logit-adjusted
    loss of Menon et al. (2021, Eq. 11; tau = 1 is Ren et al.'s balanced softmax), with the prior
    counted on the client's own shard, as FedLC (Zhang et al., 2022) calibrates each client's logits by
    its local label distribution under label skew. A class the client over-represents already has its
    share of the logit, so its examples push the shared model's boundary, not its bias; evaluation reads
    the raw logits (the prior-free, balanced decision). Add-one smoothing keeps a class the client
    lacks finite (``counts``: the shard's labels counted; classes past its largest label count 0).
    It needs steps that scale with the gradient (SGD): Adam rescales a one-class client's small
    gradients to full-size steps (on MPQA, LoRA with it under AdamW still ended at one class on every
    seed; with SGD at 0.83; benchmarks/results/first_run_adjusted.md)."""
    inputs = {key: value for key, value in batch.items() if key != "labels"}
    logits = model(**inputs).logits.float()
    full = np.zeros(logits.shape[-1])
    full[: len(counts)] = counts
    prior = torch.as_tensor((full + 1) / (full.sum() + len(full)), dtype=torch.float32, device=logits.device)
    return nn.functional.cross_entropy(logits + tau * prior.log(), batch["labels"])


@torch.no_grad()
def _post_process(params: list[nn.Parameter], anchors: list[torch.Tensor], mu: float, grad_clip: float | None) -> None:
    """FedProx's proximal gradient mu (w - w_0) and ``client.grad_clip`` on an already-private gradient."""
    if mu > 0:
        for p, a in zip(params, anchors):
            p.grad.add_(p.detach() - a, alpha=mu)
    if grad_clip is not None:
        torch.nn.utils.clip_grad_norm_(params, grad_clip)
