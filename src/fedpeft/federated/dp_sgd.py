"""Local differential privacy on the client: DP-SGD (Abadi et al. 2016) through Opacus.

FedTT Sec. 5.6 and App. D (after Sun et al. 2024) run DP-SGD *locally* on every client, so the
server never sees anything that is not already private. One step on client i:

1. draw a Poisson sample of its shard, each example kept with probability q = batch_size / n_i
   (the sampling the accountants assume; a step may see zero examples and still adds noise);
2. per-sample gradients g_j of the example's own loss (Opacus's hooks: registered grad samplers for
   ``nn.Linear``/``LayerNorm``/``Embedding``, ``torch.func`` (functorch) for any other module that owns
   trainable parameters, e.g. our tensor-train layers);
3. ``g = (sum_j clip(g_j, C) + N(0, sigma^2 C^2 I)) / batch_size`` (App. D's noisy sum; Opacus's
   ``DPOptimizer``), then the client's optimizer steps on g.

Post-processing of g costs no privacy, so FedProx's proximal gradient ``mu (w - w_0)`` and
``client.grad_clip`` are applied to the noisy g. The noise multiplier sigma comes from the target
(epsilon, delta) for the client's steps over the whole run (:mod:`fedpeft.federated.privacy`), and
every noisy step is counted by the client's Opacus accountant (the optimizer's step hook).

Which adapters qualify (:func:`per_sample_gradient_problems` checks it before training): every
trainable parameter must belong to a module that Opacus sees called on batch-first inputs, so
that per-sample gradients exist and sum to the batch gradient. LoRA (PEFT), FeDeRA, FFA-LoRA,
RoLoRA, HetLoRA, FLASC, head pruning, BitFit, Houlsby and tensor-train adapters (FedTT, FedTT+)
qualify. Opacus cannot handle: ``full`` fine-tuning of BERT-family models (the position
embedding is looked up with one (1, L) id tensor shared by the whole batch, so its "per-sample"
gradient has batch size 1), ``ia3`` (PEFT keeps the scaling vectors in a ``ParameterDict`` read
inside the layer's forward, never called as a module, so no hook sees them), ``prompt_tuning`` and
``p_tuning_v2`` (their parameters enter through forward hooks and the attention cache, not through
a module called on the batch), and multiple-choice heads (the model flattens example x choice
into rows, so "samples" would be rows, not examples).
"""

from __future__ import annotations

import secrets
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from fedpeft.seeding import derive_seed

if TYPE_CHECKING:  # Opacus is imported where DP runs: every other run starts without it
    from opacus.accountants import IAccountant
    from opacus.optimizers import DPOptimizer


@dataclass
class ClientPrivacy:
    """One client's DP-SGD settings and its own Opacus accountant (client-side state)."""

    noise_multiplier: float
    sample_rate: float
    clip_norm: float
    expected_batch_size: int
    accountant: IAccountant
    noise_seed: int | None = None


def poisson_batches(num_examples: int, sample_rate: float, steps: int, generator: torch.Generator
                    ) -> Iterator[list[int]]:
    """``steps`` Poisson samples of local positions: each example independently with ``sample_rate``."""
    for _ in range(steps):
        yield torch.nonzero(torch.rand(num_examples, generator=generator) < sample_rate).flatten().tolist()


def noise_generator(privacy: ClientPrivacy, seed: int, device: torch.device) -> torch.Generator:
    """From OS entropy, or, with ``noise_seed`` set (reproducible experiments only: the seed reveals
    the noise), from it and the client's training seed ``seed``; on the parameters' ``device``,
    where Opacus draws the noise."""
    if privacy.noise_seed is None:
        return torch.Generator(device).manual_seed(secrets.randbits(63))
    return torch.Generator(device).manual_seed(derive_seed(seed, "dp_sgd_noise", privacy.noise_seed))


@contextmanager
def private_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, privacy: ClientPrivacy, seed: int,
                      post_process: Callable[[], None] | None = None) -> Iterator[DPOptimizer]:
    """Attach Opacus's per-sample-gradient hooks to ``model`` and wrap ``optimizer`` for DP-SGD.

    Each ``step()`` clips, noises and averages the per-sample gradients, counts the step in the
    client's accountant, runs ``post_process`` on the noisy gradient, then steps ``optimizer``.
    The hooks and per-sample buffers are removed on exit, so the shared model is left as it was.
    """
    from opacus.grad_sample.grad_sample_module import GradSampleHooks
    from opacus.optimizers import DPOptimizer

    hooks = GradSampleHooks(model, batch_first=True, loss_reduction="mean", strict=True)
    account = privacy.accountant.get_optimizer_hook_fn(sample_rate=privacy.sample_rate)

    def after_noise(dp: DPOptimizer) -> None:
        account(dp)
        if post_process is not None:
            post_process()

    dp_optimizer = DPOptimizer(optimizer, noise_multiplier=privacy.noise_multiplier, max_grad_norm=privacy.clip_norm,
                               expected_batch_size=privacy.expected_batch_size, loss_reduction="mean",
                               generator=noise_generator(privacy, seed, optimizer.param_groups[0]["params"][0].device),
                               secure_mode=privacy.noise_seed is None)
    dp_optimizer.attach_step_hook(after_noise)
    try:
        yield dp_optimizer
    finally:
        hooks.cleanup()
        for group in optimizer.param_groups:
            for param in group["params"]:
                param.summed_grad = None
                del param.summed_grad


def backward(loss: torch.Tensor) -> None:
    """``loss.backward()`` without torch's warning that a full backward hook fires on a module whose
    inputs need no gradient: the first adapter layer's input comes from the frozen backbone, and
    its output gradient is all Opacus's hook needs."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Full backward hook is firing", category=UserWarning)
        loss.backward()


def private_step(dp_optimizer: DPOptimizer, num_examples: int) -> None:
    """One DP-SGD step after the backward pass of ``num_examples`` examples.

    A parameter this batch did not reach has a zero gradient for every example (its update is pure
    noise); with ``num_examples == 0`` (an empty Poisson sample) every update is, and the step is
    still noised and counted, as the accountant assumes.
    """
    for param in dp_optimizer.params:
        if getattr(param, "grad_sample", None) is None:
            param.grad_sample = param.new_zeros((num_examples, *param.shape))
    dp_optimizer.step()


def per_sample_gradient_problems(model: nn.Module, batch: dict[str, torch.Tensor], num_examples: int,
                                 loss_fn: Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor]
                                 ) -> dict[str, str]:
    """Trainable parameter -> why Opacus's per-sample gradients are wrong for it (empty: all exact).

    Runs one forward/backward on ``batch`` (``num_examples`` examples) with Opacus's hooks and
    checks that every trainable parameter got one gradient per example and that they sum to the
    ordinary batch gradient (the loss is a mean over examples). RNG state and gradients are left
    as they were.
    """
    from opacus.grad_sample.grad_sample_module import GradSampleHooks

    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    was_training = model.training
    problems: dict[str, str] = {}
    with torch.random.fork_rng():
        model.train()
        try:
            hooks = GradSampleHooks(model, batch_first=True, loss_reduction="mean", strict=True)
        except NotImplementedError as err:
            return {"(model)": f"Opacus rejects the model: {err}"}
        try:
            for p in params.values():
                p.grad = None
            backward(loss_fn(model, batch))
            for name, p in params.items():
                problem = _grad_sample_problem(p, num_examples)
                if problem is not None:
                    problems[name] = problem
        except Exception as err:  # any failure inside Opacus's hooks means no DP-SGD for this model
            problems["(backward)"] = f"{type(err).__name__}: {err}"
        finally:
            hooks.cleanup()
            for p in params.values():
                p.grad = None
            model.train(was_training)
    return problems


def _grad_sample_problem(param: nn.Parameter, num_examples: int) -> str | None:
    samples = getattr(param, "grad_sample", None)
    if param.grad is None:
        return None  # not used by this forward (e.g. a frozen branch): nothing to privatize
    if samples is None:
        return "no per-sample gradient (the parameter is not used through a module Opacus can hook)"
    if isinstance(samples, list):
        samples = torch.cat(samples)
    if samples.shape[0] != num_examples:
        return f"per-sample gradients for {samples.shape[0]} samples, but the batch has {num_examples} examples"
    total = samples.sum(0) / num_examples
    tolerance = 1e-4 * (1.0 + float(param.grad.abs().max()))
    if float((total - param.grad).abs().max()) > tolerance:
        return "per-sample gradients do not sum to the batch gradient"
    return None
