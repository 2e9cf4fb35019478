"""FLASC (Kuo et al. 2024, ``002_...txt``, Alg. 1) and the sparsity baselines it is compared with.

FLASC: the server keeps *dense* LoRA (+ task head) weights P. Every round it sends the top
``d_down`` fraction of P by magnitude (Alg. 1 lines 5, 8: global over all trainable tensors,
the head included, as in the released code); the client loads those masked weights and fine-tunes
**every** entry densely (line 9: fresh SGD with momentum each round, the client section); its
update is cut to its own top ``d_up`` fraction (lines 10-12; no error feedback: whatever is not
sent is forgotten); the server averages the sparse updates into a pseudo-gradient and steps it
with the configured server strategy (lines 14-15; the recipe uses :mod:`fedadamw`, the released
code's AdamW on the plain mean over the sampled clients). ``d_up`` and ``d_down`` are
independent. The masks are applied here, by the method; the recipes' ``topk`` codecs at density 1
then put exactly the surviving nonzeros on the wire, so the recorded bytes are those of the real
sparse messages.

Baselines (paper Sec. 4.1-4.2 and App. A), all on the same machinery:

* ``sparse_adapter``: one dense round, then magnitude-prune the aggregated weights once to
  ``down_density`` and freeze that pattern for the server and the clients.
* ``adapter_lth``: iterative magnitude pruning, "fine-tuning" variant: every ``prune_every``
  rounds keep the top ``1 - prune_fraction`` of the surviving weights; the rest stay zero and
  frozen; no rewinding.
* ``federated_select``: clients download the top-``down_density`` subset of the dense server
  weights (recomputed every round) and train only that subset (client freezing).

Where the paper is silent we follow the released code (imkevinkuo/flasc): density schedule
``d_t = d * decay^((t - 1) // decay_every)`` per direction (its ``--dl/ul-density-decay``,
``--decay-freq``); clients of the freezing baselines train only the entries they received (its
gradient masking); the global model that is evaluated is the one clients download (its
``--eval-masked true``); after a pruning step the pruned server weights are zeroed (the released
code keeps them but never sends or evaluates them, which is the same model).

Options (``strategy`` section): ``down_density``, ``up_density``, ``down_density_decay``,
``up_density_decay``, ``decay_every``, ``mask_scope`` (``global`` | ``per_tensor``),
``dense_rounds`` (sparse_adapter), ``prune_fraction``, ``prune_every`` (adapter_lth), and two that
change what the weight masks (download, SparseAdapter's pattern, Adapter-LTH's pruning) keep:

* ``mask_score``: ``magnitude`` (default, the paper's |w|) or ``product``, the size of each LoRA
  entry's contribution to ``scale * B A``: ``|B_ik| ||A_k,:||`` for B and ``|A_kj| ||B_:,k||``
  for A (head entries: ``|w|``). Magnitude compares A and B on different scales: LoRA's B starts
  at 0 and server AdamW moves it by about ``server_lr`` per round, below most ``|A|``, so
  SparseAdapter's one-shot magnitude mask after one dense round keeps no B entry at all (a frozen
  B = 0: the model is a sparse linear probe). ``product`` is invariant to rescaling A by c and B
  by 1/c and keeps the entries that move the model (while B = 0 every LoRA score is 0 and ties go
  to the lower index, so it says nothing before B has moved). ``dense_rounds: k`` makes SparseAdapter
  choose its mask after k dense rounds (0: at initialisation, He et al.'s pruning at init, where
  B = 0 is always pruned); with magnitude scores it is no remedy at small server learning rates:
  on 20 Newsgroups after 3 dense rounds at server lr 3.5e-3 and 6.0e-3 the mask still kept 0 of
  B (``benchmarks/flasc.yaml``'s notes); ``product`` ranks A and B on one scale.
* ``dense_head``: false (default, the released main script ``train_sparse_lora_dp.py``: the
  top-k ranks the head's entries with LoRA's), true: the non-LoRA tensors (the task head) are
  never masked, pruned or sparsified, in both directions, and the densities count LoRA entries
  only, or ``down``: the released ``train_sparse_lora_het.py``, whose weight masks (the download)
  leave the head out and count LoRA entries while the upload top-k ranks the head's update
  entries with LoRA's and counts them all. Freezing clients never freeze a head that is kept out
  of the download mask (true or ``down``).
* ``mask_granularity``: ``entry`` (default, the paper's unstructured top-k) or ``rank``: the weight
  masks keep whole LoRA rank components (row k of A with column k of B, scored by the sum of their
  entries' scores), per module under ``mask_scope: per_tensor`` (every module keeps the same rank, a
  HetLoRA tier's budget) or over all modules under ``global``. It is the structured mask of the
  paper's Fig. 6 Federated Select ("an intermediate version of FLASC and Heterogeneous LoRA that
  allows the server to adjust the structured sparsity mask associated with each client budget
  tier"; the paper gives no score, so the family's ``mask_score`` ranks the components). A freezing
  client trains the components whose row of A arrived nonzero, B's column with it, so a component
  whose B is still 0 trains, where an entry mask would freeze that B, and uploads them whole (the tier
  bounds its update; only the base ``up_density`` cuts it further). The head has no components:
  ``rank`` needs ``dense_head`` (true or ``down``); Adapter-LTH prunes entries and refuses it.

Systems heterogeneity (paper Sec. 4.4, Fig. 6): ``density_tiers`` (default none: every client at
the densities above) gives each client a tier whose value scales both of its densities: a client of
tier value m downloads the top ``d_down * m`` and uploads its top ``d_up * m``. The paper draws
b_c in {1..b_s} (b_s = 2 or 4 tiers), gives HetLoRA rank 4^b_c and FLASC density
``(1/4)^(b_s - b_c)`` of a rank-4^b_s LoRA (``d = r_c / r_s``, about the same bytes); the released
``train_sparse_lora_het.py --syshet density`` runs three tiers, ranks 1 / 4 / 16 against densities
1/16, 1/4, 1 both ways: both densities 1, tiers ``[0.0625, 0.25, 1]`` and ``dense_head: down``
here. ``tier_assignment``: ``random`` (default, the paper: uniform, seeded from the run seed) or
``modulo`` (client id mod #tiers, the released code); it draws from HetLoRA's stream, so both
methods give a client the same tier under the same seed. Federated Select takes the same tiers,
with entry masks or (``mask_granularity: rank``) the structured ones of the paper's Fig. 6 arm;
SparseAdapter and Adapter-LTH keep one pattern for every client and refuse them. The model
evaluated (and deployed) is the one a client of tier value 1 downloads, at the base densities (the
released script logs one evaluation per tier; the paper does not say which Fig. 6 plots).

The masks are visible: every round logs, per group (``lora_A``, ``lora_B``, ``head``), the
fraction of entries the download kept (``down_kept``), the mean fraction of nonzero entries in
the clients' uploads (``up_kept``) and, for the freezing baselines, the pattern in force
(``mask_kept``).

FeDeRA's ``adapter.init: svd`` is refused wherever a LoRA entry is masked or pruned in the model a
client trains or the server evaluates (any download density < 1, SparseAdapter's pattern,
Adapter-LTH's pruning): the SVD puts W0's top-r part into A and B (the frozen residual is
W0 - scale B0 A0), so zeroing entries of A or B cuts pretrained weight out of the model instead
of restricting a learned update. Sparse *uploads* alone (``down_density: 1``) are fine: the
server's dense copy keeps every entry and only the update is cut.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, ClassVar, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from fedpeft.adapters.federa import refuse_svd_init
from fedpeft.config import ConfigError, ExperimentConfig
from fedpeft.federated.algorithm import Algorithm, MethodContext, register_algorithm
from fedpeft.federated.client import ModelSlot, TrainStats, train_client
from fedpeft.federated.sparse_codec import Scope, apply_masks, keep_count, topk_masks, topk_sparsify
from fedpeft.federated.strategy.fedadamw import validate_options
from fedpeft.federated.types import ClientResult, ClientTask, State
from fedpeft.methods.federa import lora_matrix
from fedpeft.methods.hetlora import TierAssignment, assign_tiers
from fedpeft.models.encoding import EncodedData

MaskScore = Literal["magnitude", "product"]
GROUPS = ("lora_A", "lora_B", "head")


class SparsityOptions(BaseModel):
    """The FLASC family's fields of the ``strategy`` section."""

    model_config = ConfigDict(extra="ignore")

    down_density: float = Field(1.0, gt=0, le=1)
    up_density: float = Field(1.0, gt=0, le=1)
    down_density_decay: float = Field(1.0, gt=0, le=1)
    up_density_decay: float = Field(1.0, gt=0, le=1)
    decay_every: int = Field(1, gt=0)
    mask_scope: Scope = "global"
    dense_rounds: int = Field(1, ge=0)
    prune_fraction: float = Field(0.02, gt=0, lt=1)
    prune_every: int = Field(1, gt=0)
    mask_score: MaskScore = "magnitude"
    dense_head: bool | Literal["down"] = False
    density_tiers: list[Annotated[float, Field(gt=0, le=1)]] | None = Field(None, min_length=1)
    tier_assignment: TierAssignment = "random"
    mask_granularity: Literal["entry", "rank"] = "entry"


def scheduled_density(density: float, decay: float, decay_every: int, round_idx: int) -> float:
    """``density * decay^((round - 1) // decay_every)``: the released code's step schedule (rounds from 1)."""
    return density * decay ** ((round_idx - 1) // decay_every)


def mask_density(masks: dict[str, torch.Tensor]) -> float:
    total = sum(m.numel() for m in masks.values())
    return float(sum(int(m.sum()) for m in masks.values()) / max(total, 1))


def entry_group(key: str) -> str:
    """``lora_A``, ``lora_B`` or ``head`` (every non-LoRA trainable tensor)."""
    kind = lora_matrix(key)
    return "head" if kind is None else f"lora_{kind}"


def group_fractions(state: State, kept: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per group of :func:`entry_group`, the fraction of ``state``'s entries that ``kept`` marks
    (a key without a mask counts as wholly kept)."""
    counts: dict[str, list[int]] = {}
    for key, value in state.items():
        count = counts.setdefault(entry_group(key), [0, 0])
        count[0] += int(kept[key].sum()) if key in kept else value.numel()
        count[1] += value.numel()
    return {group: kept_n / max(total, 1) for group, (kept_n, total) in counts.items()}


def lora_partner(key: str) -> str:
    """The other factor of a LoRA pair: ``...lora_A...`` <-> ``...lora_B...``."""
    return key.replace(".lora_A.", ".lora_B.") if lora_matrix(key) == "A" else key.replace(".lora_B.", ".lora_A.")


def weight_scores(state: State, score: MaskScore, scale: float) -> State:
    """What the weight masks rank (non-negative): ``|w|``, or with ``product`` each LoRA entry's
    contribution to ``scale * B A`` (the norm of the rank-one term it multiplies):
    ``scale |A_kj| ||B_:,k||`` for A (r x in), ``scale |B_ik| ||A_k,:||`` for B (out x r); non-LoRA
    entries by ``|w|``."""
    if score == "magnitude":
        return {key: value.detach().abs() for key, value in state.items()}
    scores = {}
    for key, value in state.items():
        kind = lora_matrix(key)
        if kind is None:
            scores[key] = value.detach().abs()
            continue
        partner = state[lora_partner(key)].detach().to(torch.float32)
        if kind == "A":
            scores[key] = scale * value.detach().abs() * torch.linalg.vector_norm(partner, dim=0)[:, None]
        else:
            scores[key] = scale * value.detach().abs() * torch.linalg.vector_norm(partner, dim=1)[None, :]
    return scores


def rank_masks(scores: State, density: float, scope: Scope = "global") -> dict[str, torch.Tensor]:
    """Masks that keep whole LoRA rank components: row k of A together with column k of B.

    A component's score is the sum of its entries' ``scores`` (row k of A plus column k of B); the
    top-``density`` components are kept per LoRA pair (``per_tensor``: every module keeps
    ``keep_count(r, density)``, HetLoRA's per-module rank budget) or over all pairs (``global``).
    Ties go to the lower index, so while every score is 0 (``product`` with B = 0) a pair keeps its
    first components, HetLoRA's slice. ``scores`` holds LoRA tensors only, each A with its B.
    """
    component = {a: scores[a].sum(dim=1) + scores[lora_partner(a)].sum(dim=0)
                 for a in scores if lora_matrix(a) == "A"}
    keep = topk_masks(component, density, scope)  # one score per component, ranked as entries are
    masks = {}
    for a in keep:
        b = lora_partner(a)
        masks[a] = keep[a][:, None].expand(scores[a].shape).clone()
        masks[b] = keep[a][None, :].expand(scores[b].shape).clone()
    return masks


def received_masks(payload: State, dense_head: bool, granularity: str) -> dict[str, torch.Tensor]:
    """What a freezing client may train, read off the payload alone (no extra bytes on the wire).

    ``entry``: every entry that arrived nonzero (the released code's gradient masking). ``rank``: whole
    components, those whose row of A arrived nonzero (A is never all zero at LoRA's random init), so
    a component's B column trains even while it is still 0. ``dense_head``: no head entry is frozen.
    """
    masks = {}
    for key, value in payload.items():
        kind = lora_matrix(key)
        if kind is None and dense_head:
            continue
        if granularity == "entry" or kind is None:
            masks[key] = value != 0
        elif kind == "A":  # B's mask follows its A's rows
            rows = (value != 0).any(dim=1)
            masks[key] = rows[:, None].expand(value.shape)
            masks[lora_partner(key)] = rows[None, :].expand(payload[lora_partner(key)].shape)
    return masks


def magnitude_prune(state: State, masks: dict[str, torch.Tensor], fraction: float) -> dict[str, torch.Tensor]:
    """Keep the top ``1 - fraction`` (by |value|, global) of the entries still in ``masks``; nested in them.
    Pass :func:`weight_scores` as ``state`` to rank by another score."""
    keys = sorted(state)
    alive = torch.cat([masks[k].reshape(-1) for k in keys])
    magnitude = torch.cat([state[k].detach().abs().reshape(-1).to(torch.float32) for k in keys])
    magnitude = torch.where(alive, magnitude, torch.full_like(magnitude, -1.0))  # pruned entries rank last
    keep = keep_count(int(alive.sum()), 1 - fraction)
    order = torch.sort(magnitude, descending=True, stable=True).indices[:keep]
    flat = torch.zeros_like(alive)
    flat[order] = True
    out, start = {}, 0
    for k in keys:
        n = state[k].numel()
        out[k] = flat[start : start + n].reshape(state[k].shape)
        start += n
    return out


def train_sparse_client(slot: ModelSlot, data: EncodedData, shard: np.ndarray, task: ClientTask, cfg: Any,
                        seed: int, count_flops: bool) -> tuple[ClientResult, TrainStats]:
    """The client side of the whole family; reads only ``task.payload`` and JSON ``task.config``.

    ``train_received_only``: only the received subset trains (freezing baselines): the gradients
    outside :func:`received_masks` are masked. ``up_density`` < 1: the update is cut to its own
    top-k (Alg. 1 lines 11-12), with no memory of what was dropped (no error feedback).
    ``dense_head``: the non-LoRA tensors are never frozen (a zero-initialised head bias would
    otherwise count as "not received"); ``dense_head_up``: nor sparsified on upload.
    """
    dense_head = bool(task.config.get("dense_head"))
    dense_head_up = bool(task.config.get("dense_head_up"))
    handles = []
    if task.config.get("train_received_only"):
        masks = received_masks(task.payload, dense_head, task.config.get("mask_granularity", "entry"))
        for key, mask in masks.items():
            received = mask.to(slot.device, task.payload[key].dtype)
            handles.append(slot.params[key].register_hook(lambda grad, m=received: grad * m))
    try:
        result, stats = train_client(slot, data, shard, task, cfg, seed, count_flops)
    finally:
        for handle in handles:
            handle.remove()
    up_density = float(task.config.get("up_density", 1.0))
    if up_density < 1:
        update = result.update
        masked = {k: v for k, v in update.items() if not (dense_head_up and lora_matrix(k) is None)}
        sparse = topk_sparsify(masked, up_density, task.config.get("mask_scope", "global"))
        result.update = {k: sparse.get(k, v) for k, v in update.items()}
    return result, stats


@register_algorithm
class Flasc(Algorithm):
    """FLASC (Alg. 1): sparse download of dense server weights, dense local training, sparse upload."""

    name = "flasc"
    strategy_options = (SparsityOptions,)
    freeze_clients: ClassVar[bool] = False
    one_pattern: ClassVar[bool] = False  # the pruning baselines: one mask for every client, no tiers
    prunes_entries: ClassVar[bool] = False  # Adapter-LTH: entry by entry, so no rank-component masks

    def __init__(self, cfg: ExperimentConfig, ctx: MethodContext) -> None:
        super().__init__(cfg, ctx)
        self.options: SparsityOptions = validate_options(SparsityOptions, cfg.strategy.model_extra or {}, "strategy")
        unpaired = [k for k in ctx.slot.trainable if lora_matrix(k) and lora_partner(k) not in ctx.slot.trainable]
        if self.options.mask_score == "product" and unpaired:
            raise ConfigError("strategy.mask_score", f"product needs both LoRA factors trainable; {unpaired[0]} "
                              "has no trainable partner (use magnitude)")
        if self.options.mask_granularity == "rank":
            head = [k for k in ctx.slot.trainable if lora_matrix(k) is None]
            if self.prunes_entries:
                raise ConfigError("strategy.mask_granularity", f"{self.name} prunes entries one by one "
                                  "(mask_granularity: entry)")
            if unpaired:
                raise ConfigError("strategy.mask_granularity", f"rank keeps whole LoRA components; {unpaired[0]} "
                                  "has no trainable partner (use entry)")
            if head and not self.options.dense_head:
                raise ConfigError("strategy.mask_granularity", f"rank keeps whole LoRA components and {head[0]} "
                                  "has none: set strategy.dense_head to true or down (or use entry)")
        tiers = self.options.density_tiers
        if tiers and self.one_pattern:
            raise ConfigError("strategy.density_tiers", f"{self.name} prunes one pattern for every client; "
                              "density tiers apply to flasc and federated_select")
        self.client_tiers = None if not tiers else [
            float(tiers[t]) for t in assign_tiers(cfg.partition.num_clients, len(tiers), self.options.tier_assignment,
                                                   cfg.seed)]
        self.check_init()
        self.dense: State = {}
        self.mask: dict[str, torch.Tensor] | None = None  # fixed/pruned pattern of the freezing baselines
        self.last: dict[str, Any] = {}

    def check_init(self) -> None:
        """Refuse FeDeRA's svd init where clients would train (and the server evaluate) masked LoRA."""
        o = self.options
        if o.down_density < 1 or o.down_density_decay < 1:
            refuse_svd_init(self.cfg.adapter, f"{self.name}'s download mask (strategy.down_density < 1)")
        if o.density_tiers and min(o.density_tiers) < 1:
            refuse_svd_init(self.cfg.adapter, f"{self.name}'s download mask (strategy.density_tiers below 1)")

    # -- densities and masks -------------------------------------------------------------------
    def down_density(self, round_idx: int) -> float:
        o = self.options
        return scheduled_density(o.down_density, o.down_density_decay, o.decay_every, round_idx)

    def up_density(self, round_idx: int) -> float:
        o = self.options
        return scheduled_density(o.up_density, o.up_density_decay, o.decay_every, round_idx)

    def maskable(self, state: State) -> State:
        """The tensors weight masks cover: all, or with ``dense_head`` (true or ``down``) the LoRA ones only."""
        return {k: v for k, v in state.items() if not (self.options.dense_head and lora_matrix(k) is None)}

    def scores(self, state: State) -> State:
        """:func:`weight_scores` of the maskable tensors of ``state`` under ``mask_score``."""
        scale = self.cfg.adapter.lora_alpha / self.cfg.adapter.r
        return weight_scores(self.maskable(state), self.options.mask_score, scale)

    def weight_masks(self, density: float) -> dict[str, torch.Tensor]:
        """Top-``density`` of the dense weights by score, entries or whole rank components
        (``mask_granularity``); tensors without a mask stay whole."""
        if self.options.mask_granularity == "rank":
            return rank_masks(self.scores(self.dense), density, self.options.mask_scope)
        return topk_masks(self.scores(self.dense), density, self.options.mask_scope)

    def tier(self, client: int) -> float:
        """The client's density tier value (1 without ``density_tiers``)."""
        return 1.0 if self.client_tiers is None else self.client_tiers[client]

    def download_masks(self, round_idx: int, tier: float = 1.0) -> dict[str, torch.Tensor] | None:
        """Alg. 1 line 5: top-``d_down`` (times a client's ``tier``) of |P|, recomputed from the dense
        weights every round."""
        density = self.down_density(round_idx) * tier
        return None if density >= 1 else self.weight_masks(density)

    def download(self, round_idx: int) -> State:
        """Alg. 1 line 8: what every client of ``round_idx`` receives (P masked)."""
        masks = self.download_masks(round_idx)
        return dict(self.dense) if masks is None else apply_masks(self.dense, masks)

    def after_step(self, round_idx: int) -> None:
        """Hook for the pruning baselines (FLASC keeps P dense)."""

    # -- round logic ---------------------------------------------------------------------------
    def initial_state(self, state: State) -> State:
        self.dense = {k: v.detach().clone() for k, v in state.items()}
        return self.download(1)

    def configure_train(self, round_idx: int, clients: Sequence[int], global_state: State) -> list[ClientTask]:
        """One payload per tier in the round (a single one without tiers), shared by its clients."""
        tiers = [self.tier(c) for c in clients]
        by_tier: dict[float, tuple[State, dict[str, Any], dict[str, Any]]] = {}
        for tier in set(tiers) or {1.0}:  # an empty round still logs the base download
            masks = self.download_masks(round_idx, tier)
            # a freezing client under rank masks trains whole received components: its tier already bounds
            # its update, and an entry top-k at the tier's fraction would cut components through the middle
            # (keep_count keeps at least one component; global masks need not hold the tier's entry share)
            whole = self.freeze_clients and masks is not None and self.options.mask_granularity == "rank"
            config = {
                **self.strategy.client_config(),
                "up_density": self.up_density(round_idx) * (1.0 if whole else tier),
                "mask_scope": self.options.mask_scope,
                "train_received_only": self.freeze_clients and masks is not None,
                "mask_granularity": self.options.mask_granularity,
                "dense_head": bool(self.options.dense_head),
                "dense_head_up": self.options.dense_head is True,
            }
            stats = {"down_density": 1.0 if masks is None else mask_density(masks),
                     "up_density": config["up_density"],
                     "down_kept": group_fractions(self.dense, masks or {})}
            by_tier[tier] = (dict(self.dense) if masks is None else apply_masks(self.dense, masks), config, stats)
        if self.client_tiers is None or not clients:
            self.last = dict(by_tier[1.0][2])
        else:  # means over the round's clients, and each one's tier
            per_client = [by_tier[t][2] for t in tiers]
            self.last = {"down_density": float(np.mean([s["down_density"] for s in per_client])),
                         "up_density": float(np.mean([s["up_density"] for s in per_client])),
                         "down_kept": {g: float(np.mean([s["down_kept"][g] for s in per_client]))
                                       for g in per_client[0]["down_kept"]},
                         "client_tiers": tiers}
        return [ClientTask(client_id=c, payload=by_tier[t][0], config=dict(by_tier[t][1]))
                for c, t in zip(clients, tiers, strict=True)]

    def client_update(self, slot: ModelSlot, data: EncodedData, shard: np.ndarray, task: ClientTask,
                      seed: int, count_flops: bool) -> tuple[ClientResult, TrainStats]:
        return train_sparse_client(slot, data, shard, task, self.cfg.client, seed, count_flops)

    def aggregate(self, round_idx: int, global_state: State, results: Sequence[ClientResult]) -> State:
        """Alg. 1 lines 14-15 on the dense P (not the masked copy), then the deployed (masked) model."""
        uploads = [group_fractions(r.update, {k: v != 0 for k, v in r.update.items()}) for r in results]
        self.last["up_kept"] = {group: float(np.mean([u[group] for u in uploads]))
                                for group in GROUPS if uploads and group in uploads[0]}
        self.dense = self.strategy.aggregate(self.dense, results)
        self.after_step(round_idx)
        return self.download(round_idx + 1)

    def round_metrics(self, round_idx: int, global_state: State) -> dict[str, Any]:
        metrics = dict(self.last)
        if self.mask is not None:
            metrics["mask_density"] = mask_density(self.mask)
            metrics["mask_kept"] = group_fractions(self.dense, self.mask)
        return metrics

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "dense": {k: v.clone() for k, v in self.dense.items()},
                "mask": None if self.mask is None else {k: m.clone() for k, m in self.mask.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.dense = {k: v.clone() for k, v in state["dense"].items()}
        mask = state.get("mask")
        self.mask = None if mask is None else {k: m.clone() for k, m in mask.items()}


@register_algorithm
class FederatedSelect(Flasc):
    """Federated Select (Charles et al. 2022) as FLASC's Sec. 4.2 runs it: FLASC's download, client freezing."""

    name = "federated_select"
    freeze_clients = True


@register_algorithm
class SparseAdapter(Flasc):
    """SparseAdapter (He et al. 2022) per FLASC App. A: ``dense_rounds`` dense, then prune once and freeze."""

    name = "sparse_adapter"
    freeze_clients = True
    one_pattern = True

    def check_init(self) -> None:
        if self.options.down_density < 1:
            refuse_svd_init(self.cfg.adapter, f"{self.name}'s pruning (strategy.down_density < 1)")

    def initial_state(self, state: State) -> State:
        public = super().initial_state(state)
        if self.options.dense_rounds > 0:
            return public
        self.after_step(0)  # pruning at initialisation
        return self.download(1)

    def download_masks(self, round_idx: int, tier: float = 1.0) -> dict[str, torch.Tensor] | None:
        return self.mask

    def after_step(self, round_idx: int) -> None:
        if self.mask is None and round_idx >= self.options.dense_rounds:
            self.mask = self.weight_masks(self.options.down_density)
        if self.mask is not None:
            self.dense = apply_masks(self.dense, self.mask)


@register_algorithm
class AdapterLTH(SparseAdapter):
    """Adapter LTH (Wu and Chen 2022) per FLASC App. A: iterative magnitude pruning, fine-tuning variant."""

    name = "adapter_lth"
    prunes_entries = True

    def check_init(self) -> None:
        refuse_svd_init(self.cfg.adapter, f"{self.name}'s iterative pruning")

    def after_step(self, round_idx: int) -> None:
        if round_idx % self.options.prune_every == 0:
            scores = self.scores(self.dense)
            alive = self.mask or {k: torch.ones_like(v, dtype=torch.bool) for k, v in scores.items()}
            self.mask = magnitude_prune(scores, alive, self.options.prune_fraction)
        if self.mask is not None:
            self.dense = apply_masks(self.dense, self.mask)
