"""FedPepTAO (Che et al., EMNLP 2023): partial deep-prompt exchange chosen by layer scores and a Hessian
eigen-gap ratio (Algorithm 1), with adaptive optimisation on device and server (Algorithm 2).

Round flow (registered as algorithm ``fedpeptao``):

* Rounds 1..t (``strategy.selection_round``, default 10): every prompt layer (and the task head) is
  exchanged. A client scores the layers (Eq. 2-3, prompts switched off) on one batch of its data the
  first time it is sampled, and sends the L scores with its reply; the server keeps each client's
  latest scores. Alg. 1 loops over all devices; cross-device, only sampled devices are online, so
  the scores come from every device sampled in rounds 1..t.
* Round t: each sampled client also runs the Hessian test (Alg. 1 lines 3-10, see
  :mod:`.hessian`) at the downloaded w^t and sends its ratio r_i. The server averages the ratios
  and the scores (Eq. 4, weights n_i / N), ranks the layers and keeps the best until the selected
  prompt parameters reach r of all of them (lines 15-19; at least ``min_layers``).
* Rounds > t: only the selected layers and the head cross the wire (the payload and the upload hold
  only those keys, so the codec's bytes shrink). Every client keeps its full prompt on the device:
  its unselected layers continue from its own last local training and never leave it. A client
  sampled for the first time after round t holds no prompt yet and gets the full one once (bytes
  counted). The server's global state keeps the unselected layers as they were at round t; the
  global model evaluated each round is that state.
* Every round: the device trains all its prompt layers and the head with Adam, moments reset (the
  client optimizer is rebuilt each round: Alg. 2 lines 5-9); the server applies Alg. 2 lines 12-25
  (:mod:`.server`) to the exchanged keys, head included.

Client-side state (each device's prompt) and the server's control variate of each device live in
one safetensors file per client under ``RUN_DIR/client_state/`` (:class:`ClientStateStore`), so
memory stays flat in the number of clients; the checkpoint holds only which file version of each
client is current, beside the small server state (momentum, previous update, scores, selection).
The per-client probe results travel inside the upload message, so their bytes are
counted: ``fedpeptao.layer_scores`` (L floats, Eq. 3) and ``fedpeptao.ratio_probe`` (r_i, the
secant Lipschitz estimate, the extreme Hessian eigenvalues, whether they are exact, the Lanczos steps,
whether the ratio converged); the server takes them out before aggregating and records them in the
selection round's metrics (``ratio_probes``, ``lambda_min``, ``lambda_max``, ``lipschitz``) beside the
averaged ``ratio`` and the ``selected_layers``, so that a reader can redo Alg. 1's arithmetic.

Evaluation: the paper evaluates on the tasks' dev/test sets without saying which model; we
evaluate the global state (selected layers as aggregated, the others as of round t). The authors'
released code evaluates personalised models instead (each device's own prompt with the global
selected layers): with ``personalized_eval`` each sampled device that already holds a prompt
evaluates that model on its own shard before it trains (device-side, so in every engine), and the
round records ``personalized_eval`` (per client) and ``personalized_mean`` beside the global eval.

Options (``strategy.*``; ``server_lr`` is eta^1 and ``server_momentum`` beta): ``layer_selection``
(false: every layer always, the MomS+AdamD baseline), ``selection_round`` (t), ``score_kernel``
(``batch`` | ``layers``), ``score_batch_size``, ``score_eps``, ``ratio_rule`` (``eigengap`` |
``density``), ``fixed_ratio`` (skip the Hessian test and use this r: ablations, cheap runs),
``hessian_batch_size``, ``exact_max_dimension`` (dense ``eigvalsh`` of the prompt Hessian up to this
many prompt parameters), ``lanczos_iterations`` and ``lanczos_max_iterations`` (SLQ steps, doubled
until the ratio moves by at most ``ratio_tolerance``), ``lanczos_probes``, ``min_layers``,
``control_variates``, ``server_base`` (``aggregate`` | ``previous``), ``server_variant``
(``paper`` | ``released``), ``server_lr_decay``, ``server_lr_min``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fedpeft.adapters.prompts import prefix_layer_keys, prompts_disabled
from fedpeft.config import ConfigError, ExperimentConfig
from fedpeft.federated.algorithm import Algorithm, MethodContext, register_algorithm
from fedpeft.federated.client import ModelSlot, TrainStats, train_client
from fedpeft.federated.client_store import ClientStateStore
from fedpeft.federated.strategy.robust import clipped_if_robust
from fedpeft.federated.types import ClientResult, ClientTask, State
from fedpeft.methods.fedpeptao.hessian import (
    RATIO_PROBE_FIELDS,
    RatioProbe,
    Spectrum,
    density_ratio,
    eigengap_ratio,
    flat,
    gap_ratio,
    hessian_vector_product,
    prompt_spectrum,
    secant_lipschitz,
)
from fedpeft.methods.fedpeptao.scoring import (
    aggregate_scores,
    batch_kernel_scores,
    layer_kernel_scores,
    select_layers,
)
from fedpeft.methods.fedpeptao.server import AdaptiveServer, AdaptiveServerOptions, ClientDelta
from fedpeft.models.encoding import EncodedData, model_inputs, training_batch
from fedpeft.seeding import derive_seed

LAYER_SCORES_KEY = "fedpeptao.layer_scores"
RATIO_PROBE_KEY = "fedpeptao.ratio_probe"  # RatioProbe.as_tensor: r_i, L, lambda_min, lambda_max, exact, steps, ...
PROBE_KEYS = (LAYER_SCORES_KEY, RATIO_PROBE_KEY)
PERSONALIZED_PREFIX = "personalized."


class FedPepTAOOptions(BaseModel):
    """FedPepTAO's extra ``strategy.*`` fields (``server_lr`` = eta^1, ``server_momentum`` = beta)."""

    model_config = ConfigDict(extra="ignore")

    layer_selection: bool = True
    selection_round: int = Field(10, ge=1)
    score_kernel: Literal["batch", "layers"] = "batch"
    score_batch_size: int = Field(8, ge=2)
    score_eps: float = Field(1e-5, gt=0)
    ratio_rule: Literal["eigengap", "density"] = "eigengap"
    fixed_ratio: float | None = Field(None, gt=0, le=1)
    hessian_batch_size: int = Field(8, ge=1)
    exact_max_dimension: int = Field(1024, ge=0)
    lanczos_iterations: int = Field(50, ge=2)
    lanczos_max_iterations: int = Field(800, ge=2)
    ratio_tolerance: float = Field(0.01, ge=0)
    lanczos_probes: int = Field(1, ge=1)
    min_layers: int = Field(1, ge=1)
    control_variates: bool = True
    server_base: Literal["aggregate", "previous"] = "aggregate"
    server_variant: Literal["paper", "released"] = "paper"
    server_lr_decay: float = Field(1.0, gt=0, le=1)
    server_lr_min: float = Field(0.0, ge=0)
    personalized_eval: bool = False


def parse_options(cfg: ExperimentConfig) -> FedPepTAOOptions:
    try:
        options = FedPepTAOOptions.model_validate(cfg.strategy.model_extra or {})
    except ValidationError as err:
        first = err.errors()[0]
        raise ConfigError(f"strategy.{first['loc'][0]}", first["msg"]) from None
    if options.lanczos_max_iterations < options.lanczos_iterations:
        raise ConfigError("strategy.lanczos_max_iterations", f"must be at least strategy.lanczos_iterations "
                          f"({options.lanczos_iterations}), got {options.lanczos_max_iterations}")
    return options


@register_algorithm
class FedPepTAO(Algorithm):
    name = "fedpeptao"
    strategy_options = (FedPepTAOOptions,)
    optimizer_fields = frozenset({"server_momentum"})  # Alg. 2's momentum
    robust_aggregations = ("none", "clip")  # Alg. 2's control variates need each device's own delta
    server_dp = False  # Alg. 2's own server step

    def __init__(self, cfg: ExperimentConfig, ctx: MethodContext) -> None:
        super().__init__(cfg, ctx)
        self.options = parse_options(cfg)
        self.layer_keys = prefix_layer_keys(ctx.backbone.model)
        self.other_keys = [k for k in ctx.slot.trainable if k not in self.layer_keys]
        self.server = AdaptiveServer(AdaptiveServerOptions(
            beta=cfg.strategy.server_momentum, lr=cfg.strategy.server_lr, lr_decay=self.options.server_lr_decay,
            lr_min=self.options.server_lr_min, local_lr=cfg.client.lr, num_devices=cfg.partition.num_clients,
            control_variates=self.options.control_variates, base=self.options.server_base,
            variant=self.options.server_variant))
        self.selected: list[int] | None = None
        self.ratio: float | None = None
        self.client_scores: dict[int, torch.Tensor] = {}
        self.client_samples: dict[int, int] = {}
        self.global_scores: torch.Tensor | None = None
        self.round_probes: list[dict[str, float]] = []  # this round's Hessian probes, for the round's metrics
        self.round_personalized: dict[str, dict[str, float]] = {}  # this round's personalised evaluations
        self.joined: set[int] = set()  # server side: clients whose reply was aggregated (they hold a full prompt)
        self.client_prompts = ClientStateStore("prompts")  # device side: each client's own full prompt
        self.initial_prompts: State = {}

    def attach_run_dir(self, run_dir: Path) -> None:
        """Prompts and control variates go to one file per client under ``run_dir/client_state/``."""
        self.client_prompts.attach(run_dir)
        self.server.client_controls.attach(run_dir)

    # ----- server side -------------------------------------------------------------------------
    def initial_state(self, state: State) -> State:
        self.initial_prompts = {k: state[k].clone() for k in self.layer_keys}
        return state

    def exchanged_keys(self) -> list[str]:
        if self.selected is None:
            return [*self.layer_keys, *self.other_keys]
        return [*(self.layer_keys[i] for i in self.selected), *self.other_keys]

    def configure_train(self, round_idx: int, clients: Sequence[int], global_state: State) -> list[ClientTask]:
        exchanged = self.exchanged_keys()
        tasks = []
        for client in clients:
            keys = list(exchanged)
            if self.selected is not None and client not in self.joined:
                keys = [*self.layer_keys, *self.other_keys]  # a newcomer gets its first full prompt once
            config = dict(self.strategy.client_config())
            before_selection = self.options.layer_selection and self.selected is None
            config["probe_scores"] = before_selection and client not in self.client_scores
            config["probe_ratio"] = before_selection and round_idx == self.options.selection_round
            tasks.append(ClientTask(client_id=client, payload={k: global_state[k] for k in keys},
                                    upload_keys=frozenset(exchanged), config=config))
        return tasks

    def aggregate(self, round_idx: int, global_state: State, results: Sequence[ClientResult]) -> State:
        replies = [ClientDelta(r.client_id,
                               clipped_if_robust(self.cfg.strategy,
                                                 {k: v for k, v in r.update.items() if k not in PROBE_KEYS}),
                               r.num_samples, int(r.metrics.get("steps", 1))) for r in results]
        new_state = self.server.step(round_idx, global_state, replies)
        self.joined.update(r.client_id for r in results)
        for r in results:
            if LAYER_SCORES_KEY in r.update:
                self.client_scores[r.client_id] = r.update[LAYER_SCORES_KEY].to(torch.float32).clone()
                self.client_samples[r.client_id] = r.num_samples
        self.round_personalized = {
            str(r.client_id): {k.removeprefix(PERSONALIZED_PREFIX): v for k, v in r.metrics.items()
                               if k.startswith(PERSONALIZED_PREFIX)} for r in results}
        self.round_personalized = {c: m for c, m in self.round_personalized.items() if m}
        probed = [r for r in results if RATIO_PROBE_KEY in r.update]
        self.round_probes = [{"client": r.client_id,
                              **dict(zip(RATIO_PROBE_FIELDS, r.update[RATIO_PROBE_KEY].tolist(), strict=True))}
                             for r in probed]
        ratios = [(p["ratio"], r.num_samples) for p, r in zip(self.round_probes, probed)]
        if self.options.layer_selection and round_idx == self.options.selection_round and self.options.fixed_ratio:
            ratios = [(self.options.fixed_ratio, 1)]
        if ratios:
            self._select(ratios)
        return new_state

    def _select(self, ratios: Sequence[tuple[float, int]]) -> None:
        """Alg. 1 lines 15-19 on the server."""
        total = float(sum(n for _, n in ratios))
        self.ratio = float(sum(r * n for r, n in ratios) / total)
        clients = sorted(self.client_scores)
        global_scores = aggregate_scores([self.client_scores[c] for c in clients],
                                         [self.client_samples[c] for c in clients])
        sizes = [self.initial_prompts[k].numel() for k in self.layer_keys]
        self.selected = select_layers(global_scores, self.ratio, sizes, self.options.min_layers)
        self.global_scores = global_scores
        self.server.forget([k for i, k in enumerate(self.layer_keys) if i not in self.selected])

    def round_metrics(self, round_idx: int, global_state: State) -> dict[str, Any]:
        metrics: dict[str, Any] = {
            "exchanged_layers": [i for i, k in enumerate(self.layer_keys) if k in set(self.exchanged_keys())],
            "server_lr": self.server.learning_rate(round_idx),
            "scored_clients": len(self.client_scores),
        }
        if self.round_personalized:  # each device's own model on its own data, beside the global eval
            per_client = self.round_personalized
            metrics["personalized_eval"] = per_client
            names = sorted({name for scores in per_client.values() for name in scores})
            metrics["personalized_mean"] = {name: float(np.mean([s[name] for s in per_client.values() if name in s]))
                                            for name in names}
            self.round_personalized = {}
        if self.round_probes:  # the selection round: every client's Hessian test, auditable
            metrics["ratio_probes"] = list(self.round_probes)
            for key, pick in (("lambda_min", min), ("lambda_max", max)):
                metrics[key] = pick(p[key] for p in self.round_probes)
            metrics["lipschitz"] = [p["lipschitz"] for p in self.round_probes]
            self.round_probes = []
        if self.selected is not None and self.global_scores is not None:
            metrics["selected_layers"] = list(self.selected)
            metrics["ratio"] = self.ratio
            metrics["global_scores"] = [float(s) for s in self.global_scores]
        return metrics

    # ----- device side -------------------------------------------------------------------------
    def device_state(self, client_id: int) -> State | None:
        return self.client_prompts.get(client_id)

    def load_device_state(self, client_id: int, state: State | None) -> None:
        if state is None:
            self.client_prompts.drop(client_id)
        else:
            self.client_prompts.put(client_id, state)

    def client_update(self, slot: ModelSlot, data: EncodedData, shard: np.ndarray, task: ClientTask,
                      seed: int, count_flops: bool) -> tuple[ClientResult, TrainStats]:
        own = self.client_prompts.get(task.client_id)
        if own is not None:  # the device's own copy of the layers the server did not send
            slot.load({k: v for k, v in own.items() if k not in task.payload})
        slot.load(task.payload)
        personalized = self.personalized_metrics(slot, data, shard) if own is not None else {}
        probes: State = {}
        probe_start = time.perf_counter()
        rng = np.random.default_rng(derive_seed(seed, "fedpeptao-probe"))
        if task.config.get("probe_scores"):
            probes[LAYER_SCORES_KEY] = self.score_layers(slot, data, shard, rng)
        if task.config.get("probe_ratio") and self.options.fixed_ratio is None:
            probes[RATIO_PROBE_KEY] = self.hessian_ratio(slot, data, shard, rng, seed).as_tensor()
        probe_seconds = time.perf_counter() - probe_start
        result, stats = train_client(slot, data, shard, task, self.cfg.client, seed, count_flops)
        stats.total_seconds += probe_seconds  # the client's compute time includes its probes
        result.metrics["probe_seconds"] = probe_seconds
        self.client_prompts.put(task.client_id, slot.read(self.layer_keys))
        result.update.update(probes)
        result.metrics.update(personalized)
        return result, stats

    def personalized_metrics(self, slot: ModelSlot, data: EncodedData, shard: np.ndarray) -> dict[str, float]:
        """With ``personalized_eval``: the task's metrics of the device's own model (its prompts, the
        received layers and head in place) on its own data, before it trains (the authors' code
        evaluates such personalised models). Keys ``personalized.<metric>``; empty when off."""
        if not self.options.personalized_eval:
            return {}
        from fedpeft.experiment import evaluate  # fedpeft.experiment imports the methods

        scores = evaluate(slot, data, self.ctx.task, {}, self.cfg.evaluation.batch_size, shard)
        return {f"{PERSONALIZED_PREFIX}{name}": float(value) for name, value in scores.items()}

    def extra_upload_shapes(self, task: ClientTask) -> dict[str, torch.Size]:
        shapes = {}
        if task.config.get("probe_scores"):
            shapes[LAYER_SCORES_KEY] = torch.Size([len(self.layer_keys)])
        if task.config.get("probe_ratio") and self.options.fixed_ratio is None:
            shapes[RATIO_PROBE_KEY] = torch.Size([len(RATIO_PROBE_FIELDS)])
        return shapes

    def _probe_batch(self, data: EncodedData, shard: np.ndarray, size: int, rng: np.random.Generator
                     ) -> dict[str, torch.Tensor]:
        chosen = rng.choice(len(shard), size=min(size, len(shard)), replace=False)
        return training_batch(data, [int(shard[i]) for i in sorted(chosen)])

    @torch.no_grad()
    def score_layers(self, slot: ModelSlot, data: EncodedData, shard: np.ndarray, rng: np.random.Generator
                     ) -> torch.Tensor:
        """Eq. 2-3 on one batch of this client's data, run without prompts: one score per layer."""
        batch = model_inputs(self._probe_batch(data, shard, self.options.score_batch_size, rng))
        slot.model.eval()
        with prompts_disabled(slot.model):
            hidden = slot.model(**batch, output_hidden_states=True).hidden_states[1:]
        mask = batch["attention_mask"]
        kernel = batch_kernel_scores if self.options.score_kernel == "batch" else layer_kernel_scores
        scores = kernel(hidden, mask, self.options.score_eps)
        return torch.as_tensor(scores, dtype=torch.float32).reshape(len(self.layer_keys))

    def hessian_ratio(self, slot: ModelSlot, data: EncodedData, shard: np.ndarray, rng: np.random.Generator,
                      seed: int) -> RatioProbe:
        """Alg. 1 lines 3-10 on one batch: the prompt Hessian's spectrum at w^t (exact or SLQ, see
        :func:`prompt_spectrum`), the secant L, then the ratio rule."""
        opts = self.options
        batch = self._probe_batch(data, shard, opts.hessian_batch_size, rng)
        params = [slot.params[k] for k in self.layer_keys]
        current = [p.detach().clone() for p in params]
        slot.model.eval()
        with torch.enable_grad():
            for p in params:
                p.requires_grad_(True)
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):  # twice differentiable
                slot.load(self.initial_prompts)
                shifted = flat(torch.autograd.grad(slot.model(**batch).loss, params))  # grad F(w^t + Delta)
                slot.load(dict(zip(self.layer_keys, current)))
                gradient, matvec = hessian_vector_product(slot.model(**batch).loss, params)
                initial = flat([self.initial_prompts[k] for k in self.layer_keys]).to(slot.device)
                delta = initial - flat(current)  # line 3
                lipschitz = secant_lipschitz(matvec(delta), gradient, shifted.detach(), delta)

                def ratio_of(spectrum: Spectrum) -> float:
                    if opts.ratio_rule == "density":
                        return density_ratio(spectrum.nodes, spectrum.weights)
                    if spectrum.exact:
                        return gap_ratio(spectrum.nodes, lipschitz)
                    return eigengap_ratio(spectrum.nodes, spectrum.weights, lipschitz, delta.numel())

                spectrum = prompt_spectrum(matvec, delta.numel(), ratio_of, opts.exact_max_dimension,
                                           opts.lanczos_iterations, opts.lanczos_max_iterations, opts.lanczos_probes,
                                           opts.ratio_tolerance, derive_seed(seed, "fedpeptao-lanczos"))
        return RatioProbe(ratio_of(spectrum), lipschitz, float(spectrum.nodes.min()), float(spectrum.nodes.max()),
                          delta.numel(), spectrum.exact, spectrum.steps, spectrum.converged)

    # ----- checkpoint ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["fedpeptao"] = {
            "server": self.server.state_dict(),
            "selected": self.selected,
            "ratio": self.ratio,
            "global_scores": self.global_scores,
            "client_scores": {str(c): s for c, s in self.client_scores.items()},
            "client_samples": {str(c): n for c, n in self.client_samples.items()},
            "joined": sorted(self.joined),
            "client_prompts": self.client_prompts.state_dict(),
        }
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        own = state["fedpeptao"]
        self.server.load_state_dict(own["server"])
        self.selected = None if own["selected"] is None else [int(i) for i in own["selected"]]
        self.ratio = own["ratio"]
        self.global_scores = own["global_scores"]
        self.client_scores = {int(c): s for c, s in own["client_scores"].items()}
        self.client_samples = {int(c): int(n) for c, n in own["client_samples"].items()}
        self.client_prompts.load_state_dict(own["client_prompts"])
        self.joined = {int(c) for c in own.get("joined", self.client_prompts)}
